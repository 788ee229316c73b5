"""API keys: created with a role, shown once, stored as HMAC-SHA256(pepper, key).

With the ledger's service key (``signer``), creation, revocation and every role change
append a signed ``admin_event`` leaf in the same transaction (:mod:`ledger.log.registry`);
``signer=None`` changes only the table (test provisioning), which the audit reports.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ledger.db.arrays import TextArray
from ledger.db.models import ApiKey
from ledger.db.session import AutocommitReads
from ledger.errors import Conflict, NotFound, Unauthorized
from ledger.services.keys import ReadKeys, TrustedKey

if TYPE_CHECKING:
    from ledger.replay.records import Signer

_HEX64 = re.compile(r"[0-9a-f]{64}")
ROLES = ("ingester", "reviewer", "auditor", "worker", "admin")
KEY_PREFIX = "lk_"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the API key's id, name and role."""

    key_id: str
    name: str
    role: str


def hash_key(key: str, pepper: str) -> bytes:
    return hmac.new(pepper.encode(), key.encode(), hashlib.sha256).digest()


def create_api_key(session: Session, *, name: str, role: str, pepper: str,
                   created_by: str | None = None,
                   signer: Signer | None = None) -> tuple[ApiKey, str]:
    """Create a key; returns (row, the key itself). Active names are unique."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id=uuid.uuid4(), name=name, role=role, prefix=secret[:10],
                 key_hash=hash_key(secret, pepper), created_by=created_by)
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError as exc:
        raise Conflict(f"an active API key named {name!r} exists", code="api_key_exists",
                       name=name) from exc
    session.refresh(row)
    if signer is not None:
        from ledger.log.registry import api_key_event, append_admin_event

        append_admin_event(session, signer, kind="api_key.created",
                           actor=created_by or "ledger", api_key=api_key_event(row))
    return row, secret


def authenticate(session: Session, key: str, pepper: str) -> Principal:
    digest = digest_of(key, pepper)
    row = session.execute(
        select(ApiKey.id, ApiKey.name, ApiKey.role, ApiKey.key_hash, ApiKey.revoked_at)
        .where(ApiKey.key_hash == digest)
    ).first()
    return _principal(tuple(row) if row is not None else None, digest)


#: :func:`authenticate_reads`' query: the same row as :func:`authenticate` reads.
_BY_HASH = "SELECT id, name, role, key_hash, revoked_at FROM api_keys WHERE key_hash = %s"


def authenticate_reads(reads: AutocommitReads, key: str, pepper: str) -> Principal:
    """:func:`authenticate` in one raw statement (the ingest path: no session, no ORM).
    The same checks, on the row as it is now: nothing is cached, so a revocation takes
    effect with the next request, in every process."""
    digest = digest_of(key, pepper)
    rows = reads.fetchall(_BY_HASH, (digest,))
    return _principal(rows[0] if rows else None, digest)


#: :func:`authenticate_reads_with_keys`' query: :data:`_BY_HASH`'s row (part 0) and the
#: signing-key rows ``ledger.services.keys.load_keyring_reads`` reads (part 1), in one
#: statement (one round trip, one snapshot).
BY_HASH_WITH_KEYS = (
    "SELECT 0, id::text, name, role, key_hash, revoked_at, NULL::timestamptz "
    "FROM api_keys WHERE key_hash = %s "
    "UNION ALL SELECT 1, keyid, purpose, status, public_key, not_before, not_after "
    "FROM signing_keys WHERE keyid = ANY(%s)")


def authenticate_reads_with_keys(reads: AutocommitReads, key: str, pepper: str,
                                 keyids: Iterable[str]) -> tuple[Principal, ReadKeys]:
    """:func:`authenticate_reads`, with the signing keys of ``keyids`` read in the same
    statement. The API key is checked exactly as there (a malformed key before anything
    is read); the keys are only data, for the caller to use once it has checked the
    principal's role (the ingest path: ``ledger.api.routes.envelopes``)."""
    digest = digest_of(key, pepper)
    asked = frozenset(keyids)
    ids = sorted(asked)
    # key IDs as DSSE names them (64 hex, as dsse.keyids_named finds them) go as a typed
    # text[] (ledger.db.arrays: psycopg does not look at the list each time); anything
    # else is adapted as before
    rows = reads.fetchall(BY_HASH_WITH_KEYS, (
        digest, TextArray(ids) if all(map(_HEX64.fullmatch, ids)) else ids))
    read_at = datetime.now(UTC)
    api_row = next((r[1:6] for r in rows if r[0] == 0), None)
    principal = _principal(api_row, digest)
    return principal, ReadKeys(asked, key_rows(rows), read_at)


def key_rows(rows: Iterable[tuple[Any, ...]]) -> tuple[TrustedKey, ...]:
    """The signing keys among :data:`BY_HASH_WITH_KEYS`' rows (part 1)."""
    return tuple(TrustedKey(r[1], bytes(r[4]), r[2], r[3], r[5], r[6])
                 for r in rows if r[0] == 1)


def digest_of(key: str, pepper: str) -> bytes:
    if not key.startswith(KEY_PREFIX) or len(key) > 200:
        raise Unauthorized("malformed API key", code="bad_api_key")
    return hash_key(key, pepper)


def _principal(row: tuple[Any, ...] | None, digest: bytes) -> Principal:
    """The caller of a (id, name, role, key_hash, revoked_at) row found by ``digest``."""
    # The lookup is by hash; the compare is constant-time anyway, against a dummy on a miss.
    stored = bytes(row[3]) if row is not None else b"\0" * 32
    if not hmac.compare_digest(stored, digest) or row is None:
        raise Unauthorized("unknown API key", code="bad_api_key")
    if row[4] is not None:
        raise Unauthorized("this API key was revoked", code="revoked_api_key")
    return Principal(str(row[0]), row[1], row[2])


def _locked(session: Session, key_id: str) -> ApiKey:
    try:
        kid = uuid.UUID(key_id)
    except ValueError as exc:
        raise NotFound(f"no API key {key_id}") from exc
    row = session.get(ApiKey, kid, with_for_update=True)
    if row is None:
        raise NotFound(f"no API key {key_id}")
    return row


def revoke_api_key(session: Session, key_id: str, *, signer: Signer | None = None,
                   actor: str = "ledger") -> ApiKey:
    row = _locked(session, key_id)
    if row.revoked_at is None:
        row.revoked_at = datetime.now(UTC)
        session.flush()
        session.refresh(row)
        if signer is not None:
            from ledger.log.registry import api_key_event, append_admin_event

            append_admin_event(session, signer, kind="api_key.revoked", actor=actor,
                               api_key=api_key_event(row))
    return row


def change_api_key_role(session: Session, key_id: str, role: str, *,
                        signer: Signer | None = None, actor: str = "ledger") -> ApiKey:
    """Give an active API key another role (a registry leaf with ``signer``)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    row = _locked(session, key_id)
    if row.revoked_at is not None:
        raise Conflict(f"API key {key_id} is revoked", code="revoked_api_key")
    if row.role != role:
        row.role = role
        session.flush()
        if signer is not None:
            from ledger.log.registry import api_key_event, append_admin_event

            append_admin_event(session, signer, kind="api_key.role_changed", actor=actor,
                               api_key=api_key_event(row))
    return row


def list_api_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))
