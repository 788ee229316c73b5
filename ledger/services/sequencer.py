"""The sequencer: hands out log indices, gap-free, to every kind of leaf.

Callers hold the ``log_state`` row lock (``lock``) for the short time between reading the
next index and committing; envelopes, verdicts and dispute events all go through here, so
they share one gap-free index space and one tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ledger.core.logentry import log_entry_bytes
from ledger.core.merkle import leaf_hash
from ledger.log import store


def lock(cur: Any) -> int:
    """Lock the sequencer for this transaction; returns the next free log index."""
    return store.sequenced_size(cur, lock=True)


def append(cur: Any, start: int, leaves: Sequence[tuple[str, str, str]]) -> list[int]:
    """Write log entries for (kind, ref, dsse_sha256 hex) from ``start``; returns indices.
    The caller holds the lock (``start`` came from :func:`lock`)."""
    if not leaves:
        return []
    rows = []
    for kind, ref, digest in leaves:
        entry = log_entry_bytes(kind, ref, digest)
        rows.append((kind, ref, entry, leaf_hash(entry)))
    store.append_entries(cur, start, rows)
    return list(range(start, start + len(leaves)))


def append_one(cur: Any, kind: str, ref: str, dsse_sha256: str) -> int:
    return append(cur, lock(cur), [(kind, ref, dsse_sha256)])[0]
