"""Inclusion and consistency proofs served from stored tiles, against stored checkpoints.

A proof is built from stored hashes (tiles, the subtree hashes of full tiles, a
process-wide cache of subtree hashes: :mod:`ledger.log.store`), none of which is signed.
So before a proof is served it is verified against the root of the signed checkpoint it
is served with, the (size, root) taken from the note's signed text, not from the
``checkpoints`` columns: a changed hash anywhere below gives :class:`StoredTreeMismatch`
(after one retry with the cache dropped), never a wrong proof. With the log's keys
(``log_keys``: from outside the database, the log key file or the trust policy) the
note's signature is checked too, once per distinct note: the process keeps what it
verified keyed on the note's exact bytes and the keys, so a changed note is checked anew.

One round trip per proof: the checkpoint, the entry and the tiles the proof needs (what
the subtree cache lacks, for the size of the latest checkpoint this process saw) are
read in one statement; only when the latest checkpoint moved does a second read fetch
what the new size needs. Verifying costs about 20 SHA-256 calls. An entry of a full tile
that an earlier proof of the same signed tree went through, and that the process keeps,
reads only its checkpoint and entry: :class:`TilePaths` proves it from the kept tile and
what that proof proved, in 8 SHA-256 calls. A consistency proof from a size m whose entry
m - 1 lies in such a tile reads only its checkpoints: it is the old tree's last full
subtree and the path above it, from the kept tile and the same proved path, checked as
that inclusion proof is (up to the proved tile hash: so it leads to the signed new root)
and, where a checkpoint of size m exists, against its signed old root; verified
consistency proofs teach :class:`TilePaths` too.
"""

from __future__ import annotations

import base64
import threading
from binascii import b2a_base64
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from ledger.core.bundle import record_suffix
from ledger.core.errors import LedgerError, ProofError, TreeRangeError
from ledger.core.merkle import HASH_SIZE, node_hash, verify_consistency, verify_inclusion
from ledger.core.merkle import leaf_hash as compute_leaf_hash
from ledger.core.note import NoteVerifier, decode_note, open_note, parse_checkpoint
from ledger.core.tiles import (
    TILE_HEIGHT,
    TILE_WIDTH,
    NodeSlice,
    Tile,
    consistency_proof_and_old_root_from_tiles,
    consistency_proof_slices,
    inclusion_proof_from_tiles,
    inclusion_proof_slices,
    subtree_path_from_tiles,
    tile_node_offset,
    tile_nodes,
    tile_width,
)
from ledger.db.session import raw_connection
from ledger.errors import NotFound, StoredTreeMismatch
from ledger.log.store import (
    SUBTREES,
    PgTileReader,
    ProofRows,
    StoredCheckpoint,
    database_scope,
    read_for_proof,
)

T = TypeVar("T")


class NotYetIntegrated(NotFound):
    code = "not_yet_integrated"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True, slots=True)
class InclusionReceipt:
    """Everything needed to check one entry offline against one signed checkpoint."""

    log_index: int
    tree_size: int
    entry: bytes
    leaf_hash: bytes
    proof: list[bytes]
    checkpoint: StoredCheckpoint

    def to_json(self) -> dict[str, Any]:
        return {
            "log_index": self.log_index,
            "tree_size": self.tree_size,
            "entry": _b64(self.entry),
            "leaf_hash": _b64(self.leaf_hash),
            "inclusion_proof": [_b64(h) for h in self.proof],
            "root_hash": _b64(self.checkpoint.root_hash),
            "checkpoint": self.checkpoint.note.decode(),
        }


_SIGNED: dict[tuple[bytes, tuple[NoteVerifier, ...]], StoredCheckpoint] = {}
#: The size of the latest checkpoint each database last served (which tiles to read).
_LATEST: dict[str, int] = {}


