"""What a reviewer does to disputes: open one (and route its replay), comment, resolve.

Each function is the whole of one action: the signed dispute events, the replay job, and
the audit record, flushed in the caller's transaction. The caller (the API, the console)
commits, then publishes the returned jobs (:attr:`Opened.to_publish`): a job is sent to
the broker only after the transaction that made it has committed (a job that does not get
through stays in the outbox for ``ledger beat``'s sweeper).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.core.assertions import assertion_set_json, parse_assertion_set
from ledger.core.errors import ValidationFailed
from ledger.core.states import JobState
from ledger.db.models import Dispute, DisputeEvent, Envelope
from ledger.replay import disputes as dispute_records
from ledger.replay import jobs as job_service
from ledger.replay.records import Signer
from ledger.services import audit
from ledger.services.apikeys import Principal
from ledger.settings import Settings


class OpenOutcome(StrEnum):
    CREATED = "created"    # a new dispute, with its replay job
    EXISTING = "existing"  # an unresolved dispute on the record, or this Idempotency-Key's


@dataclass(slots=True)
class Opened:
    dispute: Dispute
    outcome: OpenOutcome
    to_publish: list[tuple[str, str]] = field(default_factory=list)  # (job ID, fingerprint)


def actor_of(principal: Principal) -> str:
    """How a reviewer is named in signed events."""
    return f"{principal.name} ({principal.role})"


def open_dispute(session: Session, principal: Principal, signer: Signer, settings: Settings,
                 *, request_id: str, reason: str, priority: str,
                 idempotency_key: str | None = None,
                 assertions: dict[str, Any] | None = None) -> Opened:
    """Open a dispute on a recorded request and make the replay job for it: queued when a
    worker with the record's fingerprint is live, else awaiting one (the sweeper routes
    it once one is). ``assertions`` (vendor records only): the set the semantic
    verification checks, signed into the opened event."""
    checked = None
    if assertions is not None:
        checked = assertion_set_json(parse_assertion_set(assertions))
        channel = session.scalar(select(Envelope.channel).where(
            Envelope.request_id == request_id))
        if channel is not None and channel != "vendor":
            raise ValidationFailed("assertions apply to vendor records (tier semantic) only",
                                   code="assertions_not_applicable")
    dispute, created = dispute_records.open_dispute(
        session, request_id=request_id, reason=reason, priority=priority,
        actor=actor_of(principal), signer=signer, idempotency_key=idempotency_key,
        assertions=checked)
    if not created:
        return Opened(dispute, OpenOutcome.EXISTING)
    job = job_service.create_job(
        session, fingerprint_id=dispute.fingerprint_id, kind="dispute",
        items=[(dispute.envelope_index, dispute.request_id, dispute.id)], settings=settings,
        priority=dispute_records.PRIORITY_RANK[priority])
    dispute.job_id = job.id
    dispute_records.emit(session, dispute, job.state, "ledger", signer,
                         {"job_id": str(job.id)}, state=job.state,
                         state_reason=job.state_reason)
    audit.record(session, principal, "dispute.open", str(dispute.id), request_id=request_id)
    queued = [(str(job.id), job.fingerprint_id)] if job.state == JobState.QUEUED else []
    return Opened(dispute, OpenOutcome.CREATED, queued)


def comment(session: Session, principal: Principal, signer: Signer, dispute_id: str, *,
            text: str) -> DisputeEvent:
    event = dispute_records.comment(session, dispute_id, text=text,
                                    actor=actor_of(principal), signer=signer)
    audit.record(session, principal, "dispute.comment", dispute_id)
    return event


def resolve(session: Session, principal: Principal, signer: Signer, dispute_id: str, *,
            resolution: str, note: str) -> Dispute:
    """Resolve a dispute that has a verdict; resolving again the same way changes nothing
    (and records nothing)."""
    dispute, changed = dispute_records.resolve(session, dispute_id, resolution=resolution,
                                               note=note, actor=actor_of(principal),
                                               signer=signer)
    if changed:
        audit.record(session, principal, "dispute.resolve", dispute_id, resolution=resolution)
    return dispute
