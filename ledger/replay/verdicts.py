"""Storing verdicts: signed by the worker, appended to the log, exactly one per job item."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.core.statements import verdict_statement
from ledger.core.states import DISPUTE_DECIDED
from ledger.db.models import Dispute, Envelope, ReplayJob, ReplayJobItem, Verdict
from ledger.replay import disputes
from ledger.replay.records import Signer, append_signed


def verdict_id_for(job_id: Any, position: int) -> str:
    """Deterministic, so a second delivery of the same job cannot mint a second verdict."""
    return f"verdict-{job_id}-{position}"


def store_verdict(session: Session, *, job: ReplayJob, item: ReplayJobItem, outcome: str,
                  details: Mapping[str, Any], worker_id: str, fingerprint_id: str,
                  signer: Signer) -> tuple[Verdict, bool]:
    """(verdict, created). The caller holds the job row lock."""
    existing = session.scalar(select(Verdict).where(
        Verdict.job_id == job.id, Verdict.envelope_index == item.envelope_index))
    if existing is not None:
        return existing, False
    env_digest = session.scalar(select(Envelope.dsse_sha256).where(
        Envelope.log_index == item.envelope_index))
    assert env_digest is not None
    vid = verdict_id_for(job.id, item.position)
    statement = verdict_statement(verdict_id=vid, request_id=item.request_id,
                                  envelope_index=item.envelope_index,
                                  envelope_dsse_sha256=bytes(env_digest).hex(),
                                  outcome=outcome, details=details)
    appended = append_signed(session, "verdict", vid, statement, signer)
    verdict = Verdict(log_index=appended.log_index, verdict_id=vid, job_id=job.id,
                      envelope_index=item.envelope_index, request_id=item.request_id,
                      outcome=outcome, tier=details.get("tier"), worker_id=worker_id,
                      fingerprint_id=fingerprint_id, details=dict(details), dsse=appended.dsse)
    session.add(verdict)
    session.flush()
    if item.dispute_id is not None:
        dispute = session.get(Dispute, item.dispute_id, with_for_update=True)
        if dispute is not None and dispute.state not in DISPUTE_DECIDED:
            dispute.verdict_id = vid
            disputes.emit(session, dispute, "verdict", worker_id, signer,
                          {"verdict_id": vid, "outcome": outcome, "tier": details.get("tier"),
                           "verdict_log_index": appended.log_index}, state="verdict")
    return verdict, True
