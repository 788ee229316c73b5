"""The sequencer: hands out log indices, gap-free, to every kind of leaf.

Envelopes, verdicts, dispute events and admin events all go through :func:`append`, so
they share one gap-free index space and one tree. Indices come from the ``log_state`` row,
not from a PostgreSQL sequence: a rolled-back transaction rolls its indices back with it,
which a sequence cannot do.

One statement (:data:`ledger.log.store.SEQUENCE`) moves ``log_state`` past the new
entries, writes them and, through the caller's CTEs, the records that carry the indices.
Its first step, the ``UPDATE`` of ``log_state``, takes the row lock that serialises
sequencing; the transaction's commit releases it. The API's ingest runs that statement as
a transaction of its own (autocommit: statement and commit in one round trip) and lets
every waiting request of the process share it (:class:`ledger.services.ingest.GroupCommit`),
so the lock is never held across a round trip to the API process and one WAL flush
serves many envelopes. Verdicts, dispute events and admin events append inside their own
transaction (they are rare): the lock is held from the statement to that transaction's
commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ledger.core.logentry import log_entry_bytes
from ledger.core.merkle import leaf_hash
from ledger.log import store


def lock(cur: Any) -> int:
    """Take the sequencer lock for this transaction before anything else (erasure, and
    sealed ingest, which then lock data keys: one lock order); the next free index."""
    return store.sequenced_size(cur, lock=True)


def append(cur: Any, leaves: Sequence[tuple[str, str, str]], records: str = "",
           params: Mapping[str, Any] | None = None, guard: str = "") -> list[int]:
    """Sequence log entries for (kind, ref, dsse_sha256 hex) in one statement, with the
    ``records`` CTEs that store what they name (each reads ``seq.start``); returns their
    indices. A failed statement sequences nothing; so does one whose ``guard`` CTE is
    false (:class:`ledger.log.store.SequenceRefused`)."""
    if not leaves:
        return []
    rows = []
    for kind, ref, digest in leaves:
        entry = log_entry_bytes(kind, ref, digest)
        rows.append((kind, ref, entry, leaf_hash(entry)))
    start = store.sequence(cur, rows, records, params, guard)
    return list(range(start, start + len(leaves)))


def append_one(cur: Any, kind: str, ref: str, dsse_sha256: str) -> int:
    return append(cur, [(kind, ref, dsse_sha256)])[0]
