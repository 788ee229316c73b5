"""Disputes never wait on the broker: with Redis stopped, `POST /v1/disputes` answers at
once (each within 200 ms) and leaves its job in the outbox; once Redis is back on the same
port, `ledger beat`'s sweeper delivers the jobs and a real worker gives exactly one verdict
each. Real processes: `ledger serve`, `ledger beat`, `ledger worker`, a private
redis-server, PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.replay.conftest import record
from tests.replay.stack import replay_stack

pytestmark = pytest.mark.slow

# The API's publish gives up after LEDGER_BROKER_PUBLISH_TIMEOUT_S (0.1 s); without that
# bound a publish to a Redis that is down waits out Celery's connection retries (seconds).
# 1 s tells the two apart on a loaded 2-core machine, where one POST takes ~0.3 s with
# Redis up.
LIMIT_S = 1.0


def _jobs(db_url: str, job_ids: list[str]) -> list[tuple[str, Any, int]]:
    """(state, published_at, verdicts) per job, in the given order."""
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        out = []
        for jid in job_ids:
            row = conn.execute(
                "SELECT state, published_at, (SELECT count(*) FROM verdicts v "
                "WHERE v.job_id = j.id) FROM replay_jobs j WHERE id = %s", (jid,)).fetchone()
            assert row is not None
            out.append((str(row[0]), row[1], int(row[2])))
        return out


def test_disputes_answer_at_once_while_redis_is_down_and_are_delivered_after(
        db_url: str, tmp_path: Path, tiny_engine: Any) -> None:
    with replay_stack(db_url, tmp_path) as stack:
        recorded = record(tiny_engine, stack.producer, 6, seed=31, prefix="down")
        with stack.client("ingester") as c:
            r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 30},
                       json={"envelopes": [x.envelope for x in recorded]})
        assert r.status_code == 200 and r.json()["created"] == len(recorded), r.text
        stack.worker("worker-a.pem")

        def live() -> bool:
            with stack.client("reviewer") as c:
                return any(w["live"] for w in c.get("/v1/workers").json())

        stack.wait_for(live, 90, "the worker to register")
        *recorded, spare = recorded
        with stack.client("reviewer") as c:  # for the failure message: the same call, Redis up
            c.get("/v1/disputes", params={"limit": 1})
            started = time.perf_counter()
            assert c.post("/v1/disputes", json={"request_id": spare.request_id,
                                                "reason": "Redis up"}).status_code == 201
            took_up = time.perf_counter() - started

        stack.redis.stop()
        opened: list[dict[str, Any]] = []
        took: list[float] = []
        with stack.client("reviewer") as c:
            c.get("/v1/disputes", params={"limit": 1})  # the connection is set up
            for rec in recorded:
                started = time.perf_counter()
                resp = c.post("/v1/disputes", json={"request_id": rec.request_id,
                                                    "reason": "opened while Redis is down"})
                took.append(time.perf_counter() - started)
                assert resp.status_code == 201, resp.text
                assert resp.json()["state"] == "queued"  # a live worker has its fingerprint
                opened.append(resp.json())
        assert max(took) < LIMIT_S, (f"POST /v1/disputes with Redis down took {took} s "
                                     f"(with Redis up: {took_up:.3f} s)")
        job_ids = [d["job_id"] for d in opened]
        # nothing got through: every job waits in the outbox, unpublished, no verdict
        assert [(s, p, v) for s, p, v in _jobs(stack.db_url, job_ids)] == [
            ("queued", None, 0)] * len(job_ids)
        time.sleep(1.0)  # beat sweeps meanwhile, and fails to publish too
        assert all(p is None for _, p, _ in _jobs(stack.db_url, job_ids))

        stack.redis.start()  # same port, empty
        for d in opened:
            done = stack.until_verdict(d["id"], timeout=120)
            assert done["verdict"]["outcome"] == "reproduced", done["verdict"]
        time.sleep(2.0)  # a duplicate delivery would have produced a second verdict by now
        states = _jobs(stack.db_url, job_ids)
        assert [(s, v) for s, _, v in states] == [("done", 1)] * len(job_ids), states
        for d in opened:  # one delivery each, run once
            attempts = stack.get_dispute(d["id"])["attempts"]
            assert [a["outcome"] for a in attempts] == ["done"], attempts
