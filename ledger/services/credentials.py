"""Single-envelope ingest without a database read per request: the API key and producer
keys a request was admitted with come from what an earlier request of this process read,
and the statement that stores it holds a condition that they are as remembered (:data:`GUARD`
in ``ledger.log.store.SEQUENCE``): if they are not, it stores nothing at all.

What a request is answered does not change. A remembered key can only lead to an envelope
being stored, and only by a statement that found its rows unchanged:

- a request refused for any reason (a key, a role, the body, the signature) is taken
  again from the start with fresh reads (:func:`ledger.api.routes.envelopes._ingested`),
  so every refusal comes from the rows as they are when it is answered;
- a request whose key was revoked, whose role changed, or whose producer key's row
  changed in any field since it was remembered is not stored, and is taken again the
  same way. The storing statement reads the rows (in its own snapshot, before it takes
  the sequencer lock), so a revocation committed before that statement started takes
  effect; with a fresh read per request the window was longer (from the read to the
  storing statement). When the condition fails, the leader finds which requests are
  stale (:func:`stale`, one statement), sends those back and stores the others, by a
  statement that checks them again.

On the 2-core VM this saves one round trip per POST and the leader's separate check
statement (``benchmarks/ingest.py``, issue 17).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ledger.db.arrays import ByteaArray, TextArray, TimestamptzArray
from ledger.log.store import SequenceRefused
from ledger.services.apikeys import BY_HASH_WITH_KEYS, Principal, digest_of, key_rows
from ledger.services.keys import KeyRing, ReadKeys, TrustedKey


class NotRemembered(Exception):
    """An envelope names a key not remembered: the request takes the fresh path."""


class StaleCredentials(Exception):
    """A remembered key no longer matches its row: the request was not stored and must be
    taken again with fresh reads. Never reaches a client."""


@dataclass(frozen=True, slots=True)
class Remembered:
    """What a request was admitted with from memory, for :func:`stale` to check."""

    digest: bytes                   # HMAC of the API key (as stored)
    principal: Principal            # its role held the permission when admitted
    keys: tuple[TrustedKey, ...]    # the producer key rows it was verified with


class CredentialCache:
    """Per API process: the principals of valid API keys (by digest) and the producer key
    rows that fresh reads found. Only what a fresh read found valid is kept; a miss, or a
    refusal, takes the fresh path. Bounded: past :attr:`LIMIT` entries it starts afresh."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._principals: dict[bytes, Principal] = {}
        self._keys: dict[str, TrustedKey] = {}

    def remember(self, key: str, pepper: str, principal: Principal, keys: ReadKeys) -> None:
        """After a fresh read admitted ``key`` with role ``principal.role``."""
        digest = digest_of(key, pepper)
        with self._lock:
            if len(self._principals) + len(self._keys) > self.LIMIT:
                self._principals.clear()
                self._keys.clear()
            self._principals[digest] = principal
            for row in keys.rows:
                self._keys[row.keyid] = row

    def admit(self, key: str, pepper: str, roles: frozenset[str], keyids: Iterable[str]
              ) -> tuple[Remembered, ReadKeys] | None:
        """The remembered principal of ``key`` and the rows of ``keyids``, as a fresh
        read now would give them if nothing changed; None unless all are remembered and
        the role holds the permission (then the fresh path answers). A malformed key
        raises 401 as the fresh path does, before reading anything."""
        digest = digest_of(key, pepper)
        asked = frozenset(keyids)
        with self._lock:
            principal = self._principals.get(digest)
            rows = tuple(self._keys.get(k) for k in sorted(asked))
        if principal is None or principal.role not in roles or not asked:
            return None
        found = tuple(r for r in rows if r is not None)
        if len(found) != len(rows):
            return None
        return (Remembered(digest, principal, found),
                ReadKeys(asked, found, datetime.now(UTC)))

    def forget(self, remembered: Remembered) -> None:
        with self._lock:
            self._principals.pop(remembered.digest, None)
            for row in remembered.keys:
                self._keys.pop(row.keyid, None)


def keys_for(keys: ReadKeys) -> Callable[[Iterable[str]], KeyRing]:
    """A key loader (``ledger.services.ingest.KeyLoader``) over ``keys`` only: a key ID
    they do not hold raises :class:`NotRemembered` (nothing is read)."""
    def producer_keys(keyids: Iterable[str]) -> KeyRing:
        ring = keys.keyring(keyids, purpose="producer")
        if ring is None:
            raise NotRemembered
        return ring
    return producer_keys


