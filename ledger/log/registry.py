"""Registry leaves in the database: appending them, and auditing the key tables against them.

Every change to ``signing_keys`` and ``api_keys`` made through the services with the
ledger's service key appends an ``admin_event`` leaf (see :mod:`ledger.core.statements`)
in the same transaction. :func:`vouched_keys` reads the leaves back, believes only those
signed by a trust-policy service key, folds them (:class:`ledger.core.registry.Registry`)
and reports every row of the key tables that the leaves do not account for: an insider who
inserts a key row, flips a status or changes a role without the service key shows up here.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, true
from sqlalchemy.orm import Session

from ledger.core import dsse
from ledger.core.errors import KeyError_, LedgerError
from ledger.core.keys import key_id
from ledger.core.logentry import log_entry_bytes
from ledger.core.registry import RegisteredKey, Registry, RegistryError, open_admin_event
from ledger.core.statements import (
    admin_event_statement,
    api_key_record,
    signing_key_record,
    timestamp,
)
from ledger.core.trust import TrustPolicy
from ledger.db.models import AdminEvent, ApiKey, LogEntry, SigningKey
from ledger.replay.records import Signer, append_signed

Problem = tuple[int | None, str]

__all__ = [
    "RegisteredKey",
    "api_key_event",
    "append_admin_event",
    "key_event",
    "registry_from_leaves",
    "vouched_keys",
]


def append_admin_event(session: Session, signer: Signer, *, kind: str, actor: str,
                       key: Mapping[str, Any] | None = None,
                       api_key: Mapping[str, Any] | None = None) -> AdminEvent:
    """Sign an admin event with the service key and append it as a log leaf; the caller's
    transaction holds the key-table change it records."""
    if signer.purpose != "ledger":
        raise ValueError("registry leaves are signed by the ledger's service key")
    event_id = f"admin-{uuid.uuid4()}"
    at = datetime.now(UTC)
    statement = admin_event_statement(event_id=event_id, kind=kind, actor=actor, at=at,
                                      key=key, api_key=api_key)
    appended = append_signed(session, "admin_event", event_id, statement, signer)
    pred = statement["predicate"]
    row = AdminEvent(log_index=appended.log_index, event_id=event_id, kind=kind, actor=actor,
                     target=pred["target"], body=pred, dsse=appended.dsse, at=at)
    session.add(row)
    session.flush()
    return row


def key_event(row: SigningKey) -> dict[str, Any]:
    return signing_key_record(keyid=row.keyid, public_key=bytes(row.public_key),
                              purpose=row.purpose, name=row.name, not_before=row.not_before,
                              not_after=row.not_after, status=row.status,
                              revoked_at=row.revoked_at, revoked_reason=row.revoked_reason)


def api_key_event(row: ApiKey) -> dict[str, Any]:
    return api_key_record(id=str(row.id), name=row.name, role=row.role, prefix=row.prefix,
                          key_hash=bytes(row.key_hash), revoked_at=row.revoked_at)


def _trusted_signers(session: Session, trust: TrustPolicy | None) -> tuple[dict[str, bytes],
                                                                          str]:
    if trust is not None:
        return {key_id(k): bytes(k) for k in trust.service_keys}, "policy"
    rows = session.scalars(select(SigningKey.public_key).where(SigningKey.purpose == "ledger"))
    return {key_id(bytes(k)): bytes(k) for k in rows}, "database"


def registry_from_leaves(session: Session, trust: TrustPolicy | None
                         ) -> tuple[Registry, list[Problem]]:
    """Fold every admin_event leaf that verifies; problems for those that do not."""
    signers, source = _trusted_signers(session, trust)
    problems: list[Problem] = []
    def public_key_for(kid: str) -> bytes:
        found = signers.get(kid)
        if found is None:
            raise KeyError_(f"key {kid} is not a trusted service key", code="unknown_key")
        return found

    registry = Registry()
    rows = session.execute(
        select(AdminEvent, LogEntry.entry, LogEntry.kind, LogEntry.ref)
        .join(LogEntry, LogEntry.idx == AdminEvent.log_index, isouter=True)
        .order_by(AdminEvent.log_index)).all()
    recorded = set()
    for row, entry, entry_kind, entry_ref in rows:
        idx = row.log_index
        recorded.add(idx)
        where = f"admin event {row.event_id} (log index {idx})"
        dsse_bytes = bytes(row.dsse)
        if entry is None:
            problems.append((idx, f"{where}: no log entry at its index"))
            continue
        want = log_entry_bytes("admin_event", row.event_id,
                               hashlib.sha256(dsse_bytes).hexdigest())
        if bytes(entry) != want or entry_kind != "admin_event" or entry_ref != row.event_id:
            problems.append((idx, f"{where}: the log entry does not commit to the stored "
                                  "signed event"))
            continue
        try:
            env = dsse.envelope_from_json(dsse_bytes)
            event = open_admin_event(env, public_key_for)
        except (LedgerError, KeyError) as exc:
            message = exc.message if isinstance(exc, LedgerError) else str(exc)
            problems.append((idx, f"{where}: {message}"))
            continue
        pred = event.predicate
        for column in ("event_id", "kind", "actor", "target"):
            if getattr(row, column) != pred.get(column):
                problems.append((idx, f"{where}: column {column} is {getattr(row, column)!r}, "
                                      f"the signed event says {pred.get(column)!r}"))
        if row.body != pred:
            problems.append((idx, f"{where}: column body differs from the signed event"))
        try:
            registry.apply(idx, pred, vouched_by=source)
        except RegistryError as exc:
            problems.append((idx, f"{where}: {exc.message}"))
    orphans = session.scalars(select(LogEntry.idx).where(
        LogEntry.kind == "admin_event", LogEntry.idx.not_in(recorded) if recorded else true())
        .order_by(LogEntry.idx))
    for idx in orphans:
        problems.append((idx, f"log entry {idx} is an admin_event leaf without its record"))
    return registry, problems


def _differs(problems: list[Problem], idx: int | None, what: str, name: str, table: Any,
             leaf: Any) -> None:
    if table != leaf:
        problems.append((idx, f"{what}: {name} is {_show(table)} in the table, {_show(leaf)} "
                              f"in the leaf at log index {idx}"))


def _show(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()[:16] + ("..." if len(value) > 8 else "")
    if isinstance(value, datetime):
        return str(timestamp(value))
    return repr(value)


def vouched_keys(session: Session, trust: TrustPolicy | None
                 ) -> tuple[dict[str, RegisteredKey], list[Problem]]:
    """The signing keys that valid admin_event leaves vouch for (keyid -> key), and every
    disagreement between the leaves and the ``signing_keys`` / ``api_keys`` tables.

    With ``trust``, a leaf counts only when signed by one of ``trust.service_keys``; with
    ``None``, by a ``ledger`` key registered in this database (weaker: the returned keys
    then carry ``vouched_by == "database"``). A problem is ``(log index or None, message)``.
    """
    registry, problems = registry_from_leaves(session, trust)
    seen: set[str] = set()
    for row in session.scalars(select(SigningKey).order_by(SigningKey.keyid)):
        seen.add(row.keyid)
        what = f"signing key {row.keyid} ({row.purpose} {row.name!r})"
        reg = registry.keys.get(row.keyid)
        if reg is None:
            problems.append((None, f"{what} has no registration leaf signed by a trusted "
                                   "service key"))
            continue
        at = reg.registered_index
        _differs(problems, at, what, "public_key", bytes(row.public_key), reg.public_key)
        _differs(problems, at, what, "purpose", row.purpose, reg.purpose)
        _differs(problems, at, what, "name", row.name, reg.name)
        _differs(problems, at, what, "not_before", row.not_before, reg.not_before)
        _differs(problems, at, what, "not_after", row.not_after, reg.not_after)
        at = reg.revoked_index if reg.revoked_index is not None else reg.registered_index
        _differs(problems, at, what, "status", row.status, reg.status)
        _differs(problems, at, what, "revoked_at", row.revoked_at, reg.revoked_at)
    for kid, reg in registry.keys.items():
        if kid not in seen:
            problems.append((reg.registered_index, f"the leaf at log index "
                             f"{reg.registered_index} registers {reg.purpose} key {kid}, "
                             "which signing_keys lacks"))
    seen_api: set[str] = set()
    for api in session.scalars(select(ApiKey).order_by(ApiKey.created_at)):
        aid = str(api.id)
        seen_api.add(aid)
        what = f"API key {aid} ({api.name!r}, {api.role})"
        reg_api = registry.api_keys.get(aid)
        if reg_api is None:
            problems.append((None, f"{what} has no creation leaf signed by a trusted "
                                   "service key"))
            continue
        at = reg_api.last_index
        _differs(problems, reg_api.created_index, what, "key_hash", bytes(api.key_hash),
                 reg_api.key_hash)
        _differs(problems, reg_api.created_index, what, "name", api.name, reg_api.name)
        _differs(problems, reg_api.created_index, what, "prefix", api.prefix, reg_api.prefix)
        _differs(problems, at, what, "role", api.role, reg_api.role)
        _differs(problems, at, what, "revoked_at", api.revoked_at, reg_api.revoked_at)
    for aid, reg_api in registry.api_keys.items():
        if aid not in seen_api:
            problems.append((reg_api.created_index, f"the leaf at log index "
                             f"{reg_api.created_index} creates API key {aid}, which api_keys "
                             "lacks"))
    return dict(registry.keys), problems
