"""Dispute tickets and their trail of signed events.

States: ``opened`` -> ``queued`` | ``awaiting_worker`` -> ``replaying`` -> ``verdict`` ->
``resolved``. Every state change and every comment is a signed dispute event appended to
the transparency log as its own leaf. Events caused by the ledger (a reviewer's action,
routing) are signed with the service key; events caused by a worker (replaying, verdict)
with that worker's key.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ledger.core.statements import event_statement
from ledger.core.states import DisputeState
from ledger.db.models import Dispute, DisputeEvent, Envelope
from ledger.errors import Conflict, NotFound
from ledger.replay.records import Signer, append_signed

PRIORITY_RANK = {"low": 0, "normal": 1, "high": 2}


def emit(session: Session, dispute: Dispute, kind: str, actor: str, signer: Signer,
         body: Mapping[str, Any] | None = None, *, state: str | None = None,
         state_reason: str | None = None) -> DisputeEvent:
    """Append a signed event (and move the dispute to ``state`` if given). The dispute row
    must be locked by the caller (``FOR UPDATE``) so ``seq`` is gap-free per dispute."""
    seq = (session.scalar(select(func.max(DisputeEvent.seq))
                          .where(DisputeEvent.dispute_id == dispute.id)) or 0) + 1
    now = datetime.now(UTC)
    event_id = f"dispute-{dispute.id}-{seq}"
    env_digest = session.scalar(select(Envelope.dsse_sha256)
                                .where(Envelope.log_index == dispute.envelope_index))
    assert env_digest is not None
    body = {**(body or {}), **({"state": state} if state else {}),
            **({"reason": state_reason} if state_reason else {})}
    statement = event_statement(event_id=event_id, dispute_id=str(dispute.id), seq=seq,
                                kind=kind, actor=actor, at=now.isoformat(),
                                request_id=dispute.request_id,
                                envelope_dsse_sha256=bytes(env_digest).hex(), body=body)
    appended = append_signed(session, "dispute_event", event_id, statement, signer)
    event = DisputeEvent(log_index=appended.log_index, event_id=event_id, dispute_id=dispute.id,
                         seq=seq, kind=kind, actor=actor, body=body, at=now,
                         dsse=appended.dsse)
    session.add(event)
    if state is not None:
        dispute.state = state
        dispute.state_reason = state_reason
    dispute.updated_at = now
    session.flush()
    return event


def open_dispute(session: Session, *, request_id: str, reason: str, priority: str, actor: str,
                 signer: Signer, idempotency_key: str | None = None,
                 assertions: Mapping[str, Any] | None = None) -> tuple[Dispute, bool]:
    """Open a dispute; (dispute, created). A retry with the same idempotency key, or a
    second dispute on a record that already has an unresolved one, returns that one."""
    if idempotency_key:
        existing = session.scalar(select(Dispute).where(
            Dispute.idempotency_key == idempotency_key))
        if existing is not None:
            if existing.request_id != request_id:
                raise Conflict("this Idempotency-Key was used for another request_id",
                               code="idempotency_key_reused")
            return existing, False
    env = session.execute(select(Envelope.log_index, Envelope.fingerprint_id)
                          .where(Envelope.request_id == request_id)).first()
    if env is None:
        raise NotFound(f"no envelope with request_id {request_id!r}")
    open_one = session.scalar(select(Dispute).where(Dispute.request_id == request_id,
                                                    Dispute.state != DisputeState.RESOLVED))
    if open_one is not None:
        return open_one, False
    dispute = Dispute(id=uuid.uuid4(), request_id=request_id, envelope_index=env.log_index,
                      fingerprint_id=env.fingerprint_id, reason=reason, priority=priority,
                      state=DisputeState.OPENED, opened_by=actor, idempotency_key=idempotency_key)
    try:
        with session.begin_nested():
            session.add(dispute)
            session.flush()
    except IntegrityError:  # a concurrent open of the same record won the race
        session.expire_all()
        winner = session.scalar(select(Dispute).where(Dispute.request_id == request_id,
                                                      Dispute.state != DisputeState.RESOLVED))
        if winner is None:
            raise
        return winner, False
    body: dict[str, Any] = {"reason": reason, "priority": priority}
    if assertions is not None:   # a vendor record's semantic check (workers.semantic)
        body["assertions"] = dict(assertions)
    emit(session, dispute, "opened", actor, signer, body)
    return dispute, True


def lock(session: Session, dispute_id: uuid.UUID | str) -> Dispute:
    try:
        did = uuid.UUID(str(dispute_id))
    except ValueError as exc:
        raise NotFound(f"no dispute {dispute_id}") from exc
    dispute = session.get(Dispute, did, with_for_update=True)
    if dispute is None:
        raise NotFound(f"no dispute {dispute_id}")
    return dispute


def comment(session: Session, dispute_id: str, *, text: str, actor: str,
            signer: Signer) -> DisputeEvent:
    dispute = lock(session, dispute_id)
    return emit(session, dispute, "comment", actor, signer, {"text": text})


def resolve(session: Session, dispute_id: str, *, resolution: str, note: str, actor: str,
            signer: Signer) -> tuple[Dispute, bool]:
    """Resolve (upheld or rejected); resolving again the same way is a no-op."""
    dispute = lock(session, dispute_id)
    if dispute.state == DisputeState.RESOLVED:
        if dispute.resolution == resolution:
            return dispute, False
        raise Conflict(f"dispute is already resolved as {dispute.resolution}; a resolution "
                       "is final: to look at the record again, open a new dispute on it "
                       "(POST /v1/disputes with its request_id)", code="already_resolved")
    if dispute.state != "verdict":
        raise Conflict(f"dispute is {dispute.state}; it can be resolved once it has a verdict",
                       code="no_verdict_yet")
    now = datetime.now(UTC)
    dispute.resolution, dispute.resolution_note = resolution, note
    dispute.resolved_by, dispute.resolved_at = actor, now
    emit(session, dispute, "resolved", actor, signer,
         {"resolution": resolution, "note": note}, state=DisputeState.RESOLVED)
    return dispute, True