def signed_checkpoint(cp: StoredCheckpoint,
                      log_keys: Sequence[NoteVerifier] = ()) -> StoredCheckpoint:
    """``cp`` with size and root read from its note's text (what its signature covers);
    :class:`StoredTreeMismatch` when the columns say otherwise or, with ``log_keys``,
    when no signature by one of them verifies. Without ``log_keys`` the signature is the
    reader's to check, against keys it trusts (the note is served as it is).

    Remembered per (exact note bytes, keys): a note seen before costs a dict lookup."""
    keys = tuple(log_keys)
    known = _SIGNED.get((cp.note, keys))
    if known is None:
        try:
            if keys:
                text = open_note(cp.note, keys).text
            else:
                text = decode_note(cp.note)
                split = text.rfind("\n\n")
                text = text[: split + 1] if split >= 0 else text
            parsed = parse_checkpoint(text)
        except LedgerError as exc:
            raise StoredTreeMismatch(f"the stored checkpoint of size {cp.tree_size} is not "
                                     f"a checkpoint signed by the log: {exc.message}") from None
        known = StoredCheckpoint(parsed.size, parsed.root_hash, cp.note)
        if len(_SIGNED) > 64:
            _SIGNED.clear()
        _SIGNED[(cp.note, keys)] = known
    if (known.tree_size, known.root_hash) != (cp.tree_size, cp.root_hash):
        raise StoredTreeMismatch(f"the stored checkpoint of size {cp.tree_size}: its "
                                 "columns differ from its signed note")
    return known


def _found(cp: StoredCheckpoint | None, tree_size: int | None) -> StoredCheckpoint:
    if cp is None:
        if tree_size is None:
            raise NotYetIntegrated("the log has no checkpoint yet")
        raise NotFound(f"no checkpoint of tree size {tree_size}", code="no_such_checkpoint")
    return cp


def _pick(rows: list[StoredCheckpoint], size: int | None) -> StoredCheckpoint | None:
    if size is None:
        return max(rows, key=lambda c: c.tree_size) if rows else None
    return next((c for c in rows if c.tree_size == size), None)


Memo = MutableMapping[tuple[int, int], bytes]


class _ProofMemo(MutableMapping[tuple[int, int], bytes]):
    """The hashes one proof may use: what it read, then the process cache. The cache
    gets those every proof may share: above level-0 tiles (tree level 8 and up: a few
    per 256 entries) and inside the rightmost, partial one (in every proof of the
    size); the others, inside one full level-0 tile, which random reads rarely share,
    stay with this proof, so they do not crowd the shared ones out of the bounded cache."""

    def __init__(self, shared: Memo, fetched: dict[tuple[int, int], bytes], size: int) -> None:
        self.shared, self.own = shared, fetched
        self.edge = size >> TILE_HEIGHT << TILE_HEIGHT  # the partial tile's first leaf
        for node, h in fetched.items():
            self[node] = h

    def __getitem__(self, node: tuple[int, int]) -> bytes:
        found = self.own.get(node)
        return found if found is not None else self.shared[node]

    def get(self, node: tuple[int, int], default: Any = None) -> Any:  # the ABC's: 3 calls
        found = self.own.get(node)
        return found if found is not None else self.shared.get(node, default)

    def __setitem__(self, node: tuple[int, int], h: bytes) -> None:
        level, index = node
        shared = level >= TILE_HEIGHT or index << level >= self.edge
        (self.shared if shared else self.own)[node] = h

    def __delitem__(self, node: tuple[int, int]) -> None:
        raise TypeError("a proof's hashes are not deleted")

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter({**self.shared, **self.own})

    def __len__(self) -> int:
        return len({**self.shared, **self.own})


def _verified(build: Callable[[Memo | None], T], check: Callable[[T], None], memo: Memo,
              scope: str, what: str) -> T:
    """``build(memo)`` a proof, ``check`` it; on failure once more without the cache
    (which may hold a hash read before a repair), then refuse."""
    proof = build(memo)
    try:
        check(proof)
        return proof
    except ProofError:
        SUBTREES.forget(scope)
    proof = build(None)
    try:
        check(proof)
    except ProofError:
        raise StoredTreeMismatch(
            f"the {what} built from the stored tree does not verify against the signed "
            "checkpoint: the stored tiles or subtree hashes were changed; run `ledger "
            "audit`") from None
    return proof


