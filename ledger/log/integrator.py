"""The integrator: folds sequenced entries into the Merkle tree and publishes checkpoints.

One integration is one transaction: read the entries after the integrated size (at most
``max_entries``), recompute their leaf hashes from the stored entry bytes, compute the new
tiles and root, store the tiles (and the subtree hashes of the tiles that became full),
sign and insert the checkpoint, and move ``log_tree`` forward. Killing the process at any
point therefore loses nothing and can never publish a checkpoint that disagrees with
stored entries: either all of it commits or none of it.

Any number of processes may run it; ``FOR UPDATE SKIP LOCKED`` on the ``log_tree`` row
lets exactly one integrate at a time while the others move on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from ledger.core.errors import LedgerError
from ledger.core.merkle import leaf_hash
from ledger.core.tiles import integrate
from ledger.db.session import raw_cursor, session_scope
from ledger.log import store
from ledger.log.signer import LogSigner
from ledger.log.sink import CheckpointSink
from ledger.log.store import PgTileReader, write_tile_nodes, write_tiles

if TYPE_CHECKING:
    from ledger.log.witnessing import WitnessLoop
    from ledger.settings import Settings

log = logging.getLogger("ledger.integrator")


class IntegrityError_(LedgerError):
    """Stored entries disagree with themselves (a gap, or a leaf hash that does not match
    its entry): the integrator stops rather than sign over it."""

    code = "log_integrity"


@dataclass(frozen=True, slots=True)
class Published:
    tree_size: int
    root_hash: bytes
    note: bytes
    entries: int


def integrate_once(engine: Engine, signer: LogSigner, *, max_entries: int = 20_000,
                   sink: CheckpointSink | None = None) -> Published | None:
    """Integrate up to ``max_entries`` pending entries; None when there is nothing to do or
    another process holds the tree."""
    with session_scope(engine) as session, raw_cursor(session) as cur:
        tree_size = store.lock_tree(cur)
        if tree_size is None:
            return None  # another integrator is at work
        pending = store.sequenced_size(cur) - tree_size
        if pending <= 0:
            return None
        stop = tree_size + min(pending, max_entries)
        rows = store.entries_with_leaf_hashes(cur, tree_size, stop)
        hashes: list[bytes] = []
        for expected, (idx, entry, stored_hash) in enumerate(rows, start=tree_size):
            if idx != expected:
                raise IntegrityError_(f"log entry {expected} is missing")
            h = leaf_hash(entry)
            if h != stored_hash:
                raise IntegrityError_(f"log entry {idx}: stored leaf hash does not match "
                                      "its entry bytes")
            hashes.append(h)
        if len(hashes) != stop - tree_size:
            raise IntegrityError_(f"log entries {tree_size}..{stop - 1} are not all stored")
        result = integrate(tree_size, hashes, PgTileReader(cur, cache=None))
        write_tiles(cur, result.tiles)
        write_tile_nodes(cur, result.nodes)
        note = signer.sign(result.size, result.root)
        store.publish_checkpoint(cur, result.size, result.root, note)
    published = Published(result.size, result.root, note, len(hashes))
    if sink is not None:
        sink.publish(published.tree_size, published.note)
    return published


def integrate_all(engine: Engine, signer: LogSigner, *, max_entries: int = 20_000,
                  sink: CheckpointSink | None = None) -> list[Published]:
    """Integrate until nothing is pending (used by tests, the CLI and receipts)."""
    out = []
    while (p := integrate_once(engine, signer, max_entries=max_entries, sink=sink)) is not None:
        out.append(p)
    return out


class IntegratorThread:
    """Runs integration in the background: whenever ``max_entries`` are pending, or
    entries have waited ``interval_ms``.

    With witnesses configured (``LEDGER_WITNESSES``, read from ``settings`` or the global
    settings) it also runs a :class:`ledger.log.witnessing.WitnessLoop`: one thread per
    witness, woken after each checkpoint, so a slow witness never holds integration up."""

    def __init__(self, engine: Engine, signer: LogSigner, *, max_entries: int,
                 interval_ms: int, sink: CheckpointSink | None = None,
                 on_error: Callable[[Exception], None] | None = None,
                 settings: Settings | None = None) -> None:
        from ledger.log.witnessing import WitnessLoop
        from ledger.settings import get_settings

        self.witnesses: WitnessLoop | None = WitnessLoop.from_settings(
            settings or get_settings(), engine)
        self.engine = engine
        self.signer = signer
        self.max_entries = max_entries
        self.interval = interval_ms / 1000
        self.sink = sink
        self.on_error = on_error
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-integrator", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if self.witnesses is not None:
            self.witnesses.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self.witnesses is not None:
            self.witnesses.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                while not self._stop.is_set() and integrate_once(
                        self.engine, self.signer, max_entries=self.max_entries,
                        sink=self.sink) is not None:
                    if self.witnesses is not None:
                        self.witnesses.wake()
            except Exception as exc:  # noqa: BLE001 - keep integrating after DB outages
                log.warning("integration failed: %s", exc)
                if self.on_error:
                    self.on_error(exc)
                time.sleep(min(self.interval * 5, 2.0))
            self._wake.wait(self.interval)
            self._wake.clear()
