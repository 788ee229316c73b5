"""The audit table: every admin and reviewer action, written in the action's transaction."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.db.models import AuditEvent
from ledger.services.apikeys import Principal
from ledger.services.pagination import Page, SortKey, page, query_digest


def record(session: Session, principal: Principal, action: str, target: str | None = None,
           **details: Any) -> None:
    session.add(AuditEvent(actor=f"{principal.name} ({principal.key_id})", role=principal.role,
                           action=action, target=target, details=details))
    session.flush()


AUDIT_ORDER = SortKey(((AuditEvent.id, False),), ("int",))


def list_events(session: Session, *, after_id: int = 0, limit: int = 100,
                cursor: str | None = None) -> Page[AuditEvent]:
    """Audit events in the order they were recorded, after ``after_id``, a page at a
    time."""
    rows, next_cursor = page(session, select(AuditEvent).where(AuditEvent.id > after_id),
                             AUDIT_ORDER, limit=limit, cursor=cursor,
                             digest=query_digest({"list": "audit", "after": after_id}),
                             key_of=lambda e: (e.id,))
    return Page(rows, next_cursor)