def _read(cur: Any, size: int | None, sizes: list[int | None], index: int | None,
          slices: Callable[[str, int, Memo], list[NodeSlice]]
          ) -> tuple[str, Memo, ProofRows]:
    """A proof's one round trip: the checkpoints of ``sizes``, entry ``index`` and the
    stored hashes ``slices(scope, size, memo)`` names that the process cache lacks, for
    ``size`` (None: the latest this process saw; nothing the first time)."""
    scope = database_scope(cur)
    memo = SUBTREES.for_scope(scope)
    guess = _LATEST.get(scope) if size is None else size
    want = slices(scope, guess, memo) if guess is not None else []
    return scope, memo, read_for_proof(cur, sizes, index, want, SUBTREES, scope)


class _ReaderOnDemand:
    """A :class:`PgTileReader` on a cursor of its own, made only when a proof needs a
    read its one statement did not cover (the latest checkpoint moved, a retry)."""

    def __init__(self, conn: Any, scope: str) -> None:
        self.conn, self.scope = conn, scope
        self._reader: PgTileReader | None = None

    def _get(self) -> PgTileReader:
        if self._reader is None:
            self._reader = PgTileReader(self.conn.cursor(), scope=self.scope)
        return self._reader

    def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
        return self._get().read_tiles(tiles)

    def read_tiles_and_nodes(self, tiles: Sequence[Tile]) -> list[tuple[bytes, bytes | None]]:
        return self._get().read_tiles_and_nodes(tiles)


def inclusion(session: Session | Connection, log_index: int, tree_size: int | None = None, *,
              log_keys: Sequence[NoteVerifier] = ()) -> InclusionReceipt:
    """The inclusion proof of entry ``log_index`` against the checkpoint of ``tree_size``
    (None: the latest), verified against its signed root (and, with ``log_keys``, the
    note's signature checked) before it is returned."""
    conn = raw_connection(session)
    with conn.cursor(binary=True) as cur:
        scope, memo, rows = _read(
            cur, tree_size, [tree_size], log_index,
            lambda scope, size, memo: [] if TILE_PATHS.ready(scope, size, log_index)
            else inclusion_proof_slices(log_index, size, memo)
            if 0 <= log_index < size else [])
        cp = signed_checkpoint(_found(_pick(rows.checkpoints, tree_size), tree_size),
                               log_keys)
        if tree_size is None:
            _LATEST[scope] = cp.tree_size
        if log_index >= cp.tree_size:
            raise NotYetIntegrated(
                f"log index {log_index} is not in the latest checkpoint (size {cp.tree_size}) "
                "yet; retry shortly")
        if rows.entry is None:
            raise NotFound(f"no log entry {log_index}")
        entry = rows.entry
        leaf = compute_leaf_hash(entry)
        proof = TILE_PATHS.proof(scope, cp, log_index, leaf)
        if proof is None:
            reader = _ReaderOnDemand(conn, scope)
            proof = _verified(
                lambda memo: inclusion_proof_from_tiles(log_index, cp.tree_size, reader, memo),
                lambda p: verify_inclusion(leaf, log_index, cp.tree_size, p, cp.root_hash),
                _ProofMemo(memo, rows.hashes, cp.tree_size), scope,
                f"inclusion proof of entry {log_index}")
            TILE_PATHS.learn(scope, cp, log_index, leaf, proof)
    return InclusionReceipt(log_index, cp.tree_size, entry, leaf, proof, cp)


