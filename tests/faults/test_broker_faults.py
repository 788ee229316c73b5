"""Redis restarted (losing every queued message) and the beat SIGKILLed in the middle of a
run of disputes: no job is lost (the Postgres outbox re-publishes) and none is duplicated
into two verdicts."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.replay.conftest import record
from tests.replay.stack import kill, replay_stack

pytestmark = pytest.mark.slow


def test_redis_restart_and_beat_kill_mid_run(db_url: str, tmp_path: Path,
                                             tiny_engine: Any) -> None:
    with replay_stack(db_url, tmp_path) as stack:
        recs = record(tiny_engine, stack.producer, 16, seed=41, prefix="flt", max_tokens=200)
        with stack.client("ingester") as c:
            r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 30},
                       json={"envelopes": [x.envelope for x in recs]})
            assert r.status_code == 200 and r.json()["created"] == 16
        stack.worker("worker-a.pem")
        stack.wait_for(lambda: any(w["live"] for w in stack.client("reviewer").get(
            "/v1/workers").json()), 90, "the worker")
        disputes = [stack.dispute(x.request_id) for x in recs]
        time.sleep(0.5)  # some jobs running, some still queued in Redis
        beat = next(p for p in stack.procs if "beat" in p.args)
        kill(beat, signal.SIGKILL)
        stack.redis.stop()
        time.sleep(1.0)
        stack.redis.start()  # empty: every queued message is gone
        stack.spawn("beat", "--interval", "0.3", name="beat2")
        for d in disputes:
            done = stack.until_verdict(d["id"], timeout=180)
            assert done["verdict"]["outcome"] == "reproduced"
        with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
            per_job = conn.execute(
                "SELECT j.id, count(v.verdict_id) FROM replay_jobs j LEFT JOIN verdicts v "
                "ON v.job_id = j.id GROUP BY j.id").fetchall()
        assert len(per_job) == 16
        assert all(n == 1 for _, n in per_job), per_job
