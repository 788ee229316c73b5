"""What ``ledger audit`` checks of encryption at rest and erasure.

The rule an auditor applies, for every envelope:

- stored in plain: checked as always (digest -> entry, signed columns, signature);
- sealed under a data key that exists: opened with the KEK, then checked as always (the
  blob must open and its plaintext hash to the digest the leaf commits to);
- sealed under a data key that does not exist: it must be *erased*: an erasure leaf
  signed by a trusted service key names that key and states a tombstone for this log
  index. The tombstone's fields (request ID, digest, index fields) are then what the
  entry is recomputed from and the row's columns are checked against; the envelope's own
  signature can no longer be checked (its bytes are gone), the erasure leaf vouches.

And for every erasure leaf: its signature (service keys of the trust policy, or ``ledger``
keys of the database without one), its ``erasures`` row against its signed bytes, its
``erased_keys`` rows against the keys it names, and no key it names may still exist (a
leaf claiming an erasure that did not happen). So an erasure leaf without the key
destruction, a destroyed key without an erasure leaf, an edited tombstone (a column of an
erased envelope, the digest, the erasure row) and every other change are reported.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ledger.core import dsse, sealing
from ledger.core.erasure import ErasureRecord, Tombstone, open_erasure
from ledger.core.errors import KeyError_, LedgerError
from ledger.core.sealing import KeyEncryptionKey

Problem = tuple[int | None, str]


@dataclass(frozen=True, slots=True)
class Opened:
    """What the erasure pass says of one envelope row (appended to it for the audit)."""

    digest: str | None  # the tombstone's digest for an erased record
    values: tuple[Any, ...] | None  # the tombstone's signed values
    error: str | None
    erased: bool


@dataclass
class ErasureState:
    """The erasure leaves that verify, and what the tables say of keys."""

    tombstones: dict[int, Tombstone] = field(default_factory=dict)
    erased_keys: dict[uuid.UUID, int] = field(default_factory=dict)  # key -> erasure index
    present: dict[uuid.UUID, bytes] = field(default_factory=dict)  # key -> wrapped
    problems: list[Problem] = field(default_factory=list)
    kek: KeyEncryptionKey | None = None
    erased_records: int = 0
    sealed_records: int = 0
    _ciphers: dict[uuid.UUID, AESGCM] = field(default_factory=dict)
    _seen: set[int] = field(default_factory=set)

    def open_rows(self, rows: Iterator[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
        """Envelope audit rows ``(log_index, dsse, request_id, *index columns)`` with
        sealed content opened (plain bytes in place of the blob) or, for an erased record,
        an :class:`Opened` appended that carries its tombstone."""
        for row in rows:
            stored = bytes(row[1])
            if not sealing.is_sealed(stored):
                yield row
                continue
            self.sealed_records += 1
            idx = int(row[0])
            yield self._opened(idx, stored, row)

    def _opened(self, idx: int, stored: bytes, row: tuple[Any, ...]) -> tuple[Any, ...]:
        column_digest = str(row[-1])
        try:
            kid = sealing.sealed_key_id(stored)
        except sealing.SealError as exc:
            return (*row, Opened(column_digest, None, exc.message, False))
        wrapped = self.present.get(kid)
        tomb = self.tombstones.get(idx)
        if wrapped is not None:
            if tomb is not None:
                self._seen.add(idx)
                self.problems.append((tomb.erasure_index, f"erasure {tomb.erasure_id} "
                                      f"(entry {tomb.erasure_index}) states a tombstone for "
                                      f"entry {idx}, whose data key {kid} was not destroyed"))
            if self.kek is None:
                return (*row, Opened(column_digest, None, "the envelope is encrypted at "
                                     "rest: audit it with the KEK (LEDGER_KEK_FILE)", False))
            try:
                cipher = self._ciphers.get(kid)
                if cipher is None:
                    cipher = self._ciphers[kid] = AESGCM(self.kek.unwrap(kid, wrapped))
                plain = sealing.open_sealed(cipher, stored, bytes.fromhex(column_digest))
            except (sealing.SealError, ValueError) as exc:
                message = exc.message if isinstance(exc, LedgerError) else str(exc)
                return (*row, Opened(column_digest, None, f"sealed content: {message}",
                                     False))
            return (row[0], plain, *row[2:])
        if tomb is None or tomb.key_id != kid:
            why = ("no erasure leaf signed by a trusted service key destroyed it"
                   if kid not in self.erased_keys else
                   f"the erasure leaf at entry {self.erased_keys[kid]} that destroyed it "
                   "states no tombstone for this record")
            return (*row, Opened(column_digest, None, f"its data key {kid} was destroyed "
                                 f"but {why} (content unreadable)", False))
        self._seen.add(idx)
        self.erased_records += 1
        return (*row, Opened(tomb.dsse_sha256, tomb.values(), None, True))

    def unmatched_tombstones(self) -> list[Problem]:
        """Tombstones (after the pass) whose index holds no envelope sealed under the key
        the leaf names."""
        return [(t.erasure_index, f"erasure {t.erasure_id} (entry {t.erasure_index}) states "
                 f"a tombstone for entry {i} ({t.request_id}), which is no envelope sealed "
                 f"under data key {t.key_id}")
                for i, t in sorted(self.tombstones.items()) if i not in self._seen]


def erasure_state(cur: Any, service_keys: dict[str, bytes],
                  kek: KeyEncryptionKey | None) -> ErasureState:
    """Read and verify every erasure leaf's record; the keys the tables hold.

    ``service_keys``: keyid -> public key of the keys trusted to sign erasures."""
    state = ErasureState(kek=kek)
    cur.execute("SELECT to_regclass('public.erasures') IS NOT NULL")
    if not cur.fetchone()[0]:
        return state

    def public_key_for(kid: str) -> bytes:
        found = service_keys.get(kid)
        if found is None:
            raise KeyError_(f"key {kid} is not a trusted service key", code="unknown_key")
        return found

    cur.execute("SELECT id, wrapped FROM data_keys")
    state.present = {r[0]: bytes(r[1]) for r in cur.fetchall()}
    cur.execute("SELECT key_id, erasure_index, records FROM erased_keys")
    rows = {r[0]: (int(r[1]), int(r[2])) for r in cur.fetchall()}
    cur.execute("SELECT log_index, erasure_id, dsse FROM erasures ORDER BY log_index")
    named: dict[uuid.UUID, int] = {}
    for idx, erasure_id, dsse_bytes in cur.fetchall():
        where = f"erasure {erasure_id} (entry {idx})"
        try:
            record: ErasureRecord = open_erasure(dsse.envelope_from_json(bytes(dsse_bytes)),
                                                 public_key_for, int(idx))
        except LedgerError as exc:
            state.problems.append((idx, f"{where}: {exc.message}; its tombstones are not "
                                        "believed"))
            continue
        for kid in record.key_ids:
            if kid in named:
                state.problems.append((idx, f"{where}: data key {kid} was destroyed before, "
                                            f"by the erasure at entry {named[kid]}"))
                continue
            named[kid] = idx
            state.erased_keys[kid] = idx
            if kid in state.present:
                state.problems.append((idx, f"{where}: names data key {kid} as destroyed, "
                                            "but the key still exists (an erasure leaf "
                                            "without the key destruction)"))
            have = rows.get(kid)
            if have is None:
                state.problems.append((idx, f"{where}: erased_keys has no row for data key "
                                            f"{kid}"))
            elif have != (int(idx), record.records_per_key[kid]):
                state.problems.append((idx, f"{where}: the erased_keys row of data key {kid} "
                                            f"says entry {have[0]}, {have[1]} records; the "
                                            f"signed leaf says entry {idx}, "
                                            f"{record.records_per_key[kid]} records"))
        for t_idx, tomb in record.tombstones.items():
            state.tombstones.setdefault(t_idx, tomb)
    for kid, (idx, _) in sorted(rows.items(), key=lambda kv: kv[1][0]):
        if kid not in named:
            state.problems.append((idx, f"erased_keys names data key {kid} (erasure entry "
                                        f"{idx}), which no verified erasure leaf destroyed"))
    return state
