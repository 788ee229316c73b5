"""Replay jobs: creation, routing by fingerprint, the sweeper, claiming and finishing.

A job belongs to one fingerprint and is published to the queue ``replay.<fingerprint_id>``
that only workers with exactly that runtime consume. Postgres is the outbox: a job is
created in the transaction that needs it; after commit the API publishes that job alone
(:func:`publish`, with a short broker timeout: a request never waits on a broker that is
down), and the sweeper (``ledger beat``) publishes whatever was not published, not started
in time, or held by a worker that stopped heartbeating. Attempts are counted
when a worker claims a job; past ``max_attempts`` the job is poisoned instead of run.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from ledger.core.states import DISPUTE_DECIDED, JOB_FINISHED, JobState
from ledger.db.models import Dispute, JobAttempt, ReplayJob, ReplayJobItem, Worker
from ledger.db.session import session_scope
from ledger.replay import disputes
from ledger.replay.broker import Publisher
from ledger.replay.records import Signer
from ledger.settings import Settings

log = logging.getLogger("ledger.jobs")


#: the channel a worker notifies when it registers (``ledger beat`` listens and ticks)
WORKER_CHANNEL = "ledger_workers"


def live_fingerprints(session: Session, settings: Settings) -> dict[str, list[str]]:
    """fingerprint_id -> live worker IDs (heartbeat within ``worker_dead_after_s``)."""
    cutoff = datetime.now(UTC) - timedelta(seconds=settings.worker_dead_after_s)
    rows = session.execute(select(Worker.fingerprint_id, Worker.worker_id).where(
        Worker.last_heartbeat >= cutoff, Worker.stopped_at.is_(None))).all()
    out: dict[str, list[str]] = {}
    for fp, wid in rows:
        out.setdefault(fp, []).append(wid)
    return out


def worker_command(runtime: dict[str, Any] | None) -> str:
    """The commands that print and then serve ``runtime``'s fingerprint on a node like it
    (the options `ledger fingerprint` and `ledger worker` share)."""
    runtime = runtime or {}
    engine = str(runtime.get("engine") or "")
    if engine.startswith("vendor:"):        # a vendor record (ledger.core.vendor)
        return (f"a vendor worker for {engine.removeprefix('vendor:')!r} runs it: "
                f"`LEDGER_VENDOR_NAME={engine.removeprefix('vendor:')} "
                "LEDGER_VENDOR_BASE_URL=... LEDGER_VENDOR_API_KEY_FILE=... "
                "ledger worker --vendor`")
    opts = []
    if runtime.get("engine") not in (None, "reference"):
        opts.append(f"--engine {runtime['engine']}")
    device = runtime.get("device") or "cpu"
    if device != "cpu":
        opts.append(f"--device {device}")
    if runtime.get("dtype") not in (None, "float32"):
        opts.append(f"--dtype {runtime['dtype']}")
    if device == "cpu" and runtime.get("cpu_threads") not in (None, 1):
        opts.append(f"--threads {runtime['cpu_threads']}")
    if runtime.get("batch_invariant") is False:
        opts.append("--no-batch-invariant")
    shown = "".join(f" {o}" for o in opts)
    worker_opts = "".join(f" {o}" for o in opts if o != "--no-batch-invariant")
    return (f"`ledger fingerprint{shown}` prints it on a matching node; there run "
            f"`ledger worker --models DIR{worker_opts}`")


def no_worker_reason(fingerprint_id: str, runtime: dict[str, Any] | None = None) -> str:
    return (f"no live worker has fingerprint {fingerprint_id}; the job waits for one: "
            f"{worker_command(runtime)} (`ledger beat` routes the job to it as soon as it "
            "registers)")


def _reason(session: Session, fingerprint_id: str) -> str:
    from ledger.db.models import Fingerprint

    row = session.get(Fingerprint, fingerprint_id)
    return no_worker_reason(fingerprint_id, row.runtime if row is not None else None)


def create_job(session: Session, *, fingerprint_id: str, kind: str,
               items: Sequence[tuple[int, str, uuid.UUID | None]], settings: Settings,
               priority: int = 1, tolerance: float | None = None,
               run_id: uuid.UUID | None = None,
               params: dict[str, Any] | None = None) -> ReplayJob:
    """A job over ``items`` (envelope log index, request_id, dispute id), routed now;
    ``params``: what a matrix job runs."""
    live = live_fingerprints(session, settings)
    state = JobState.QUEUED if fingerprint_id in live else JobState.AWAITING_WORKER
    job = ReplayJob(id=uuid.uuid4(), fingerprint_id=fingerprint_id, kind=kind, state=state,
                    state_reason=None if state == JobState.QUEUED
                    else _reason(session, fingerprint_id),
                    priority=priority, max_attempts=settings.replay_max_attempts,
                    tolerance=tolerance, run_id=run_id, params=params)
    session.add(job)
    session.flush()
    session.add_all(ReplayJobItem(job_id=job.id, position=i, envelope_index=idx,
                                  request_id=rid, dispute_id=did)
                    for i, (idx, rid, did) in enumerate(items))
    session.flush()
    return job


def job_disputes(session: Session, job_id: uuid.UUID, *, lock: bool = True) -> list[Dispute]:
    ids = [d for d in session.scalars(select(ReplayJobItem.dispute_id).where(
        ReplayJobItem.job_id == job_id, ReplayJobItem.dispute_id.is_not(None)))]
    if not ids:
        return []
    stmt = select(Dispute).where(Dispute.id.in_(ids)).order_by(Dispute.id)
    return list(session.scalars(stmt.with_for_update() if lock else stmt))


def _mirror(session: Session, job: ReplayJob, state: str, signer: Signer | None,
            actor: str, reason: str | None, body: dict[str, Any] | None = None) -> None:
    """Move the job's open disputes to ``state`` with a signed event."""
    if signer is None:
        return
    for d in job_disputes(session, job.id):
        if d.state in DISPUTE_DECIDED or (d.state == state and state != JobState.QUEUED):
            continue
        disputes.emit(session, d, state, actor, signer, {"job_id": str(job.id), **(body or {})},
                      state=state, state_reason=reason)


