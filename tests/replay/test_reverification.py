"""Scheduled re-verification and the fingerprint-change gate (in-process worker, real
PostgreSQL and a private Redis for the publish-once check)."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select

from ledger.db.models import ReplayJob, ReverificationPolicy, ReverificationRun, Worker
from ledger.db.session import session_scope
from ledger.replay import gate, jobs, reverification
from ledger.replay.broker import CeleryPublisher
from ledger.services import policies
from ledger.services.apikeys import Principal
from tests.replay.conftest import Stack, record
from tests.replay.stack import RedisServer
from tests.replay.test_replay_inprocess import ingest_all

ADMIN = Principal(key_id=str(uuid.uuid4()), name="admin", role="admin")


def _policy(stack: Stack, **kw: Any) -> ReverificationPolicy:
    """A policy made as the API makes one: a signed leaf with its row."""
    first = kw.pop("first_window_start", None)
    with session_scope(stack.db) as s:
        p, _ = policies.create_policy(s, ADMIN, stack.service, kw, first)
    return p


def _fake_live_worker(stack: Stack, fp: str, runtime: dict[str, Any]) -> None:
    """A worker row that heartbeats but consumes nothing (routing sees a live worker)."""
    with session_scope(stack.db) as s:
        s.add(Worker(worker_id=f"idle-{fp}", fingerprint_id=fp, runtime=runtime,
                     models=[], engine="reference", version="0", keyid="x", hostname="h",
                     pid=1))


def test_sampler_claims_each_window_once_even_concurrently(
        stack: Stack, tiny_engine: Any, tmp_path: Path) -> None:
    recs = record(tiny_engine, stack.producer, 40, seed=31, prefix="rv")
    ingest_all(stack, [r.envelope for r in recs])
    from ledger.core.fingerprint import fingerprint_id

    fp = fingerprint_id(tiny_engine.runtime())
    _fake_live_worker(stack, fp, tiny_engine.runtime())
    start = datetime.now(UTC) - timedelta(hours=1)
    policy = _policy(stack, name="hourly-5", interval_seconds=3600, sample_size=5,
                     first_window_start=start - timedelta(hours=1), min_age_seconds=0)
    # every envelope was recorded in the last hour: window [start, start+1h) holds them
    now = start + timedelta(hours=1, seconds=1)
    results: list[list[uuid.UUID]] = []
    threads = [threading.Thread(target=lambda: results.append(
        reverification.run_due(stack.db, stack.settings, stack.service, now))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = reverification.run_due(stack.db, stack.settings, stack.service, now)
    made = [r for part in results for r in part] + again
    with session_scope(stack.db) as s:
        runs = s.scalars(select(ReverificationRun).where(
            ReverificationRun.policy_id == policy.id)).all()
        assert len(runs) == 2  # the window before (empty) and the one holding the envelopes
        full = next(r for r in runs if r.sampled)
        assert full.sampled == 5
        run_jobs = s.scalars(select(ReplayJob).where(ReplayJob.run_id == full.id)).all()
        assert len(run_jobs) == 1 and run_jobs[0].state == "queued"
    assert len(made) == 2
    # the same sample, deterministically, from a fresh computation
    with session_scope(stack.db) as s:
        p = s.get(ReverificationPolicy, policy.id)
        first = reverification.sample(s, p, full.window_start, now)
        second = reverification.sample(s, p, full.window_start, now)
    assert first == second and len(first) == 5
    # published once: sweeping twice puts one message on the queue
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    try:
        settings = stack.settings.model_copy(update={"broker_url": redis_server.url})
        publisher = CeleryPublisher(settings)
        jobs.sweep(stack.db, publisher, settings, None)
        jobs.sweep(stack.db, publisher, settings, None)
        assert redis_server.queue_length(f"replay.{fp}") == 1
    finally:
        redis_server.stop()


def test_run_report_counts_and_drift(stack: Stack, tiny_engine: Any) -> None:
    from tests.replay.conftest import tamper
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 10, seed=32, prefix="rr")
    forged = tamper(recs[0], stack.producer, 1, "rr-forged")
    ingest_all(stack, [r.envelope for r in recs] + [forged.envelope])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.register()
    start = datetime.now(UTC) - timedelta(minutes=30)
    policy = _policy(stack, name="everything", interval_seconds=3600, sample_rate=1.0,
                     first_window_start=start)
    [run_id] = reverification.run_due(stack.db, stack.settings, stack.service,
                                      start + timedelta(hours=1))
    with session_scope(stack.db) as s:
        job_ids = [str(j) for j in s.scalars(select(ReplayJob.id).where(
            ReplayJob.run_id == run_id))]
    for jid in job_ids:
        assert worker.run_job(jid) == "done"
    with session_scope(stack.db) as s:
        rep = reverification.report(s, str(run_id))
    assert rep["sampled"] == 11 and rep["complete"]
    assert rep["counts"] == {"reproduced": 10, "diverged": 1}
    assert rep["diverged"] == [{"request_id": "rr-forged", "verdict_id": rep["diverged"][0][
        "verdict_id"], "first_divergence": 1}]
    [group] = rep["drift"]
    assert abs(group["drift_rate"] - 1 / 11) < 1e-9
    del policy


def test_new_fingerprint_gets_a_gate_run_at_tolerance(stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 6, seed=33, prefix="gate")
    ingest_all(stack, [r.envelope for r in recs])
    # a bf16 worker appears: its fingerprint has never recorded anything
    bf16 = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"], dtype="bfloat16",
                        signer=stack.worker_signer)
    bf16.register()
    made = gate.check_new_fingerprints(stack.db, stack.settings, stack.service)
    assert len(made) == 1
    assert gate.check_new_fingerprints(stack.db, stack.settings, stack.service) == []  # once
    with session_scope(stack.db) as s:
        run = s.get(ReverificationRun, made[0])
        assert run.kind == "gate" and run.sampled == 6
        assert run.details["new_fingerprint"] == bf16.fingerprint_id
        assert run.details["runtime_changes"]["dtype"] == ["float32", "bfloat16"]
        job_ids = [str(j.id) for j in s.scalars(select(ReplayJob).where(
            ReplayJob.run_id == run.id))]
        assert all(s.get(ReplayJob, uuid.UUID(j)).fingerprint_id == bf16.fingerprint_id
                   for j in job_ids)
    for jid in job_ids:
        assert bf16.run_job(jid) == "done"
    with session_scope(stack.db) as s:
        rep = reverification.report(s, str(made[0]))
    assert rep["complete"] and sum(rep["counts"].values()) == 6
    # bf16 vs fp32 numerics: judged at the tolerance tier, not refused as foreign
    assert "unverifiable" not in rep["counts"], rep
    assert set(rep["counts"]) <= {"reproduced", "diverged"}
    assert rep["details"]["tolerance"] == gate.GATE_TOLERANCE
