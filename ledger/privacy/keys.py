"""Data keys in the database, the KEK outside it: sealing at ingest, opening on read.

A data key's scope is one data subject (``predicate.data_subject``, ``""`` for envelopes
without one), channel, model and UTC day of ``recorded_at``: erasing a subject destroys
all of its keys, a retention policy the keys of its channel/model older than its window.
Keys are created on first use, wrapped by the KEK (:mod:`ledger.core.sealing`), and only
ever read or destroyed after that.

Locking: ingest holds ``FOR SHARE`` on the key rows it seals under until it commits; an
erasure takes them ``FOR UPDATE`` before listing what they sealed, so no envelope is
sealed under a key while it is being destroyed (and none lands outside its erasure leaf).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from datetime import UTC, date, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ledger.core import sealing
from ledger.core.erasure import ERASED, Tombstone, erasure_predicate, erasure_record
from ledger.core.sealing import KeyEncryptionKey, LocalKek, SealError
from ledger.settings import Settings

Scope = tuple[str, str, str, date]  # (data_subject, channel, model_sha256, day)


@lru_cache(maxsize=8)
def _kek_file(path: str, mtime_ns: int) -> LocalKek:
    return LocalKek.from_file_bytes(Path(path).read_bytes())


def kek_from_settings(settings: Settings) -> KeyEncryptionKey | None:
    """The KEK named by ``LEDGER_KEK_FILE`` (None: encryption at rest is off)."""
    path = settings.kek_file
    if path is None:
        return None
    return _kek_file(str(path), Path(path).stat().st_mtime_ns)


def scope_of(data_subject: str | None, channel: str, model_sha256: str,
             recorded_at: datetime) -> Scope:
    return (data_subject or "", channel, model_sha256, recorded_at.astimezone(UTC).date())


class _Ciphers:
    """Unwrapped data keys of this process, by key ID *and* wrapped bytes (bounded). A
    cached cipher is used only for the very row it was unwrapped from, so a row put back
    under a destroyed key's ID with other bytes never reaches it; whether the row still
    exists is asked of the database on every use. Erasure drops its keys here too."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._data: OrderedDict[tuple[uuid.UUID, bytes], AESGCM] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, kek: KeyEncryptionKey, key_id: uuid.UUID, wrapped: bytes) -> AESGCM:
        slot = (key_id, wrapped)
        with self._lock:
            found = self._data.get(slot)
        if found is None:
            found = AESGCM(kek.unwrap(key_id, wrapped))
            with self._lock:
                self._data[slot] = found
                while len(self._data) > self.capacity:
                    self._data.popitem(last=False)
        return found

    def forget(self, key_ids: Iterable[uuid.UUID]) -> None:
        gone = set(key_ids)
        with self._lock:
            for slot in [s for s in self._data if s[0] in gone]:
                del self._data[slot]


CIPHERS = _Ciphers()


def _select_scopes(cur: Any, scopes: Sequence[Scope]) -> dict[Scope, tuple[uuid.UUID, bytes]]:
    cur.execute(
        "SELECT k.id, k.data_subject, k.channel, k.model_sha256, k.day, k.wrapped "
        "FROM data_keys k JOIN unnest(%s::text[], %s::text[], %s::text[], %s::date[]) "
        "AS s(data_subject, channel, model_sha256, day) USING (data_subject, channel, "
        "model_sha256, day) FOR SHARE OF k",
        ([s[0] for s in scopes], [s[1] for s in scopes], [s[2] for s in scopes],
         [s[3] for s in scopes]))
    return {(r[1], r[2], r[3], r[4]): (r[0], bytes(r[5])) for r in cur.fetchall()}


