"""Replay in one process (no Redis): the verdict logic end to end on a real PostgreSQL
with the real engine. The multi-process Celery paths are in test_replay_workers.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import select

from ledger.db.models import Dispute, DisputeEvent, ReplayJob, Verdict
from ledger.db.session import session_scope
from ledger.log.integrator import integrate_all
from ledger.replay import disputes as dispute_service
from ledger.replay import jobs as job_service
from ledger.services import ingest
from tests.replay.conftest import Stack, record, tamper


def ingest_all(stack: Stack, envelopes: list[dict[str, Any]]) -> None:
    with session_scope(stack.db) as s:
        results = ingest.ingest(s, envelopes, stack.settings)
    assert all(r.status == 201 for r in results), [r.error for r in results if r.error]
    integrate_all(stack.db, stack.log_signer)


def open_dispute(stack: Stack, request_id: str) -> tuple[str, str]:
    with session_scope(stack.db) as s:
        d, created = dispute_service.open_dispute(
            s, request_id=request_id, reason="customer says the answer changed",
            priority="normal", actor="alice (reviewer)", signer=stack.service)
        assert created
        job = job_service.create_job(s, fingerprint_id=d.fingerprint_id, kind="dispute",
                                     items=[(d.envelope_index, d.request_id, d.id)],
                                     settings=stack.settings)
        d.job_id = job.id
        dispute_service.emit(s, d, job.state, "ledger", stack.service, state=job.state,
                             state_reason=job.state_reason)
        return str(d.id), str(job.id)


def test_honest_reproduces_bitwise_and_tampered_diverges_at_k(
        stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 9, seed=1)
    forged = tamper(recs[4], stack.producer, k=3, new_request_id="forged-4")
    ingest_all(stack, [r.envelope for r in recs] + [forged.envelope])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.self_check()
    worker.register()
    honest_ids = [open_dispute(stack, r.request_id) for r in recs]
    forged_dispute, forged_job = open_dispute(stack, "forged-4")
    for _, job_id in honest_ids:
        assert worker.run_job(job_id) == "done"
    assert worker.run_job(forged_job) == "done"
    assert worker.run_job(forged_job) == "skip"  # a second delivery: no second verdict
    with session_scope(stack.db) as s:
        for dispute_id, _ in honest_ids:
            d = s.get(Dispute, uuid.UUID(dispute_id))
            assert d is not None and d.state == "verdict"
            v = s.scalar(select(Verdict).where(Verdict.verdict_id == d.verdict_id))
            assert v is not None
            assert (v.outcome, v.tier) == ("reproduced", "bitwise"), v.details
        d = s.get(Dispute, uuid.UUID(forged_dispute))
        v = s.scalar(select(Verdict).where(Verdict.verdict_id == d.verdict_id))
        assert v.outcome == "diverged"
        div = v.details["first_divergence"]
        original = recs[4].statement["predicate"]["output"]["token_ids"]
        assert div["index"] == 3
        assert div["expected_token"] == (original[3] + 1) % 256
        assert div["replayed_token"] == original[3]
        assert div["expected_top_logprobs"]["k"] and div["replayed_top_logprobs"]["k"]
        assert v.details["max_abs_logprob_diff"] == 0.0  # identical before k
        assert s.scalar(select(Verdict).where(Verdict.job_id == uuid.UUID(forged_job))
                        .with_only_columns(Verdict.verdict_id)) is not None
        assert len(s.scalars(select(Verdict).where(
            Verdict.job_id == uuid.UUID(forged_job))).all()) == 1
        kinds = [e.kind for e in s.scalars(select(DisputeEvent).where(
            DisputeEvent.dispute_id == uuid.UUID(forged_dispute)).order_by(DisputeEvent.seq))]
        assert kinds == ["opened", "queued", "replaying", "verdict"]
        job = s.get(ReplayJob, uuid.UUID(forged_job))
        assert job.state == "done" and job.attempts == 1


def test_batched_job_gives_the_same_verdicts_as_one_at_a_time(
        stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 12, seed=2)
    ingest_all(stack, [r.envelope for r in recs])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer, max_batch=32)
    worker.register()
    with session_scope(stack.db) as s:
        env_rows = [(r.request_id,) for r in recs]
        from ledger.db.models import Envelope

        envs = {e.request_id: (e.log_index, e.fingerprint_id) for e in s.scalars(
            select(Envelope).where(Envelope.request_id.in_([r[0] for r in env_rows])))}
        fp = next(iter(envs.values()))[1]
        batch_job = job_service.create_job(
            s, fingerprint_id=fp, kind="reverification",
            items=[(envs[r.request_id][0], r.request_id, None) for r in recs],
            settings=stack.settings)
        singles = [job_service.create_job(s, fingerprint_id=fp, kind="reverification",
                                          items=[(envs[r.request_id][0], r.request_id, None)],
                                          settings=stack.settings) for r in recs]
        batch_id, single_ids = str(batch_job.id), [str(j.id) for j in singles]
    assert worker.run_job(batch_id) == "done"
    for jid in single_ids:
        assert worker.run_job(jid) == "done"
    with session_scope(stack.db) as s:
        batched = {v.request_id: (v.outcome, v.tier, v.details["replayed"])
                   for v in s.scalars(select(Verdict).where(
                       Verdict.job_id == uuid.UUID(batch_id)))}
        single = {v.request_id: (v.outcome, v.tier, v.details["replayed"])
                  for v in s.scalars(select(Verdict).where(
                      Verdict.job_id.in_([uuid.UUID(j) for j in single_ids])))}
    assert batched == single and len(batched) == 12
    assert {o for o, _, _ in batched.values()} == {"reproduced"}


def test_unverifiable_reasons(stack: Stack, tiny_engine: Any, tmp_path: Path) -> None:
    """A model the worker does not hold, and an envelope not yet in a checkpoint."""
    from ledger.core.envelope import output_digest
    from ledger.producer import envelope_to_json, sign_statement
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 2, seed=3)
    st = recs[0].statement
    st["predicate"]["artifacts"]["model_sha256"] = "00" * 32
    st["predicate"]["request_id"] = "other-model"
    st["subject"] = [{"name": "other-model", "digest": {
        "sha256": output_digest(st["predicate"]["output"]["token_ids"])}}]
    ingest_all(stack, [envelope_to_json(sign_statement(st, stack.producer))])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.register()
    _, job_id = open_dispute(stack, "other-model")
    assert worker.run_job(job_id) == "done"
    with session_scope(stack.db) as s:
        v = s.scalar(select(Verdict).where(Verdict.job_id == uuid.UUID(job_id)))
        assert v.outcome == "unverifiable"
        assert "not on this worker" in v.details["reason"]