@dataclass
class SweepReport:
    published: list[str] = field(default_factory=list)
    awaiting: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)


def sweep(engine: Engine, publisher: Publisher | None, settings: Settings,
          signer: Signer | None, *, actor: str = "ledger") -> SweepReport:
    """One pass of the outbox sweeper (idempotent; safe to run from several processes:
    rows are claimed with SKIP LOCKED)."""
    report = SweepReport()
    now = datetime.now(UTC)
    to_publish: list[tuple[str, str]] = []
    with session_scope(engine) as session:
        live = live_fingerprints(session, settings)
        jobs = list(session.scalars(
            select(ReplayJob).where(ReplayJob.state.in_((JobState.QUEUED, JobState.AWAITING_WORKER,
                                                         JobState.RUNNING)))
            .order_by(ReplayJob.priority.desc(), ReplayJob.created_at)
            .with_for_update(skip_locked=True).limit(500)))
        dead_cutoff = now - timedelta(seconds=settings.worker_dead_after_s)
        for job in jobs:
            fp_live = job.fingerprint_id in live
            if job.state == JobState.RUNNING:
                worker = session.get(Worker, job.worker_id) if job.worker_id else None
                if worker is not None and worker.last_heartbeat >= dead_cutoff \
                        and worker.stopped_at is None:
                    continue
                session.execute(update(JobAttempt).where(
                    JobAttempt.job_id == job.id, JobAttempt.finished_at.is_(None)).values(
                    finished_at=now, outcome="worker_lost",
                    detail=f"worker {job.worker_id} stopped heartbeating"))
                job.state, job.worker_id, job.published_at = JobState.QUEUED, None, None
                job.state_reason = "its worker was lost; re-queued"
                report.recovered.append(str(job.id))
                _mirror(session, job, JobState.QUEUED, signer, actor, job.state_reason,
                        {"worker_lost": True})
            if job.state == JobState.AWAITING_WORKER and fp_live:
                job.state, job.state_reason, job.published_at = JobState.QUEUED, None, None
                _mirror(session, job, JobState.QUEUED, signer, actor, None)
            elif job.state == JobState.QUEUED and not fp_live:
                job.state = JobState.AWAITING_WORKER
                job.state_reason = _reason(session, job.fingerprint_id)
                report.awaiting.append(str(job.id))
                _mirror(session, job, JobState.AWAITING_WORKER, signer, actor, job.state_reason)
            if job.state == JobState.QUEUED and (
                    job.published_at is None
                    or job.published_at < now - timedelta(seconds=settings.republish_after_s)):
                to_publish.append((str(job.id), job.fingerprint_id))
        # disputes opened but not yet routed (their job row is written in the same
        # transaction, so this only catches events the API could not sign at the time)
    if publisher is not None:
        report.published.extend(publish(engine, publisher, to_publish))
    return report


