"""Erasure (crypto-shredding) and retention: destroy data keys, append a signed leaf.

One transaction does all of it (the caller commits): take the sequencer lock, lock the
data keys ``FOR UPDATE`` (ingest holds the keys it seals under ``FOR SHARE``), open every
envelope sealed under them to read its signed index fields (the tombstone), sign the
erasure statement with the ledger's service key and sequence it as an ``erasure`` leaf,
record ``erasures`` and ``erased_keys`` rows, and delete the wrapped keys (a trigger
refuses the delete of a key no ``erased_keys`` row names). Concurrent erasures of the same
keys serialize on the locks; the second finds nothing left to destroy.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.core import sealing
from ledger.core.erasure import (
    data_subject_digest,
    erasure_statement,
    tombstone_record,
)
from ledger.core.keys import public_raw
from ledger.core.sealing import KeyEncryptionKey
from ledger.core.statements import timestamp
from ledger.db.models import Erasure, RetentionPolicy
from ledger.db.session import raw_cursor
from ledger.errors import Conflict, NotFound, Unavailable
from ledger.privacy.keys import CIPHERS
from ledger.replay import views
from ledger.replay.records import Signer, append_signed
from ledger.services import sequencer

log = logging.getLogger("ledger.privacy")

#: Most data keys one erasure leaf destroys (a retention run erases the rest next tick).
MAX_KEYS_PER_ERASURE = 500


@dataclass(frozen=True, slots=True)
class ErasureResult:
    erasure_id: str
    log_index: int
    keys: int
    records: int
    created: bool  # False: an earlier erasure had destroyed everything already

    def to_json(self) -> dict[str, Any]:
        return {"erasure_id": self.erasure_id, "log_index": self.log_index,
                "keys_destroyed": self.keys, "records_erased": self.records,
                "created": self.created}


def _tombstones(cur: Any, kek: KeyEncryptionKey, keys: Sequence[tuple[uuid.UUID, bytes]]
                ) -> list[tuple[uuid.UUID, list[dict[str, Any]]]]:
    """Every envelope sealed under each key, opened: its tombstone (signed index
    fields). A record that does not open is refused: the erasure would state a tombstone
    not derived from signed bytes (``ledger audit`` names what is wrong with it)."""
    out = []
    for kid, wrapped in keys:
        cipher = CIPHERS.get(kek, kid, wrapped)
        cur.execute("SELECT log_index, dsse, dsse_sha256 FROM envelopes "
                    "WHERE substring(dsse from 1 for 21) = %s ORDER BY log_index",
                    (sealing.MAGIC + kid.bytes,))
        records = []
        for log_index, stored, digest in cur.fetchall():
            try:
                plain = sealing.open_sealed(cipher, bytes(stored), bytes(digest))
                records.append(tombstone_record(log_index, views.envelope_index(plain)))
            except (sealing.SealError, views.SignedRecordError) as exc:
                raise Conflict(f"envelope at log index {log_index} (sealed under data key "
                               f"{kid}) does not open: {exc.message}; nothing was erased "
                               "(run `ledger audit`)", code="erasure_blocked") from None
        out.append((kid, records))
    return out


def erase_keys(session: Session, signer: Signer, kek: KeyEncryptionKey | None, *,
               where: str, params: Sequence[Any], kind: str, actor: str, reason: str,
               legal_basis: str, data_subject_sha256: str | None = None,
               policy: str | None = None) -> ErasureResult | None:
    """Destroy the data keys matching ``where`` (SQL over ``data_keys``, from this module
    only) with one signed erasure leaf; None when no key matches. Flushes only."""
    if signer.purpose != "ledger":
        raise ValueError("erasure leaves are signed by the ledger's service key")
    if kek is None:
        with raw_cursor(session) as cur:  # nothing sealed to erase: not a server problem
            cur.execute(f"SELECT 1 FROM data_keys WHERE {where} LIMIT 1",  # noqa: S608
                        tuple(params))
            if cur.fetchone() is None:
                return None
        raise Unavailable("erasure needs the key-encryption key (to read the tombstones "
                          "of what it erases): set LEDGER_KEK_FILE", retry_after=60)
    with raw_cursor(session) as cur:
        sequencer.lock(cur)  # first, as ingest does: no lock-order cycle with it
        cur.execute(f"SELECT id, wrapped FROM data_keys WHERE {where} "  # noqa: S608
                    f"ORDER BY id LIMIT {MAX_KEYS_PER_ERASURE} FOR UPDATE", tuple(params))
        keys = [(r[0], bytes(r[1])) for r in cur.fetchall()]
        if not keys:
            return None
        destroyed = _tombstones(cur, kek, keys)
    erasure_id = f"erasure-{uuid.uuid4()}"
    at = datetime.now(UTC)
    statement = erasure_statement(
        erasure_id=erasure_id, kind=kind, actor=actor, at=str(timestamp(at)),
        reason=reason, legal_basis=legal_basis, data_subject_sha256=data_subject_sha256,
        policy=policy, keys=destroyed)
    appended = append_signed(session, "erasure", erasure_id, statement, signer)
    pred = statement["predicate"]
    session.add(Erasure(log_index=appended.log_index, erasure_id=erasure_id, kind=kind,
                        actor=actor, data_subject_sha256=data_subject_sha256, policy=policy,
                        body=pred, dsse=appended.dsse, at=at))
    session.flush()
    with raw_cursor(session) as cur:
        cur.executemany("INSERT INTO erased_keys (key_id, erasure_index, records) "
                        "VALUES (%s, %s, %s)",
                        [(kid, appended.log_index, len(recs)) for kid, recs in destroyed])
        cur.execute("DELETE FROM data_keys WHERE id = ANY(%s)", ([k for k, _ in keys],))
    CIPHERS.forget(k for k, _ in keys)  # no unwrapped copy outlives the key in this process
    return ErasureResult(erasure_id, appended.log_index, len(destroyed),
                         sum(len(r) for _, r in destroyed), True)


def erase_subject(session: Session, signer: Signer, kek: KeyEncryptionKey | None,
                  data_subject: str, *, actor: str, reason: str,
                  legal_basis: str) -> ErasureResult:
    """Erase everything of one data subject (``POST /v1/data-subjects/{id}/erasure``).
    A repeated request answers with the erasure that destroyed the last key."""
    digest = data_subject_digest(data_subject)
    result = erase_keys(session, signer, kek, where="data_subject = %s",
                        params=(data_subject,), kind="subject", actor=actor, reason=reason,
                        legal_basis=legal_basis, data_subject_sha256=digest)
    if result is not None:
        return result
    prior = session.execute(select(Erasure).where(Erasure.data_subject_sha256 == digest)
                            .order_by(Erasure.log_index.desc()).limit(1)).scalar_one_or_none()
    if prior is None:
        raise NotFound("the ledger holds no records of this data subject (nothing was "
                       "erased)")
    keys = prior.body.get("keys", [])
    return ErasureResult(prior.erasure_id, prior.log_index, len(keys),
                         sum(len(k.get("records", [])) for k in keys), False)


def retention_cutoff(policy: RetentionPolicy, now: datetime) -> Any:
    """Keys of days before this date hold only records older than the window."""
    return (now - timedelta(days=policy.erase_after_days)).astimezone(UTC).date()


def run_retention(session: Session, signer: Signer, kek: KeyEncryptionKey | None,
                  now: datetime | None = None,
                  trusted: Mapping[str, bytes] | None = None) -> list[ErasureResult]:
    """One pass of every enabled retention policy (``ledger beat``): what is older than
    its window is erased, one signed leaf per policy and batch of keys. Concurrent beats
    serialize on the sequencer lock; what one erased the other finds gone.

    Only a policy whose row equals its ``retention.created`` leaf, signed by one of
    ``trusted`` (keyid -> public key; default: the beat's own service key), erases: a row
    planted or edited in the database is refused here, before anything is destroyed."""
    from ledger.log.registry import retention_vouched

    if trusted is None:
        trusted = {signer.keyid: public_raw(signer.key)}
    now = now or datetime.now(UTC)
    out = []
    policies = session.scalars(select(RetentionPolicy).where(RetentionPolicy.enabled)
                               .order_by(RetentionPolicy.name)).all()
    for p in policies:
        refused = retention_vouched(session, p, trusted)
        if refused is not None:
            log.error("retention policy %s (%r) is not used: %s", p.id, p.name, refused)
            continue
        where = ["day < %s"]
        params: list[Any] = [retention_cutoff(p, now)]
        if p.channel is not None:
            where.append("channel = %s")
            params.append(p.channel)
        if p.model_sha256 is not None:
            where.append("model_sha256 = %s")
            params.append(p.model_sha256)
        while True:
            result = erase_keys(session, signer, kek, where=" AND ".join(where),
                                params=params, kind="retention", actor="ledger beat",
                                reason=f"retention policy {p.name}: older than "
                                       f"{p.erase_after_days} days",
                                legal_basis="retention", policy=p.name)
            if result is None:
                break
            out.append(result)
            if result.keys < MAX_KEYS_PER_ERASURE:
                break
    return out


def create_policy(session: Session, signer: Signer, *, name: str, erase_after_days: int,
                  channel: str | None, model_sha256: str | None,
                  created_by: str) -> RetentionPolicy:
    """Create a retention policy and its signed ``retention.created`` leaf (one
    transaction): the beat erases by no policy without one."""
    from ledger.log.registry import append_admin_event, retention_event

    if session.scalar(select(RetentionPolicy.id).where(RetentionPolicy.name == name)):
        raise Conflict(f"a retention policy named {name!r} exists", code="policy_exists")
    row = RetentionPolicy(id=uuid.uuid4(), name=name, erase_after_days=erase_after_days,
                          channel=channel, model_sha256=model_sha256, created_by=created_by)
    session.add(row)
    session.flush()
    session.refresh(row)  # created_at and enabled, the server's
    append_admin_event(session, signer, kind="retention.created", actor=created_by,
                       retention=retention_event(row))
    return row


def list_policies(session: Session) -> list[RetentionPolicy]:
    """Every retention policy, by name."""
    return list(session.scalars(select(RetentionPolicy).order_by(RetentionPolicy.name)))