class TilePaths:
    """Inclusion proofs of entries in full level-0 tiles (and consistency proofs from the
    sizes that end in them: :meth:`consistency`), from what earlier proofs of the
    same signed tree proved: per tree (size, root), for each tile a proof went through,
    the tile's hash and the proof elements above it (``proof[8:]``, verified against the
    signed root with the rest of that proof, or with a consistency proof through the
    tile: :meth:`learn_consistency`). An entry of such a tile whose tile is kept
    (:class:`~ledger.log.store.SubtreeCache`) needs only its checkpoint and entry read:
    its 8 in-tile siblings come from the kept tile, and hashing its leaf up through them
    must give the tile's hash, which together with the elements above it leads to the
    signed root; so the proof is verified as a whole proof is, with 8 SHA-256 calls
    instead of 20 and none of the work of finding and reading its hashes. A kept tile
    that does not hash to what was proved gives no proof here (the full path then
    decides, and the database's kept tiles and hashes are dropped, as after any failed
    check). Bounded per tree; a few trees per database."""

    PER_TREE = 8192   # tiles (1 KiB each with the path above: ~8 MiB for 2M entries)
    TREES = 4

    def __init__(self) -> None:
        self._trees: dict[tuple[str, int, bytes], dict[int, tuple[bytes, list[bytes]]]] = {}
        self._sizes: dict[tuple[str, int], bytes] = {}  # (scope, size) -> root last seen
        self._lock = threading.Lock()

    def ready(self, scope: str, size: int, index: int) -> bool:
        """Whether a proof of ``index`` in the tree of ``size`` (if its root is the one last
        seen) can be made without reading hashes: its tile's path is known and the tile is
        kept. (A guess made before the checkpoint is read: :meth:`proof` decides.)"""
        root = self._sizes.get((scope, size))
        tile = index >> TILE_HEIGHT
        if root is None or tile >= size >> TILE_HEIGHT:
            return False
        paths = self._trees.get((scope, size, root))
        return (paths is not None and tile in paths
                and SUBTREES.tile(scope, 0, tile) is not None)

    def _kept(self, scope: str, cp: StoredCheckpoint, index: int
              ) -> tuple[bytes, bytes, list[bytes]] | None:
        """(the kept tile of entry ``index`` laid flat, the tile's proved hash, the proved
        path above it) in ``cp``'s tree, when all are known and the tile is full."""
        tile = index >> TILE_HEIGHT
        if tile >= cp.tree_size >> TILE_HEIGHT:
            return None
        paths = self._trees.get((scope, cp.tree_size, cp.root_hash))
        known = paths.get(tile) if paths is not None else None
        flat = SUBTREES.tile(scope, 0, tile) if known is not None else None
        if known is None or flat is None:
            return None
        return flat, known[0], known[1]

    def proof(self, scope: str, cp: StoredCheckpoint, index: int, leaf: bytes
              ) -> list[bytes] | None:
        kept = self._kept(scope, cp, index)
        if kept is None:
            return None
        flat, tile_hash, above = kept
        position, h, siblings = index & (TILE_WIDTH - 1), leaf, []
        for j in range(TILE_HEIGHT):
            k = (position >> j) ^ 1
            at = (k if j == 0 else 2 * TILE_WIDTH - (2 * TILE_WIDTH >> j) + k) * HASH_SIZE
            sibling = flat[at:at + HASH_SIZE]
            h = node_hash(sibling, h) if (position >> j) & 1 else node_hash(h, sibling)
            siblings.append(sibling)
        if h != tile_hash:   # the kept tile is not the one proved: drop what was read
            SUBTREES.forget(scope)
            return None
        return siblings + above

    def consistency(self, scope: str, cp: StoredCheckpoint, old_size: int,
                    old_root: bytes | None) -> list[bytes] | None:
        """The consistency proof from ``old_size`` (0 < old_size < size) to ``cp``'s tree,
        when the tile of entry ``old_size - 1`` is full, kept and its path known; None
        otherwise, or when it does not check out.

        With 2**l the largest power of two dividing ``old_size``, RFC 9162's proof is
        the old tree's last full subtree (l, old_size >> l - 1), then the path above it,
        which is PATH(old_size - 1)[l:] (the elements below level l lie inside that
        subtree); the subtree itself is left out when it is the whole old tree (old_size
        a power of two). Inside the tile the subtree and the siblings above it come from
        the kept tile, and hashed up they must give the tile's proved hash (else the
        database's kept tiles and hashes are dropped, as after any failed check); above
        the tile the path is the proved one (for l > 8 the subtree is made from the
        tile's hash and the first elements of that path). So the proof leads to the
        signed root as a whole proof verified against it does (:meth:`proof`). With
        ``old_root``, the signed root of ``old_size``, the old root the proof implies
        (what RFC 9162's verification folds its left siblings into) must be it."""
        kept = self._kept(scope, cp, old_size - 1)
        if kept is None:
            return None
        flat, tile_hash, above = kept
        low = (old_size & -old_size).bit_length() - 1  # l
        if low >= TILE_HEIGHT:   # the subtree is the tile's, or above it: left siblings
            start = tile_hash
            for sibling in above[:low - TILE_HEIGHT]:
                start = node_hash(sibling, start)
            path = [start, *above[low - TILE_HEIGHT:]]
        else:
            position = (old_size - 1) & (TILE_WIDTH - 1)
            h = _flat_node(flat, low, position >> low)
            path = [h]
            for j in range(low, TILE_HEIGHT):
                sibling = _flat_node(flat, j, (position >> j) ^ 1)
                h = node_hash(sibling, h) if (position >> j) & 1 else node_hash(h, sibling)
                path.append(sibling)
            if h != tile_hash:   # the kept tile is not the one proved
                SUBTREES.forget(scope)
                return None
            path += above
        if old_root is not None and _old_root(old_size, cp.tree_size, path) != old_root:
            return None   # the full path decides (and refuses)
        return path if old_size & (old_size - 1) else path[1:]

    def learn(self, scope: str, cp: StoredCheckpoint, index: int, leaf: bytes,
              proof: list[bytes]) -> None:
        """Keep what ``proof`` (verified: entry ``index`` with ``leaf`` in ``cp``'s tree)
        proves about its tile, when the tile is full."""
        tile = index >> TILE_HEIGHT
        if tile >= cp.tree_size >> TILE_HEIGHT or len(proof) < TILE_HEIGHT:
            return
        position, h = index & (TILE_WIDTH - 1), leaf
        for j in range(TILE_HEIGHT):
            sibling = proof[j]
            h = node_hash(sibling, h) if (position >> j) & 1 else node_hash(h, sibling)
        self._keep(scope, cp, tile, h, proof[TILE_HEIGHT:])

    def learn_consistency(self, scope: str, cp: StoredCheckpoint, old_size: int,
                          proof: list[bytes], old_root: bytes) -> None:
        """Keep what ``proof`` (verified: from ``old_size``, with ``old_root``, to
        ``cp``'s tree) proves about the tile of entry ``old_size - 1``, when the tile is
        full and the proof goes through it (the largest power of two dividing
        ``old_size`` is at most the tile's 256): see :meth:`consistency`."""
        low = (old_size & -old_size).bit_length() - 1
        tile = (old_size - 1) >> TILE_HEIGHT
        if not 0 < old_size < cp.tree_size or low > TILE_HEIGHT \
                or tile >= cp.tree_size >> TILE_HEIGHT:
            return
        path = proof if old_size & (old_size - 1) else [old_root, *proof]
        if len(path) < 1 + TILE_HEIGHT - low:
            return
        position, h = (old_size - 1) & (TILE_WIDTH - 1), path[0]
        for j in range(low, TILE_HEIGHT):
            sibling = path[1 + j - low]
            h = node_hash(sibling, h) if (position >> j) & 1 else node_hash(h, sibling)
        self._keep(scope, cp, tile, h, path[1 + TILE_HEIGHT - low:])

    def _keep(self, scope: str, cp: StoredCheckpoint, tile: int, tile_hash: bytes,
              above: list[bytes]) -> None:
        key = (scope, cp.tree_size, cp.root_hash)
        with self._lock:
            paths = self._trees.get(key)
            if paths is None:
                if len(self._trees) >= self.TREES:
                    self._trees.clear()
                    self._sizes.clear()
                paths = self._trees[key] = {}
                self._sizes[(scope, cp.tree_size)] = cp.root_hash
            if len(paths) >= self.PER_TREE:
                paths.clear()
            paths[tile] = (tile_hash, list(above))

    def forget(self) -> None:
        with self._lock:
            self._trees.clear()
            self._sizes.clear()