def publish(engine: Engine, publisher: Publisher,
            jobs: Sequence[tuple[str, str]]) -> list[str]:
    """Publish ``jobs`` (job ID, fingerprint ID) and stamp ``published_at`` on each that got
    through; returns their IDs. One that does not (broker down) is logged and left as it is:
    still unpublished in the outbox, so the sweeper delivers it later."""
    published: list[str] = []
    for job_id, fp in jobs:
        try:
            publisher.publish(job_id, fp)
        except Exception as exc:  # noqa: BLE001 - broker down: the next sweep retries
            log.warning("could not publish job %s: %s", job_id, exc)
            continue
        with session_scope(engine) as session:
            session.execute(update(ReplayJob).where(
                ReplayJob.id == uuid.UUID(job_id), ReplayJob.state == JobState.QUEUED).values(
                published_at=datetime.now(UTC)))
        published.append(job_id)
    return published


@dataclass(frozen=True)
class Claim:
    """What a worker may do with a delivered job."""

    action: str            # "run" | "skip" | "refuse" | "poison"
    reason: str = ""
    attempt: int = 0


def claim(session: Session, job_id: str, *, worker_id: str, fingerprint_id: str,
          settings: Settings) -> tuple[ReplayJob | None, Claim]:
    """Decide, under the job's row lock, whether this worker runs this delivery."""
    try:
        jid = uuid.UUID(job_id)
    except ValueError:
        return None, Claim("skip", "not a job ID")
    job = session.get(ReplayJob, jid, with_for_update=True)
    if job is None:
        return None, Claim("skip", "no such job")
    if job.fingerprint_id != fingerprint_id:
        session.add(JobAttempt(job_id=job.id, attempt=job.attempts, worker_id=worker_id,
                               fingerprint_id=fingerprint_id, finished_at=datetime.now(UTC),
                               outcome="refused",
                               detail=f"job is for {job.fingerprint_id}, worker is "
                                      f"{fingerprint_id}: not replayed"))
        if job.state in (JobState.QUEUED, JobState.AWAITING_WORKER):
            job.published_at = None  # let the sweeper re-publish it to its own queue
        session.flush()
        return job, Claim("refuse", f"fingerprint mismatch: job {job.fingerprint_id}, "
                                    f"worker {fingerprint_id}")
    if job.state in JOB_FINISHED:
        return job, Claim("skip", f"job already {job.state} (duplicate delivery)")
    if job.state == JobState.RUNNING and job.worker_id and job.worker_id != worker_id:
        cutoff = datetime.now(UTC) - timedelta(seconds=settings.worker_dead_after_s)
        other = session.get(Worker, job.worker_id)
        if other is not None and other.last_heartbeat >= cutoff and other.stopped_at is None:
            return job, Claim("skip", f"worker {job.worker_id} is running it")
    if job.state == JobState.RUNNING:  # its previous worker died mid-replay
        session.execute(update(JobAttempt).where(
            JobAttempt.job_id == job.id, JobAttempt.finished_at.is_(None)).values(
            finished_at=datetime.now(UTC), outcome="worker_lost",
            detail=f"worker {job.worker_id} died during the replay"))
    if job.attempts >= job.max_attempts:
        return job, Claim("poison", f"{job.attempts} deliveries did not finish "
                                    f"(max {job.max_attempts}): poisoned", job.attempts)
    job.attempts += 1
    job.state, job.worker_id, job.started_at = JobState.RUNNING, worker_id, datetime.now(UTC)
    job.state_reason = None
    session.add(JobAttempt(job_id=job.id, attempt=job.attempts, worker_id=worker_id,
                           fingerprint_id=fingerprint_id))
    session.flush()
    return job, Claim("run", attempt=job.attempts)


def finish(session: Session, job: ReplayJob, *, state: str, worker_id: str,
           detail: str | None = None, attempt_outcome: str | None = None) -> None:
    now = datetime.now(UTC)
    job.state, job.finished_at = state, now
    if detail:
        job.last_error = detail
    session.execute(update(JobAttempt).where(
        JobAttempt.job_id == job.id, JobAttempt.worker_id == worker_id,
        JobAttempt.finished_at.is_(None)).values(finished_at=now,
                                                 outcome=attempt_outcome or state,
                                                 detail=detail))
    session.flush()
