"""Signing keys the ledger trusts: register, revoke, look up for verification.

With the ledger's service key (``signer``), every registration and revocation also appends
a signed ``admin_event`` leaf in the same transaction (:mod:`ledger.log.registry`): the
registry leaves, not the table, are what ``ledger audit``, ``ledger verify --trust`` and
the replay worker believe. ``signer=None`` changes only the table (test provisioning);
the audit reports such rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.core.ed25519_strict import check_public_key_on_registration
from ledger.core.errors import KeyError_
from ledger.core.keys import key_id
from ledger.db.models import SigningKey
from ledger.db.session import AutocommitReads
from ledger.errors import Conflict, NotFound

if TYPE_CHECKING:
    from ledger.replay.records import Signer

PURPOSES = ("producer", "worker", "log", "ledger")


def register_key(session: Session, *, public_key: bytes, purpose: str, name: str,
                 not_before: datetime | None = None,
                 not_after: datetime | None = None, signer: Signer | None = None,
                 actor: str = "ledger") -> tuple[SigningKey, bool]:
    """Register a public key; (row, created). The same registration again is a no-op.
    With ``signer`` (the service key) a new registration is also a registry leaf.
    Weak (small- or mixed-order), off-curve and non-canonical keys raise ``KeyError_``."""
    kid = key_id(public_key)
    check_public_key_on_registration(public_key)
    existing = session.get(SigningKey, kid)
    if existing is not None:
        same = (existing.purpose == purpose and existing.name == name
                and (not_before is None or existing.not_before == not_before)
                and existing.not_after == not_after)
        if not same:
            raise Conflict(f"key {kid} is already registered with other attributes",
                           code="key_exists", keyid=kid)
        return existing, False
    row = SigningKey(keyid=kid, public_key=public_key, purpose=purpose, name=name,
                     status="active", not_after=not_after)
    if not_before is not None:
        row.not_before = not_before
    session.add(row)
    session.flush()
    session.refresh(row)
    if signer is not None:
        from ledger.log.registry import append_admin_event, key_event

        append_admin_event(session, signer, kind="signing_key.registered", actor=actor,
                           key=key_event(row))
    return row, True


def revoke_key(session: Session, keyid: str, reason: str, *, signer: Signer | None = None,
               actor: str = "ledger") -> SigningKey:
    row = session.get(SigningKey, keyid, with_for_update=True)
    if row is None:
        raise NotFound(f"no signing key {keyid}")
    if row.status != "revoked":
        row.status = "revoked"
        row.revoked_at = datetime.now(UTC)
        row.revoked_reason = reason
        session.flush()
        if signer is not None:
            from ledger.log.registry import append_admin_event, key_event

            append_admin_event(session, signer, kind="signing_key.revoked", actor=actor,
                               key=key_event(row))
    return row


def attest_key(session: Session, keyid: str, *, signer: Signer,
               actor: str = "ledger") -> int:
    """Append the registry leaves an existing row lacks (a registration, and a revocation
    if it is revoked): the upgrade path for keys registered before registry leaves, or
    with ``signer=None``. An explicit act of whoever holds the service key, who vouches
    for the row as it is now. Returns the number of leaves appended."""
    from ledger.db.models import AdminEvent
    from ledger.log.registry import append_admin_event, key_event

    row = session.get(SigningKey, keyid, with_for_update=True)
    if row is None:
        raise NotFound(f"no signing key {keyid}")
    kinds = set(session.scalars(select(AdminEvent.kind).where(AdminEvent.target == keyid)))
    appended = 0
    event = key_event(row)
    if "signing_key.registered" not in kinds:
        registered = {**event, "status": "active", "revoked_at": None,
                      "revoked_reason": None}
        append_admin_event(session, signer, kind="signing_key.registered", actor=actor,
                           key=registered)
        appended += 1
    if row.status == "revoked" and "signing_key.revoked" not in kinds:
        append_admin_event(session, signer, kind="signing_key.revoked", actor=actor,
                           key=event)
        appended += 1
    return appended


def get_key(session: Session, keyid: str) -> SigningKey:
    row = session.get(SigningKey, keyid)
    if row is None:
        raise NotFound(f"no signing key {keyid}")
    return row


def list_keys(session: Session, purpose: str | None = None) -> list[SigningKey]:
    stmt = select(SigningKey).order_by(SigningKey.created_at, SigningKey.keyid)
    if purpose:
        stmt = stmt.where(SigningKey.purpose == purpose)
    return list(session.scalars(stmt))


@dataclass(frozen=True, slots=True)
class TrustedKey:
    keyid: str
    public_key: bytes
    purpose: str
    status: str
    not_before: datetime
    not_after: datetime | None


class KeyRing:
    """Keys loaded for one verification; ``public_key_for`` raises with the exact reason."""

    def __init__(self, keys: Iterable[TrustedKey], *, purpose: str, now: datetime) -> None:
        self._keys = {k.keyid: k for k in keys}
        self._purpose = purpose
        self._now = now

    def public_key_for(self, keyid: str) -> bytes:
        key = self._keys.get(keyid)
        if key is None:
            raise KeyError_(f"signing key {keyid} is not registered", code="unknown_key")
        if key.purpose != self._purpose:
            raise KeyError_(f"key {keyid} is a {key.purpose} key, not a {self._purpose} key",
                            code="wrong_key_purpose")
        if key.status == "revoked":
            raise KeyError_(f"signing key {keyid} is revoked", code="revoked_key")
        if self._now < key.not_before:
            raise KeyError_(f"signing key {keyid} is not valid before "
                            f"{key.not_before.isoformat()}", code="key_not_yet_valid")
        if key.not_after is not None and self._now >= key.not_after:
            raise KeyError_(f"signing key {keyid} expired at {key.not_after.isoformat()}",
                            code="key_expired")
        return key.public_key

    def not_before(self) -> dict[str, datetime]:
        """keyid -> ``not_before`` of every key loaded (whatever its purpose or status)."""
        return {kid: k.not_before for kid, k in self._keys.items()}


#: :func:`load_keyring_reads`' query: the columns :func:`load_keyring` reads.
_KEYRING = ("SELECT keyid, public_key, purpose, status, not_before, not_after "
            "FROM signing_keys WHERE keyid = ANY(%s)")


def load_keyring_reads(reads: AutocommitReads, keyids: Iterable[str], *,
                       purpose: str) -> KeyRing:
    """:func:`load_keyring` in one raw statement (the ingest path), from the rows as they
    are now: nothing is cached, so a revocation takes effect with the next request."""
    ids = sorted(set(keyids))
    rows = reads.fetchall(_KEYRING, (ids,)) if ids else []
    return KeyRing((TrustedKey(r[0], bytes(r[1]), *r[2:]) for r in rows), purpose=purpose,
                   now=datetime.now(UTC))


@dataclass(frozen=True, slots=True)
class ReadKeys:
    """Signing-key rows read ahead for one request, as they were when read: ``asked``, the
    key IDs looked up (the rows of those registered are in ``rows``), so that a key ID
    asked and not found is known to be unregistered."""

    asked: frozenset[str]
    rows: tuple[TrustedKey, ...]
    read_at: datetime

    def keyring(self, keyids: Iterable[str], *, purpose: str) -> KeyRing | None:
        """The :class:`KeyRing` :func:`load_keyring_reads` would have given for ``keyids``
        at ``read_at`` (exactly those keys), or None when a key ID was not looked up."""
        wanted = set(keyids)
        if not wanted <= self.asked:
            return None
        return KeyRing((k for k in self.rows if k.keyid in wanted), purpose=purpose,
                       now=self.read_at)


def load_keyring(session: Session, keyids: Iterable[str], *, purpose: str) -> KeyRing:
    ids = sorted(set(keyids))
    rows = session.execute(
        select(SigningKey.keyid, SigningKey.public_key, SigningKey.purpose, SigningKey.status,
               SigningKey.not_before, SigningKey.not_after).where(SigningKey.keyid.in_(ids))
    ).all() if ids else []
    return KeyRing((TrustedKey(*r) for r in rows), purpose=purpose, now=datetime.now(UTC))