TILE_PATHS = TilePaths()


def _flat_node(flat: bytes, j: int, k: int) -> bytes:
    """Node ``k`` at in-tile level ``j`` (0: the tile's hashes) of a full tile laid flat
    (its 256 hashes, then :func:`tile_nodes`)."""
    at = k * HASH_SIZE if j == 0 else TILE_WIDTH * HASH_SIZE + tile_node_offset(j, k)
    return flat[at:at + HASH_SIZE]


def _old_root(old_size: int, new_size: int, path: list[bytes]) -> bytes:
    """MTH(D[0:old_size]) as a consistency proof's ``path`` (its subtree first, the
    proof's first element or the old root: see :meth:`TilePaths.consistency`) implies
    it: what RFC 9162's verification (:func:`verify_consistency`) folds the left
    siblings into. Checked against the new root by that verification."""
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    root = path[0]
    for sibling in path[1:]:
        if fn & 1 or fn == sn:
            root = node_hash(sibling, root)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        fn >>= 1
        sn >>= 1
    return root




def consistency(session: Session | Connection, old_size: int, new_size: int | None, *,
                log_keys: Sequence[NoteVerifier] = ()) -> dict[str, Any]:
    """The consistency proof from ``old_size`` to the checkpoint of ``new_size`` (None:
    the latest), verified as :func:`inclusion` verifies, in one round trip as a rule."""
    conn = raw_connection(session)
    with conn.cursor(binary=True) as cur:
        scope, memo, rows = _read(
            cur, new_size, [new_size, old_size], None,
            lambda scope, size, memo: []
            if 0 < old_size < size and TILE_PATHS.ready(scope, size, old_size - 1)
            else consistency_proof_slices(old_size, size, memo)
            if 0 <= old_size <= size else [])
        new_cp = signed_checkpoint(_found(_pick(rows.checkpoints, new_size), new_size),
                                   log_keys)
        if new_size is None:
            _LATEST[scope] = new_cp.tree_size
        if old_size > new_cp.tree_size:
            raise TreeRangeError(f"from={old_size} is larger than to={new_cp.tree_size}")
        old_stored = _pick(rows.checkpoints, old_size)
        old_cp = signed_checkpoint(old_stored, log_keys) if old_stored and old_size else None
        quick = TILE_PATHS.consistency(scope, new_cp, old_size,
                                       old_cp.root_hash if old_cp else None) \
            if 0 < old_size < new_cp.tree_size else None
        if quick is not None:
            return _consistency_json(old_size, quick, old_cp, new_cp)
        reader = _ReaderOnDemand(conn, scope)

        def build(memo: Memo | None) -> tuple[list[bytes], bytes]:
            # Without a checkpoint at old_size the old root comes from the same stored
            # tree; the proof must still lead to the signed new root, which (unless
            # SHA-256 collides) only the true hashes do.
            return consistency_proof_and_old_root_from_tiles(old_size, new_cp.tree_size,
                                                             reader, memo)

        def check(built: tuple[list[bytes], bytes]) -> None:
            old_root = old_cp.root_hash if old_cp else built[1]
            verify_consistency(old_size, new_cp.tree_size, built[0], old_root,
                               new_cp.root_hash)

        proof, built_old_root = _verified(
            build, check, _ProofMemo(memo, rows.hashes, new_cp.tree_size), scope,
            f"consistency proof {old_size} -> {new_cp.tree_size}")
        TILE_PATHS.learn_consistency(scope, new_cp, old_size, proof,
                                     old_cp.root_hash if old_cp else built_old_root)
    return _consistency_json(old_size, proof, old_cp, new_cp)


