"""Scheduled re-verification policies: create one (idempotently by name), pause, resume
and delete. Each change is a signed ``admin_event`` leaf in the same transaction
(:mod:`ledger.log.registry`; ``ledger audit`` reports a policy row that its leaves do not
account for) and an admin action in ``audit_events``."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ledger.db.models import ReverificationPolicy
from ledger.errors import Conflict
from ledger.log.registry import append_admin_event, policy_event
from ledger.replay.records import Signer
from ledger.services import audit
from ledger.services.apikeys import Principal


class CreateOutcome(StrEnum):
    CREATED = "created"
    EXISTING = "existing"  # a policy of this name with exactly these settings


def create_policy(session: Session, principal: Principal, signer: Signer,
                  fields: Mapping[str, Any],
                  first_window_start: datetime | None = None
                  ) -> tuple[ReverificationPolicy, CreateOutcome]:
    """Create the policy ``fields`` describe (``name`` among them). The same request again
    is :attr:`CreateOutcome.EXISTING`; the name with other settings is a conflict."""
    name = fields["name"]
    existing = session.scalar(select(ReverificationPolicy).where(
        ReverificationPolicy.name == name))
    if existing is not None:
        if all(getattr(existing, k) == v for k, v in fields.items()):
            return existing, CreateOutcome.EXISTING
        raise Conflict(f"a policy named {name!r} exists with other settings",
                       code="policy_exists")
    policy = ReverificationPolicy(id=uuid.uuid4(), created_by=principal.name,
                                  first_window_start=first_window_start or datetime.now(UTC),
                                  **fields)
    session.add(policy)
    try:
        session.flush()
    except IntegrityError as exc:
        raise Conflict(f"a policy named {name!r} exists", code="policy_exists") from exc
    session.refresh(policy)  # created_at, the server's
    append_admin_event(session, signer, kind="policy.created", actor=principal.name,
                       policy=policy_event(policy))
    audit.record(session, principal, "policy.create", str(policy.id), name=name)
    return policy, CreateOutcome.CREATED


def set_enabled(session: Session, principal: Principal, signer: Signer, policy_id: str,
                enabled: bool) -> ReverificationPolicy:
    """Pause (``enabled=False``) or resume a policy; recorded. Asking for the state it is
    in changes and records nothing."""
    from ledger.replay import reverification

    policy = reverification.get_policy(session, policy_id, lock=True)
    if policy.enabled == enabled:
        return policy
    reverification.set_policy_enabled(session, policy_id, enabled)
    append_admin_event(session, signer, kind="policy.resumed" if enabled else "policy.paused",
                       actor=principal.name, policy=policy_event(policy))
    audit.record(session, principal, "policy.resume" if enabled else "policy.pause",
                 policy_id, name=policy.name)
    return policy


def delete(session: Session, principal: Principal, signer: Signer, policy_id: str) -> None:
    """Delete a policy (its runs and reports stay, detached); recorded."""
    from ledger.replay import reverification

    stated = policy_event(reverification.get_policy(session, policy_id, lock=True))
    append_admin_event(session, signer, kind="policy.deleted", actor=principal.name,
                       policy=stated)
    name = reverification.delete_policy(session, policy_id)
    audit.record(session, principal, "policy.delete", policy_id, name=name)