def keys_for(cur: Any, kek: KeyEncryptionKey, scopes: set[Scope]
             ) -> dict[Scope, tuple[uuid.UUID, AESGCM]]:
    """A data key for every scope (created where missing), each row held ``FOR SHARE``
    until the caller's transaction ends."""
    ordered = sorted(scopes)
    found = _select_scopes(cur, ordered)
    missing = [s for s in ordered if s not in found]
    if missing:
        rows = []
        for s in missing:
            kid = uuid.uuid4()
            rows.append((kid, *s, kek.wrap(kid, sealing.new_data_key()), kek.kek_id))
        cur.executemany(
            "INSERT INTO data_keys (id, data_subject, channel, model_sha256, day, wrapped, "
            "kek_id) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT ON CONSTRAINT "
            "uq_data_keys_scope DO NOTHING", rows)
        found = _select_scopes(cur, ordered)
    return {s: (kid, CIPHERS.get(kek, kid, wrapped)) for s, (kid, wrapped) in found.items()}


def seal_rows(cur: Any, kek: KeyEncryptionKey,
              items: Sequence[tuple[Scope, bytes, bytes]]) -> list[bytes]:
    """The stored bytes of (scope, DSSE bytes, SHA-256) items, each sealed under its
    scope's data key."""
    keys = keys_for(cur, kek, {s for s, _, _ in items})
    out = []
    for scope, dsse_bytes, digest in items:
        kid, cipher = keys[scope]
        out.append(sealing.seal(cipher, kid, dsse_bytes, digest))
    return out


class ErasedContent(Exception):
    """A sealed record whose data key was destroyed: its tombstone, when a signed erasure
    leaf states one (None: the key is gone without an erasure record, a tamper)."""

    def __init__(self, key_id: uuid.UUID, tombstone: Tombstone | None) -> None:
        super().__init__(str(key_id))
        self.key_id, self.tombstone = key_id, tombstone

    @property
    def reason(self) -> str:
        if self.tombstone is None:
            return (f"its data key {self.key_id} is missing and no erasure leaf destroyed it "
                    "(the content is unreadable)")
        return (f"{ERASED}: by erasure {self.tombstone.erasure_id} (log index "
                f"{self.tombstone.erasure_index})")


class Opener:
    """Opens stored envelope bytes on read (API, console, export, worker, audit): plain
    records pass through; sealed ones are decrypted with their data key, or raise
    :class:`ErasedContent` when it was destroyed."""

    def __init__(self, cur: Any, kek: KeyEncryptionKey | None) -> None:
        self.cur, self.kek = cur, kek
        self._keys: dict[uuid.UUID, AESGCM | None] = {}

    def open(self, stored: bytes, dsse_sha256: bytes, log_index: int) -> bytes:
        if not sealing.is_sealed(stored):
            return stored
        kid = sealing.sealed_key_id(stored)
        cipher = self._cipher(kid)
        if cipher is None:
            raise ErasedContent(kid, tombstone_at(self.cur, kid, log_index))
        return sealing.open_sealed(cipher, stored, dsse_sha256)

    def _cipher(self, kid: uuid.UUID) -> AESGCM | None:
        if kid in self._keys:
            return self._keys[kid]
        self.cur.execute("SELECT wrapped FROM data_keys WHERE id = %s", (kid,))
        row = self.cur.fetchone()
        cipher = None
        if row is not None:
            if self.kek is None:
                raise SealError("the envelope is encrypted at rest and this process has no "
                                "key-encryption key: set LEDGER_KEK_FILE")
            cipher = CIPHERS.get(self.kek, kid, bytes(row[0]))
        self._keys[kid] = cipher
        return cipher


def tombstone_at(cur: Any, key_id: uuid.UUID, log_index: int) -> Tombstone | None:
    """The tombstone the erasure leaf that destroyed ``key_id`` states for ``log_index``,
    read from its signed bytes (the signature is checked by ``ledger audit``)."""
    cur.execute("SELECT e.log_index, e.dsse FROM erased_keys k JOIN erasures e "
                "ON e.log_index = k.erasure_index WHERE k.key_id = %s", (key_id,))
    row = cur.fetchone()
    if row is None:
        return None
    from ledger.core import dsse

    try:
        env = dsse.envelope_from_json(bytes(row[1]))
        record = erasure_record(erasure_predicate(env.payload), (), int(row[0]))
    except Exception:  # noqa: BLE001 - a broken erasure record states no tombstone
        return None
    tomb = record.tombstones.get(log_index)
    return tomb if tomb is not None and tomb.key_id == key_id else None