def _consistency_json(old_size: int, proof: list[bytes], old_cp: StoredCheckpoint | None,
                      new_cp: StoredCheckpoint) -> dict[str, Any]:
    return {
        "from": old_size,
        "to": new_cp.tree_size,
        "proof": [_b64(h) for h in proof],
        "old_root_hash": _b64(old_cp.root_hash) if old_cp else None,
        "new_root_hash": _b64(new_cp.root_hash),
        "old_checkpoint": old_cp.note.decode() if old_cp else None,
        "new_checkpoint": new_cp.note.decode(),
    }


#: (in-tile level j, where level j starts in a tile's 511 hashes laid flat: its 256
#: leaves, then :func:`tile_nodes`), for j = 0..7: node k of level j is at base + k.
_SIBLINGS = tuple((j, TILE_WIDTH + tile_node_offset(j, 0) // HASH_SIZE if j else 0)
                  for j in range(TILE_HEIGHT))


class _UpperTilesKept:
    """A tile reader that keeps the tiles above level 0 it read (with their nodes) for
    the rest of an export: the path above every level-0 tile reads from them, a
    different hash each time (one query per level-0 tile otherwise). There are few: one
    per 65,536 entries, 16 KiB each; at most ``capacity`` are kept."""

    def __init__(self, reader: PgTileReader, capacity: int = 4096) -> None:
        self.reader = reader
        self.capacity = capacity
        self._kept: dict[Tile, tuple[bytes, bytes | None]] = {}

    def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
        return [data for data, _ in self.read_tiles_and_nodes(tiles)]

    def read_tiles_and_nodes(self, tiles: Sequence[Tile]) -> list[tuple[bytes, bytes | None]]:
        want = [t for t in tiles if t.level == 0 or t not in self._kept]
        got = dict(zip(want, self.reader.read_tiles_and_nodes(want), strict=True))
        if len(self._kept) < self.capacity:
            self._kept.update((t, v) for t, v in got.items() if t.level > 0)
        return [got[t] if t in got else self._kept[t] for t in tiles]


class BundleProofs:
    """Inclusion proofs of many entries against one signed checkpoint, for an export:
    each as the end of its bundle record, ``,"inclusion_proof":[...]}``
    (:func:`~ledger.core.bundle.record_suffix` of the JSON array of base64 hashes).

    Entries come in index order, so the work is per level-0 tile, not per entry: each
    tile is read once (a few at a time, with its stored subtree hashes), the path above
    it is built and verified against the signed root once (and kept for the export's
    later kinds, which go through the tiles again: only a tile of the same hash reuses
    it), and each entry's 8 hashes inside the tile are checked up to the tile's hash
    (8 SHA-256 calls). Where most of a
    tile is exported (the previous tile gave ``DENSE`` entries or more), the tile's
    subtree hashes are recomputed from its leaves instead (255 SHA-256 calls per tile,
    about one per entry) and the per-entry check is not needed. Entries of the rightmost
    partial tile are proved one by one and verified whole. Any failure is a
    :class:`StoredTreeMismatch`: nothing unverified goes into a bundle."""

    DENSE = 32
    PREFETCH = 32
    PROVED = 1 << 14   # tiles whose path above is kept for later passes (~0.7 KiB each)

    def __init__(self, cur: Any, cp: StoredCheckpoint) -> None:
        cp = signed_checkpoint(cp)
        self.size, self.root = cp.tree_size, cp.root_hash
        self.reader = _UpperTilesKept(PgTileReader(cur))
        self.memo: dict[tuple[int, int], bytes] = {}  # this export's subtree hashes
        self._full = self.size >> TILE_HEIGHT  # level-0 tiles that are full
        self._ahead: dict[int, tuple[bytes, bytes | None]] = {}
        self._tile: int | None = None   # no index is in tile None (-1 is: -256..-1)
        self._used = 0
        self._dense = False
        self._all = b""
        self._paths: list[bytes | None] = []
        # tile -> (its hash, the JSON of the verified path above it): an export's kinds
        # are written one after the other, each in index order, so the tiles are entered
        # once per kind; the path above is built and verified once
        self._proved: dict[int, tuple[bytes, bytes]] = {}
        # record_suffix around a proof's JSON, split where a record's own two pieces go
        # (its sibling, then the tail of the node above it: see _path)
        self._open, self._close = record_suffix(b"\0").split(b"\0")

    def record_suffix(self, index: int) -> bytes:
        """``,"inclusion_proof":["<b64>",...]}``: PATH(index, D[0:size]), verified, as
        :func:`~ledger.core.bundle.record_suffix` frames it."""
        tile = index >> TILE_HEIGHT
        if tile != self._tile:   # (an index of the current tile is in the tree)
            if not 0 <= index < self.size:
                raise TreeRangeError(
                    f"log index {index} is not in the tree of size {self.size}")
            if tile >= self._full:
                return record_suffix(self._one(index))
            self._enter(tile)
        self._used += 1
        pos = index & (TILE_WIDTH - 1)
        if not self._dense:
            self._check_inside(pos)
        up = TILE_WIDTH + (pos >> 1)   # the level-1 node above it, flat (see _path)
        at = (pos ^ 1) * HASH_SIZE     # its sibling
        return b'%s["%s","%s%s' % (self._open, b2a_base64(self._all[at:at + HASH_SIZE],
                                                          newline=False),
                                   self._paths[up] or self._path(1, pos >> 1), self._close)

    def _path(self, j: int, k: int) -> bytes:
        """The JSON tail of the proof of node ``k`` at in-tile level ``j`` >= 1:
        ``<b64 sibling>",...,"<b64>"]``, its sibling at every in-tile level from j on,
        then the hashes above the tile. The node above it has the tail after its own
        sibling, so a tail is kept per node (by its place in the tile's 511 hashes laid
        flat, :data:`_SIBLINGS`): a tile's entries share them (about one concatenation an
        entry besides its own)."""
        paths, chain = self._paths, []
        rest: bytes | None = None
        for _j, base in _SIBLINGS[j:]:
            known = paths[base + k]
            if known is not None:
                rest = known
                break
            chain.append((base, k))
            k >>= 1
        for base, k in reversed(chain):
            sibling = b2a_base64(self._flat(base + (k ^ 1)), newline=False)
            rest = paths[base + k] = sibling + (self._above if rest is None
                                                else b'","' + rest)
        assert rest is not None
        return rest

    def _enter(self, tile: int) -> None:
        """Make ``tile`` the current one: read (and kept as :meth:`record_suffix` assumes)
        only once every check passed."""
        self._tile = None
        dense = self._used >= self.DENSE
        if tile not in self._ahead:
            want = [Tile(0, t) for t in range(tile, min(tile + self.PREFETCH, self._full))]
            self._ahead = dict(zip((t.index for t in want),
                                   self.reader.read_tiles_and_nodes(want), strict=True))
        data, nodes = self._ahead.pop(tile)
        if dense or nodes is None:
            nodes = tile_nodes(data)  # derived from the leaves: checked by construction
        self._all = data + nodes  # the 511 hashes: leaves, then tile_nodes' order
        self._paths = [None] * (2 * TILE_WIDTH - 1)  # by flat index: see _path
        self._hash = nodes[-HASH_SIZE:]
        proved = self._proved.get(tile)
        if proved is not None and proved[0] == self._hash:
            self._above = proved[1]   # the path above this tile hash, verified before
        else:
            above = subtree_path_from_tiles(TILE_HEIGHT, tile, self.size, self.reader,
                                            self.memo)
            try:
                verify_inclusion(self._hash, tile, -(-self.size >> TILE_HEIGHT), above,
                                 self.root)
            except ProofError:
                raise StoredTreeMismatch(
                    f"the stored tree above entries {tile << TILE_HEIGHT}.."
                    f"{(tile << TILE_HEIGHT) + TILE_WIDTH - 1} does not verify against the "
                    "signed checkpoint; run `ledger audit`") from None
            self._above = b"".join(b'","' + b2a_base64(h, newline=False)
                                   for h in above) + b'"]'
            if len(self._proved) < self.PROVED:
                self._proved[tile] = (self._hash, self._above)
        self._dense, self._used, self._tile = dense, 0, tile

    def _flat(self, at: int) -> bytes:
        return self._all[at * HASH_SIZE : (at + 1) * HASH_SIZE]

    def _check_inside(self, pos: int) -> None:
        h = self._flat(pos)
        for j, base in _SIBLINGS:
            sibling = self._flat(base + ((pos >> j) ^ 1))
            h = node_hash(sibling, h) if (pos >> j) & 1 else node_hash(h, sibling)
        if h != self._hash:
            assert self._tile is not None, "checked inside the current tile"
            first = self._tile << TILE_HEIGHT
            raise StoredTreeMismatch(
                f"the stored subtree hashes of entries {first}..{first + TILE_WIDTH - 1} do "
                "not hash to their tile; run `ledger audit`")

    def _one(self, index: int) -> bytes:
        """The JSON array of entry ``index``'s proof, built and verified whole."""
        tile = Tile(0, index >> TILE_HEIGHT, tile_width(0, index >> TILE_HEIGHT, self.size))
        data = self.reader.read_tiles([tile])[0]
        pos = index & (TILE_WIDTH - 1)
        leaf = data[pos * HASH_SIZE : (pos + 1) * HASH_SIZE]
        proof = inclusion_proof_from_tiles(index, self.size, self.reader, self.memo)
        try:
            verify_inclusion(leaf, index, self.size, proof, self.root)
        except ProofError:
            raise StoredTreeMismatch(
                f"the inclusion proof of entry {index} built from the stored tree does not "
                "verify against the signed checkpoint; run `ledger audit`") from None
        return b'["' + b'","'.join(base64.b64encode(h) for h in proof) + b'"]' if proof \
            else b"[]"