#: :func:`stale`'s query: the fresh read's (``apikeys.BY_HASH_WITH_KEYS``) for many keys.
_CURRENT = BY_HASH_WITH_KEYS.replace("key_hash = %s", "key_hash = ANY(%s)")
assert _CURRENT != BY_HASH_WITH_KEYS


def stale(cur: Any, remembered: Sequence[Remembered]) -> list[bool]:
    """For each of ``remembered``: True when its rows are not as remembered now (the API
    key gone, revoked, or of another role or name; a producer key row changed in any
    field or gone). One statement on ``cur``; the rows read as the fresh path reads them
    (:func:`ledger.services.apikeys.key_rows`)."""
    digests = sorted({r.digest for r in remembered})
    keyids = sorted({k.keyid for r in remembered for k in r.keys})
    cur.execute(_CURRENT, (ByteaArray(digests), TextArray(keyids)))
    rows = cur.fetchall()
    principals = {bytes(r[4]): Principal(*r[1:4]) for r in rows
                  if r[0] == 0 and r[5] is None}  # API keys not revoked
    keys = {k.keyid: k for k in key_rows(rows)}
    return [principals.get(r.digest) != r.principal
            or any(keys.get(k.keyid) != k for k in r.keys) for r in remembered]


#: The storing statement's condition (``ledger.log.store.SEQUENCE``'s ``guard``), the same
#: test as :func:`stale` in SQL: every remembered API key's row exists, is not revoked
#: and has the remembered id, name and role; every remembered producer key's row has the
#: remembered fields. Key hashes and key IDs are unique, so each remembered row matches
#: at most one row, and the counts are equal only when all match.
GUARD = """guard AS (
  SELECT (SELECT count(*) FROM api_keys a,
                 unnest(%(g_hash)b::bytea[], %(g_id)b::text[], %(g_name)s::text[],
                        %(g_role)b::text[]) AS x(key_hash, id, name, role)
          WHERE a.key_hash = x.key_hash AND a.id::text = x.id AND a.name = x.name
            AND a.role = x.role AND a.revoked_at IS NULL) = %(g_principals)s
     AND (SELECT count(*) FROM signing_keys s,
                 unnest(%(g_keyid)b::text[], %(g_public_key)b::bytea[],
                        %(g_purpose)b::text[], %(g_status)b::text[],
                        %(g_not_before)b::timestamptz[], %(g_not_after)s::timestamptz[])
                 AS y(keyid, public_key, purpose, status, not_before, not_after)
          WHERE s.keyid = y.keyid AND s.public_key = y.public_key
            AND s.purpose = y.purpose AND s.status = y.status
            AND s.not_before = y.not_before
            AND s.not_after IS NOT DISTINCT FROM y.not_after) = %(g_keys)s AS ok
)"""


_CHECK = f"WITH {GUARD} SELECT ok FROM guard"  # noqa: S608 - our constant SQL only


def guard_params(remembered: Sequence[Remembered]) -> dict[str, Any]:
    """:data:`GUARD`'s parameters for ``remembered`` (each distinct row once)."""
    principals = sorted({(r.digest, r.principal) for r in remembered},
                        key=lambda p: (p[0], p[1].key_id, p[1].name, p[1].role))
    keys = sorted({k for r in remembered for k in r.keys}, key=lambda k: k.keyid)
    return {
        "g_hash": ByteaArray(d for d, _ in principals),
        "g_id": TextArray(p.key_id for _, p in principals),
        "g_name": [p.name for _, p in principals],   # free text: adapted by psycopg
        "g_role": TextArray(p.role for _, p in principals),
        "g_principals": len(principals),
        "g_keyid": TextArray(k.keyid for k in keys),
        "g_public_key": ByteaArray(k.public_key for k in keys),
        "g_purpose": TextArray(k.purpose for k in keys),
        "g_status": TextArray(k.status for k in keys),
        "g_not_before": TimestamptzArray(k.not_before for k in keys),
        "g_not_after": [k.not_after for k in keys],  # may be NULL
        "g_keys": len(keys),
    }


def check(cur: Any, remembered: Sequence[Remembered]) -> None:
    """:data:`GUARD` on its own (a storing step with nothing new to sequence): raises
    :class:`~ledger.log.store.SequenceRefused` when it does not hold."""
    cur.execute(_CHECK, guard_params(remembered))
    row = cur.fetchone()
    if row is None or not row[0]:
        raise SequenceRefused
