"""Replay with real processes: `ledger serve`, `ledger beat`, `ledger worker` (Celery on a
private redis-server), PostgreSQL. Issue 5's acceptance 1, 2, 3 and 5."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger.replay.broker import TASK_REPLAY, make_celery
from ledger.settings import Settings
from tests.helpers import REPO
from tests.replay.conftest import record, tamper
from tests.replay.stack import Stack, kill, replay_stack

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(db_url: str, tmp_path: Path) -> Any:
    with replay_stack(db_url, tmp_path) as s:
        yield s


def ingest(stack: Stack, envelopes: list[dict[str, Any]]) -> None:
    with stack.client("ingester") as c:
        r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 30},
                   json={"envelopes": envelopes})
    assert r.status_code == 200 and r.json()["created"] == len(envelopes), r.text


def fingerprints(stack: Stack) -> dict[str, Any]:
    with stack.client("reviewer") as c:
        return dict(c.get("/v1/fingerprints").json())


def send_by_hand(stack: Stack, job_id: str, queue: str) -> None:
    app = make_celery(Settings(broker_url=stack.redis.url))
    app.send_task(TASK_REPLAY, args=[job_id], queue=queue)


def verdict_count(stack: Stack, job_id: str) -> int:
    with psycopg.connect(stack.db_url.replace("+psycopg", "")) as conn:
        return int(conn.execute("SELECT count(*) FROM verdicts WHERE job_id = %s",
                                (job_id,)).fetchone()[0])


def test_disputes_end_to_end_with_two_fingerprints(stack: Stack, tiny_engine: Any) -> None:
    from workers.engine import load_engine

    honest = record(tiny_engine, stack.producer, 5, seed=11, prefix="fp32")
    forged = tamper(honest[1], stack.producer, k=2, new_request_id="forged-fp32")
    bf16 = record(load_engine("tiny-demo", dtype="bfloat16"), stack.producer, 2, seed=12,
                  prefix="bf16")
    ingest(stack, [r.envelope for r in honest] + [forged.envelope] + [r.envelope for r in bf16])
    stack.worker("worker-a.pem")
    stack.wait_for(lambda: any(f["has_live_worker"] for f in fingerprints(stack)["items"]),
                   90, "worker A to register")

    d_honest = stack.dispute(honest[0].request_id)
    d_forged = stack.dispute("forged-fp32")
    d_bf16 = stack.dispute(bf16[0].request_id)

    done = stack.until_verdict(d_honest["id"])
    assert (done["verdict"]["outcome"], done["verdict"]["tier"]) == ("reproduced", "bitwise")
    assert done["proofs"]["envelope"]["log_index"] == done["envelope_log_index"]
    assert [e["kind"] for e in done["events"]] == ["opened", "queued", "replaying", "verdict"]
    fp32_fp = done["fingerprint_id"]
    assert done["verdict"]["fingerprint_id"] == fp32_fp

    bad = stack.until_verdict(d_forged["id"])
    div = bad["verdict"]["details"]["first_divergence"]
    original = honest[1].statement["predicate"]["output"]["token_ids"]
    assert bad["verdict"]["outcome"] == "diverged"
    assert (div["index"], div["expected_token"], div["replayed_token"]) == (
        2, (original[2] + 1) % 256, original[2])

    # the bf16 record has no worker: it waits, and says why
    waiting = stack.get_dispute(d_bf16["id"])
    assert waiting["state"] == "awaiting_worker"
    assert "no live worker" in waiting["state_reason"]
    fps = fingerprints(stack)
    assert waiting["fingerprint_id"] in fps["without_live_worker"]
    assert fp32_fp not in fps["without_live_worker"]
    time.sleep(2)
    assert stack.get_dispute(d_bf16["id"])["state"] == "awaiting_worker"

    stack.worker("worker-b.pem", dtype="bfloat16")
    late = stack.until_verdict(d_bf16["id"], timeout=120)
    assert (late["verdict"]["outcome"], late["verdict"]["tier"]) == ("reproduced", "bitwise")
    assert late["verdict"]["fingerprint_id"] == late["fingerprint_id"] != fp32_fp
    kinds = [e["kind"] for e in late["events"]]
    assert kinds == ["opened", "awaiting_worker", "queued", "replaying", "verdict"], kinds

    # a fp32 job put on the bf16 queue by hand is refused, not replayed, and leaves no
    # trace in the database (anyone with the broker could send such messages)
    attempts_before = stack.get_dispute(d_honest["id"])["attempts"]
    send_by_hand(stack, done["job_id"], f"replay.{late['fingerprint_id']}")
    stack.wait_for(lambda: any(f"job {done['job_id']} is for fingerprint" in p.read_text()
                               for p in stack.tmp.glob("worker-b*.log")),
                   60, "worker B to refuse the foreign job")
    assert stack.get_dispute(d_honest["id"])["attempts"] == attempts_before
    assert verdict_count(stack, done["job_id"]) == 1

    # the reviewer closes the loop; everything above verifies offline
    with stack.client("reviewer") as c:
        assert c.post(f"/v1/disputes/{d_forged['id']}/comments",
                      json={"text": "output altered at token 2"}).status_code == 201
        r = c.post(f"/v1/disputes/{d_forged['id']}/resolve",
                   json={"resolution": "upheld", "note": "gateway record was altered"})
        assert r.status_code == 200 and r.json()["state"] == "resolved"
    bundle = stack.tmp / "bundle.jsonl"
    rids = [honest[0].request_id, "forged-fp32", bf16[0].request_id]
    deadline = time.monotonic() + 30
    while True:  # wait until the resolve event is in a checkpoint
        out = subprocess.run(
            [sys.executable, "-m", "ledger.cli.main", "export", "--out", str(bundle),
             *[a for r in rids for a in ("--request-id", r)]], cwd=REPO,
            env={**os.environ, **stack.env}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = bundle.read_bytes().split(b"\n")[:-1]
        kinds_in = [json.loads(line)["kind"] for line in lines[1:]]
        if kinds_in.count("dispute_event") >= 9 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert kinds_in.count("envelope") == 3 and kinds_in.count("verdict") == 3
    verify = subprocess.run([sys.executable, "-m", "ledger.cli.main", "verify", str(bundle),
                             "--trust", stack.env["LEDGER_TRUST_POLICY_FILE"]], cwd=REPO,
                            capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "verdict records verified" in verify.stdout


def _running_worker_pid(stack: Stack, job_id: str) -> int | None:
    with psycopg.connect(stack.db_url.replace("+psycopg", "")) as conn:
        row = conn.execute("SELECT w.pid FROM replay_jobs j JOIN workers w "
                           "ON w.worker_id = j.worker_id WHERE j.id = %s AND j.state = 'running'",
                           (job_id,)).fetchone()
    return int(row[0]) if row else None


def test_worker_death_poison_duplicates_and_redis_restart(stack: Stack,
                                                          tiny_engine: Any) -> None:
    long = record(tiny_engine, stack.producer, 1, seed=21, prefix="long", max_tokens=900)
    plain = record(tiny_engine, stack.producer, 3, seed=22, prefix="plain")
    poison = record(tiny_engine, stack.producer, 1, seed=23, prefix="poison")
    ingest(stack, [r.envelope for r in long + plain + poison])
    a = stack.worker("worker-a.pem")
    a2 = stack.worker("worker-a2.pem")
    stack.wait_for(lambda: sum(len(f["live_workers"]) for f in fingerprints(stack)["items"])
                   >= 2 or len(_live(stack)) >= 2, 120, "two fp32 workers")

    # 1. SIGKILL the worker in the middle of a replay: the other one completes it
    d = stack.dispute(long[0].request_id)
    pid = stack.wait_for(lambda: _running_worker_pid(stack, d["job_id"]), 60, "replay to start")
    os.kill(pid, signal.SIGKILL)
    done = stack.until_verdict(d["id"], timeout=120)
    assert verdict_count(stack, d["job_id"]) == 1
    outcomes = [x["outcome"] for x in done["attempts"]]
    assert outcomes == ["worker_lost", "done"], done["attempts"]
    assert done["verdict"]["outcome"] == "reproduced"
    survivor = a2 if a.pid == pid else a

    # 2. the same job delivered twice more: still one verdict
    queue = f"replay.{done['fingerprint_id']}"
    send_by_hand(stack, done["job_id"], queue)
    send_by_hand(stack, done["job_id"], queue)
    stack.wait_for(lambda: stack.redis.queue_length(queue) == 0, 30, "the queue to drain")
    time.sleep(1)
    assert verdict_count(stack, done["job_id"]) == 1

    # 3. Redis restarted mid-run: disputes opened while it is down are not lost
    stack.redis.stop()
    d_down = stack.dispute(plain[0].request_id)
    assert d_down["state"] in ("queued", "awaiting_worker")
    time.sleep(1)
    stack.redis.start()
    assert stack.until_verdict(d_down["id"], timeout=120)["verdict"]["outcome"] == "reproduced"
    # and a message lost inside Redis (restart with a job queued but not consumed)
    kill(survivor, signal.SIGTERM)
    for p in (a, a2):
        kill(p, signal.SIGTERM)
    d_lost = stack.dispute(plain[1].request_id)
    stack.redis.stop()
    stack.redis.start()  # empty: the published message is gone
    stack.worker("worker-a.pem")
    assert stack.until_verdict(d_lost["id"], timeout=120)["verdict"]["outcome"] == "reproduced"

    # 4. a job that kills every worker that takes it ends poisoned after N attempts
    for p in list(stack.procs):
        if "worker" in " ".join(p.args):
            kill(p, signal.SIGTERM)
    crash_env = {"LEDGER_FAULT_CRASH_ON_REQUEST_ID": poison[0].request_id}
    d_poison = stack.dispute(poison[0].request_id)
    deadline = time.monotonic() + 240
    current = stack.worker("worker-c.pem", env=crash_env)
    deaths = 0
    while stack.get_dispute(d_poison["id"])["state"] != "verdict":
        assert time.monotonic() < deadline, "the poison job never concluded"
        if current.poll() is not None:
            deaths += 1
            current = stack.worker("worker-c.pem", env=crash_env)
        time.sleep(0.3)
    final = stack.get_dispute(d_poison["id"])
    assert final["verdict"]["outcome"] == "error"
    assert "poisoned" in final["verdict"]["details"]["reason"]
    assert deaths == 3, final["attempts"]
    assert [x["outcome"] for x in final["attempts"]] == ["worker_lost"] * 3
    assert current.poll() is None  # the worker that concluded it is alive


def _live(stack: Stack) -> list[str]:
    with stack.client("reviewer") as c:
        return [w["worker_id"] for w in c.get("/v1/workers").json() if w["live"]]
