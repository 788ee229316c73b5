"""`ledger audit`: recompute the whole log from the stored records and check every
checkpoint against it.

What is checked, in one pass over the entries in index order:

1. the index sequence has no gap;
2. each entry is recomputed from its record (an envelope's stored DSSE bytes give the
   digest; the record's own ID gives ``ref``) and must equal the stored entry and leaf hash;
3. optionally (``signatures=True``) every envelope's DSSE signatures verify;
4. the Merkle tree is rebuilt from the recomputed leaves; at every checkpoint size the
   recomputed root must equal the checkpoint's, whose note must carry a valid signature
   by a registered log key; successive checkpoints must be consistent (a consistency
   proof generated from the recomputed tree verifies between their stored roots);
5. the stored tiles must equal the recomputed ones;
6. with ``against`` (checkpoints saved outside the database), each saved checkpoint's
   signature is checked and its root must equal the recomputed root at its size. This is
   what catches a history rewritten consistently by someone holding the log key.

The report names the first bad index it can pin down.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from ledger.core import dsse
from ledger.core.errors import LedgerError
from ledger.core.logentry import log_entry_bytes
from ledger.core.merkle import EMPTY_ROOT, leaf_hash, verify_consistency
from ledger.core.note import open_checkpoint
from ledger.core.tiles import (
    MemoryTileStore,
    consistency_proof_from_tiles,
    integrate,
    tiles_for_size,
)
from ledger.db.session import session_scope
from ledger.log.signer import log_verifiers

CHUNK = 5_000


@dataclass
class AuditReport:
    entries: int = 0
    tree_size: int = 0
    checkpoints: int = 0
    saved_checkpoints: int = 0
    signatures_checked: int = 0
    problems: list[str] = field(default_factory=list)
    first_bad_index: int | None = None
    bad_range: tuple[int, int] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, message: str, index: int | None = None) -> None:
        self.problems.append(message)
        if index is not None and (self.first_bad_index is None or index < self.first_bad_index):
            self.first_bad_index = index


@dataclass
class _Checkpoint:
    size: int
    root: bytes
    note: bytes
    source: str  # "db" or a saved file's name


def _record_entry(kind: str, row: tuple[Any, ...]) -> tuple[bytes | None, str | None]:
    """(entry recomputed from the record, problem) for one joined row."""
    _, _, _, _, _, env_rid, env_dsse = row
    if kind == "envelope":
        if env_dsse is None:
            return None, "its envelope record is missing"
        digest = hashlib.sha256(bytes(env_dsse)).hexdigest()
        return log_entry_bytes("envelope", env_rid, digest), None
    return None, None  # kinds without a record table yet: the stored entry is used


def audit(engine: Engine, origin: str, *, against: Iterable[tuple[str, bytes]] = (),
          signatures: bool = False,
          progress: Callable[[int, int], None] | None = None) -> AuditReport:
    report = AuditReport()
    with session_scope(engine) as session:
        verifiers = log_verifiers(session, origin)
        producer_keys = _producer_keys(session) if signatures else {}
        conn = session.connection().connection.driver_connection
        assert conn is not None
        with conn.cursor() as cur:
            cur.execute("SELECT tree_size, root_hash, note FROM checkpoints ORDER BY tree_size")
            db_cps = [_Checkpoint(r[0], bytes(r[1]), bytes(r[2]), "db") for r in cur.fetchall()]
            cur.execute("SELECT size FROM log_state WHERE id = 1")
            sequenced = int(cur.fetchone()[0])
            cur.execute("SELECT size, root_hash FROM log_tree WHERE id = 1")
            tree_row = cur.fetchone()
            cur.execute("SELECT level, idx, data FROM tiles")
            stored_tiles = {(r[0], r[1]): bytes(r[2]) for r in cur.fetchall()}
        saved = []
        for name, note in against:
            try:
                cp = open_checkpoint(note, verifiers, origin=origin)
            except LedgerError as exc:
                report.fail(f"saved checkpoint {name}: {exc.message}")
                continue
            saved.append(_Checkpoint(cp.size, cp.root_hash, note, name))
        report.saved_checkpoints = len(saved)

        for cp in db_cps:
            try:
                opened = open_checkpoint(cp.note, verifiers, origin=origin)
            except LedgerError as exc:
                report.fail(f"checkpoint {cp.size}: {exc.message}")
                continue
            if (opened.size, opened.root_hash) != (cp.size, cp.root):
                report.fail(f"checkpoint {cp.size}: the signed note says size {opened.size}")
        report.checkpoints = len(db_cps)

        # Roots we must recompute: every checkpoint size, stored or saved elsewhere.
        wanted = sorted({c.size for c in db_cps} | {c.size for c in saved})
        roots: dict[int, bytes] = {0: EMPTY_ROOT}
        store = MemoryTileStore()
        size = 0
        pending: list[bytes] = []
        next_want = iter(wanted)
        target = next(next_want, None)
        expected = 0

        def flush_to(limit: int) -> None:
            nonlocal size, pending
            while pending and size < limit:
                take = min(len(pending), limit - size)
                res = integrate(size, pending[:take], store)
                store.write_tiles(res.tiles)
                size = res.size
                pending = pending[take:]
                roots[size] = res.root

        with conn.cursor(name="audit_entries") as stream:
            stream.itersize = CHUNK
            stream.execute(
                "SELECT e.idx, e.kind, e.ref, e.entry, e.leaf_hash, v.request_id, v.dsse "
                "FROM log_entries e LEFT JOIN envelopes v ON v.log_index = e.idx "
                "ORDER BY e.idx")
            for row in stream:
                idx, kind, ref, entry, stored_leaf = row[0], row[1], row[2], bytes(row[3]), \
                    bytes(row[4])
                if idx != expected:
                    report.fail(f"entries {expected}..{idx - 1} are missing", expected)
                    # keep going with the indices we have, so later checks still run
                    expected = idx
                recomputed, problem = _record_entry(kind, row)
                if problem:
                    report.fail(f"entry {idx} ({kind} {ref}): {problem}", idx)
                elif recomputed is not None and recomputed != entry:
                    report.fail(f"entry {idx} ({kind} {ref}): the stored entry does not match "
                                "its record (record changed or moved)", idx)
                if leaf_hash(entry) != stored_leaf:
                    report.fail(f"entry {idx}: stored leaf hash does not match the entry", idx)
                if signatures and kind == "envelope" and row[6] is not None:
                    try:
                        env = dsse.envelope_from_json(bytes(row[6]))
                        dsse.verify_envelope(env, lambda k: producer_keys[k])
                        report.signatures_checked += 1
                    except (LedgerError, KeyError) as exc:
                        report.fail(f"entry {idx}: envelope signature: {exc}", idx)
                pending.append(leaf_hash(recomputed if recomputed is not None else entry))
                expected += 1
                while target is not None and size + len(pending) >= target:
                    flush_to(target)
                    target = next(next_want, None)
                if len(pending) >= CHUNK:  # every target <= this size was flushed above
                    flush_to(size + len(pending))
                if progress and expected % CHUNK == 0:
                    progress(expected, sequenced)
        flush_to(size + len(pending))
        report.entries = expected
        report.tree_size = size
        if progress:
            progress(expected, sequenced)

    if sequenced != expected:
        report.fail(f"log_state says {sequenced} entries were sequenced, {expected} are stored",
                    min(sequenced, expected))
    _check_roots(report, db_cps, roots, store)
    _check_saved(report, saved, roots)
    if tree_row is not None and db_cps and (tree_row[0], bytes(tree_row[1])) != (
            db_cps[-1].size, db_cps[-1].root):
        report.fail("log_tree does not match the latest checkpoint")
    _check_tiles(report, stored_tiles, store,
                 min(db_cps[-1].size if db_cps else 0, report.tree_size))
    return report


def _producer_keys(session: Any) -> dict[str, bytes]:
    from sqlalchemy import select

    from ledger.db.models import SigningKey

    rows = session.execute(select(SigningKey.keyid, SigningKey.public_key)
                           .where(SigningKey.purpose == "producer")).all()
    return {r[0]: bytes(r[1]) for r in rows}


def _check_roots(report: AuditReport, cps: list[_Checkpoint], roots: dict[int, bytes],
                 store: MemoryTileStore) -> None:
    previous: _Checkpoint | None = None
    for cp in cps:
        root = roots.get(cp.size)
        if root is None:
            report.fail(f"checkpoint {cp.size} is beyond the {report.tree_size} stored entries",
                        report.tree_size)
            continue
        if root != cp.root:
            lo = previous.size if previous else 0
            report.fail(f"checkpoint {cp.size}: root differs from the tree recomputed from "
                        f"the stored entries (first difference in {lo}..{cp.size - 1})", lo)
        elif previous is not None:
            try:
                proof = consistency_proof_from_tiles(previous.size, cp.size, store)
                verify_consistency(previous.size, cp.size, proof, previous.root, cp.root)
            except LedgerError as exc:
                report.fail(f"checkpoints {previous.size} -> {cp.size} are not consistent: "
                            f"{exc.message}", previous.size)
        previous = cp


def _check_saved(report: AuditReport, saved: list[_Checkpoint], roots: dict[int, bytes]) -> None:
    """Saved checkpoints narrow a rewrite down: between the last one that agrees and the
    first that does not."""
    agreeing = 0
    for cp in sorted(saved, key=lambda c: c.size):
        root = roots.get(cp.size)
        if root is None:
            report.fail(f"saved checkpoint {cp.source} (size {cp.size}) is beyond the stored "
                        f"log of {report.tree_size} entries: the log was truncated",
                        report.tree_size)
            continue
        if root == cp.root:
            agreeing = max(agreeing, cp.size)
            continue
        report.bad_range = (agreeing, cp.size)
        where = (f"entry {agreeing}" if cp.size - agreeing == 1
                 else f"entries {agreeing}..{cp.size - 1}")
        report.fail(f"saved checkpoint {cp.source} (size {cp.size}) disagrees with the log: "
                    f"history was rewritten at {where}", agreeing)
        return


def _check_tiles(report: AuditReport, stored: dict[tuple[int, int], bytes],
                 store: MemoryTileStore, size: int) -> None:
    for tile in tiles_for_size(size):
        want = store.read_tiles([tile])[0]
        have = stored.get((tile.level, tile.index), b"")[: tile.width * 32]
        if have != want:
            first = next((i for i in range(tile.width)
                          if have[i * 32:(i + 1) * 32] != want[i * 32:(i + 1) * 32]), 0)
            index = (tile.index * 256 + first) << (8 * tile.level)
            report.fail(f"stored tile {tile.path} differs from the recomputed tree", index)
            return


