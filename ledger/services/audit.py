"""The audit table: every admin and reviewer action, written in the action's transaction."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.db.models import AuditEvent
from ledger.services.apikeys import Principal


def record(session: Session, principal: Principal, action: str, target: str | None = None,
           **details: Any) -> None:
    session.add(AuditEvent(actor=f"{principal.name} ({principal.key_id})", role=principal.role,
                           action=action, target=target, details=details))
    session.flush()


def list_events(session: Session, *, after_id: int = 0, limit: int = 100) -> list[AuditEvent]:
    return list(session.scalars(select(AuditEvent).where(AuditEvent.id > after_id)
                                .order_by(AuditEvent.id).limit(limit)))
