"""Reading the review side back: disputes (with their signed trail), verdicts, workers,
fingerprints, re-verification policies and runs, as the API and the console serve them.

Every value a reader could take for a fact comes from signed bytes where there are any
(:mod:`ledger.replay.views`): a dispute's state, resolution and verdict are folded from its
signed events, a verdict's fields from the worker's signed statement, and ``integrity``
names the stored columns that disagree. Lists are paged with the one cursor of
:mod:`ledger.services.pagination`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ledger.core.states import JobState
from ledger.db.models import (
    Dispute,
    DisputeEvent,
    Envelope,
    Fingerprint,
    JobAttempt,
    ReplayJob,
    ReverificationPolicy,
    ReverificationRun,
    Verdict,
    Worker,
)
from ledger.errors import NotFound
from ledger.log import proofs
from ledger.replay import jobs as job_service
from ledger.replay import reverification, views
from ledger.services.pagination import KeyKind, Page, SortKey, page, query_digest
from ledger.settings import Settings

TIME_AND_ID: tuple[KeyKind, ...] = ("time", "uuid")
DISPUTE_ORDER = SortKey(((Dispute.opened_at, True), (Dispute.id, False)), TIME_AND_ID)
RUN_ORDER = SortKey(((ReverificationRun.created_at, True), (ReverificationRun.id, True)),
                    TIME_AND_ID)
POLICY_ORDER = SortKey(((ReverificationPolicy.created_at, False),
                        (ReverificationPolicy.id, False)), TIME_AND_ID)


def proof_or_none(session: Session, index: int | None) -> dict[str, Any] | None:
    """The inclusion proof of log entry ``index``, or None until it is integrated."""
    if index is None:
        return None
    try:
        return proofs.inclusion(session, index).to_json()
    except proofs.NotYetIntegrated:
        session.rollback()
        return None


# --- disputes --------------------------------------------------------------------------

def _stored_events(session: Session, dispute_id: uuid.UUID) -> list[DisputeEvent]:
    return list(session.scalars(select(DisputeEvent).where(
        DisputeEvent.dispute_id == dispute_id).order_by(DisputeEvent.seq)))


def _signed_events(stored: list[DisputeEvent]) -> list[dict[str, Any]]:
    return views.served_events(
        (bytes(e.dsse), {"event_id": e.event_id, "dispute_id": e.dispute_id, "seq": e.seq,
                         "kind": e.kind, "actor": e.actor, "body": e.body, "at": e.at})
        for e in stored)


def _summary(d: Dispute, signed_events: list[dict[str, Any]]) -> dict[str, Any]:
    derived = views.served_dispute(signed_events, {
        "id": d.id, "request_id": d.request_id, "state": d.state,
        "state_reason": d.state_reason, "resolution": d.resolution,
        "resolution_note": d.resolution_note, "resolved_by": d.resolved_by,
        "resolved_at": d.resolved_at, "verdict_id": d.verdict_id})
    return {
        "id": str(d.id), "request_id": d.request_id, "envelope_log_index": d.envelope_index,
        "fingerprint_id": d.fingerprint_id, "reason": d.reason, "priority": d.priority,
        "opened_by": d.opened_by, "opened_at": d.opened_at, "updated_at": d.updated_at,
        "job_id": str(d.job_id) if d.job_id else None,
        **{k: derived[k] for k in ("state", "state_reason", "verdict_id", "resolution",
                                   "resolution_note", "resolved_by", "resolved_at",
                                   "integrity")},
    }


def dispute_summary(session: Session, d: Dispute) -> dict[str, Any]:
    """A dispute's fields; state, resolution, note, resolver and verdict folded from its
    signed events (the ``disputes`` row is a cache, flagged in ``integrity`` if it
    differs)."""
    return _summary(d, _signed_events(_stored_events(session, d.id)))


def dispute_timeline(session: Session, d: Dispute) -> list[dict[str, Any]]:
    """Every event of a dispute as signed, in order, with its log index."""
    stored = _stored_events(session, d.id)
    return [_event_out(e, s) for e, s in zip(stored, _signed_events(stored), strict=True)]


def _event_out(e: DisputeEvent, signed: dict[str, Any]) -> dict[str, Any]:
    return {"seq": signed["seq"], "event_id": signed["event_id"], "kind": signed["kind"],
            "actor": signed["actor"], "at": signed["at"], "body": signed["body"],
            "log_index": e.log_index, "integrity": signed["integrity"]}


def _attempts(session: Session, job_id: uuid.UUID | None) -> list[dict[str, Any]]:
    if job_id is None:
        return []
    return [{"attempt": a.attempt, "worker_id": a.worker_id,
             "fingerprint_id": a.fingerprint_id, "started_at": a.started_at,
             "finished_at": a.finished_at, "outcome": a.outcome, "detail": a.detail}
            for a in session.scalars(select(JobAttempt).where(JobAttempt.job_id == job_id)
                                     .order_by(JobAttempt.id))]


def dispute_detail(session: Session, d: Dispute) -> dict[str, Any]:
    """The summary plus every event, attempt, the verdict and inclusion proofs."""
    stored = _stored_events(session, d.id)
    signed = _signed_events(stored)
    out = _summary(d, signed)
    out["events"] = [_event_out(e, s) for e, s in zip(stored, signed, strict=True)]
    out["attempts"] = _attempts(session, d.job_id)
    verdict = _verdict_row(session, out["verdict_id"]) if out["verdict_id"] else None
    out["verdict"] = verdict_summary(verdict) if verdict else None
    out["proofs"] = {
        "envelope": proof_or_none(session, d.envelope_index),
        "verdict": proof_or_none(session, verdict.log_index if verdict else None),
        "events": {str(e.seq): proof_or_none(session, e.log_index) for e in stored},
    }
    return out


def find_dispute(session: Session, dispute_id: str) -> Dispute:
    try:
        d = session.get(Dispute, uuid.UUID(dispute_id))
    except ValueError:
        d = None
    if d is None:
        raise NotFound(f"no dispute {dispute_id}")
    return d


@dataclass(frozen=True, slots=True)
class DisputeFilters:
    state: str | None = None
    request_id: str | None = None
    priority: str | None = None
    fingerprint_id: str | None = None
    before: datetime | None = None  # opened before this time (the old cursor, kept)


def list_disputes(session: Session, filters: DisputeFilters, *, limit: int,
                  cursor: str | None) -> Page[dict[str, Any]]:
    """Disputes, newest first (ties by ID), one page at a time."""
    stmt = select(Dispute)
    for col, value in ((Dispute.state, filters.state), (Dispute.request_id, filters.request_id),
                       (Dispute.priority, filters.priority),
                       (Dispute.fingerprint_id, filters.fingerprint_id)):
        if value is not None:
            stmt = stmt.where(col == value)
    if filters.before is not None:
        stmt = stmt.where(Dispute.opened_at < filters.before)
    rows, next_cursor = page(session, stmt, DISPUTE_ORDER, limit=limit, cursor=cursor,
                             digest=_digest("disputes", filters),
                             key_of=lambda d: (d.opened_at, d.id))
    return Page([dispute_summary(session, d) for d in rows], next_cursor)


def _digest(name: str, filters: DisputeFilters) -> str:
    return query_digest({"list": name, **asdict(filters)})


# --- verdicts --------------------------------------------------------------------------

def _verdict_row(session: Session, verdict_id: str) -> Verdict | None:
    return session.scalar(select(Verdict).where(Verdict.verdict_id == verdict_id))


def verdict_summary(v: Verdict) -> dict[str, Any]:
    """Outcome, tier, details and subject as the worker signed them."""
    signed = views.served_verdict(bytes(v.dsse), {
        "verdict_id": v.verdict_id, "request_id": v.request_id,
        "envelope_index": v.envelope_index, "outcome": v.outcome, "tier": v.tier,
        "worker_id": v.worker_id, "fingerprint_id": v.fingerprint_id, "details": v.details})
    return {"verdict_id": signed["verdict_id"], "log_index": v.log_index,
            "job_id": str(v.job_id), "request_id": signed["request_id"],
            "envelope_log_index": signed["envelope_index"], "outcome": signed["outcome"],
            "tier": signed["tier"], "worker_id": signed["worker_id"],
            "fingerprint_id": signed["fingerprint_id"], "details": signed["details"],
            "created_at": v.created_at, "dsse": json.loads(bytes(v.dsse)),
            "integrity": signed["integrity"]}


def get_verdict(session: Session, verdict_id: str) -> dict[str, Any]:
    """One verdict as signed, with its inclusion proof (None until integrated)."""
    v = _verdict_row(session, verdict_id)
    if v is None:
        raise NotFound(f"no verdict {verdict_id}")
    return {**verdict_summary(v), "proof": proof_or_none(session, v.log_index)}


# --- workers and fingerprints ----------------------------------------------------------

def list_workers(session: Session, settings: Settings) -> list[dict[str, Any]]:
    """Replay workers, newest first, and whether each is live (at most 1,000)."""
    cutoff = datetime.now(UTC) - timedelta(seconds=settings.worker_dead_after_s)
    rows = session.scalars(select(Worker).order_by(Worker.started_at.desc()).limit(1000))
    return [{"worker_id": w.worker_id, "fingerprint_id": w.fingerprint_id,
             "engine": w.engine, "version": w.version, "models": w.models,
             "hostname": w.hostname, "started_at": w.started_at,
             "last_heartbeat": w.last_heartbeat, "stopped_at": w.stopped_at,
             "live": w.stopped_at is None and w.last_heartbeat >= cutoff,
             "runtime": w.runtime} for w in rows]


def list_fingerprints(session: Session, settings: Settings) -> list[dict[str, Any]]:
    """Recorded fingerprints, their envelope counts, live workers and waiting jobs."""
    live = job_service.live_fingerprints(session, settings)
    counts = dict(session.execute(select(Envelope.fingerprint_id, func.count())
                                  .group_by(Envelope.fingerprint_id)).tuples().all())
    waiting = dict(session.execute(
        select(ReplayJob.fingerprint_id, func.count()).where(
            ReplayJob.state == JobState.AWAITING_WORKER).group_by(ReplayJob.fingerprint_id))
        .tuples().all())
    rows = session.scalars(select(Fingerprint).order_by(Fingerprint.first_seen_at))
    return [{"fingerprint_id": f.fingerprint_id, "runtime": f.runtime,
             "first_seen_at": f.first_seen_at, "envelopes": counts.get(f.fingerprint_id, 0),
             "live_workers": live.get(f.fingerprint_id, []),
             "has_live_worker": f.fingerprint_id in live,
             "jobs_awaiting_worker": waiting.get(f.fingerprint_id, 0)} for f in rows]


# --- re-verification -------------------------------------------------------------------

def policy_summary(p: ReverificationPolicy) -> dict[str, Any]:
    return {"id": str(p.id), "name": p.name, "interval_seconds": p.interval_seconds,
            "sample_size": p.sample_size, "sample_rate": p.sample_rate,
            "model_sha256": p.model_sha256, "fingerprint_id": p.fingerprint_id,
            "channel": p.channel, "min_age_seconds": p.min_age_seconds,
            "max_age_seconds": p.max_age_seconds, "enabled": p.enabled,
            "drift_alert_threshold": p.drift_alert_threshold, "created_by": p.created_by,
            "created_at": p.created_at, "first_window_start": p.first_window_start}


def list_policies(session: Session, *, limit: int, cursor: str | None
                  ) -> Page[dict[str, Any]]:
    """Policies, oldest first, each with how many runs it made."""
    rows, next_cursor = page(session, select(ReverificationPolicy), POLICY_ORDER, limit=limit,
                             cursor=cursor, digest=query_digest({"list": "policies"}),
                             key_of=lambda p: (p.created_at, p.id))
    return Page([{**policy_summary(p), "runs": reverification.count_runs(session, p.id)}
                 for p in rows], next_cursor)


def run_summary(r: ReverificationRun) -> dict[str, Any]:
    return {"id": str(r.id), "kind": r.kind,
            "policy_id": str(r.policy_id) if r.policy_id else None,
            "window_start": r.window_start, "window_end": r.window_end,
            "sampled": r.sampled, "details": r.details, "created_at": r.created_at}


def list_runs(session: Session, *, kind: str | None, limit: int,
              cursor: str | None) -> Page[dict[str, Any]]:
    """Runs (policy windows and fingerprint gates), newest first."""
    stmt = select(ReverificationRun)
    if kind:
        stmt = stmt.where(ReverificationRun.kind == kind)
    rows, next_cursor = page(session, stmt, RUN_ORDER, limit=limit, cursor=cursor,
                             digest=query_digest({"list": "runs", "kind": kind}),
                             key_of=lambda r: (r.created_at, r.id))
    return Page([run_summary(r) for r in rows], next_cursor)


def run_report(session: Session, run_id: str) -> dict[str, Any]:
    """A run's report: counts per outcome, drift per fingerprint and model, the diverged
    requests (:func:`ledger.replay.reverification.report`)."""
    return reverification.report(session, run_id)


def semantic_pass_rates(session: Session, **filters: Any) -> list[dict[str, Any]]:
    """Pooled pass rates of semantic verdicts over time
    (:func:`ledger.replay.semantic.pass_rate_series`)."""
    from ledger.replay.semantic import pass_rate_series

    return pass_rate_series(session, **filters)
