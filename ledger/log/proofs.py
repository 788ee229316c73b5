"""Inclusion and consistency proofs served from stored tiles, against stored checkpoints.

A proof is built from stored hashes (tiles, the subtree hashes of full tiles, a
process-wide cache of subtree hashes: :mod:`ledger.log.store`), none of which is signed.
So before a proof is served it is verified against the root of the signed checkpoint it
is served with, the (size, root) taken from the note's signed text, not from the
``checkpoints`` columns: a changed hash anywhere below gives :class:`StoredTreeMismatch`
(after one retry with the cache dropped), never a wrong proof. Verifying costs about 20
SHA-256 calls; building the proof from the cache and one tile read costs a few more.
"""

from __future__ import annotations

import base64
from binascii import b2a_base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from ledger.core.errors import LedgerError, ProofError, TreeRangeError
from ledger.core.merkle import HASH_SIZE, node_hash, verify_consistency, verify_inclusion
from ledger.core.merkle import leaf_hash as compute_leaf_hash
from ledger.core.note import decode_note, parse_checkpoint
from ledger.core.tiles import (
    TILE_HEIGHT,
    TILE_WIDTH,
    Tile,
    consistency_proof_and_old_root_from_tiles,
    inclusion_proof_from_tiles,
    subtree_path_from_tiles,
    tile_node_offset,
    tile_nodes,
    tile_width,
)
from ledger.db.session import raw_cursor
from ledger.errors import NotFound, StoredTreeMismatch
from ledger.log.store import (
    SUBTREES,
    PgTileReader,
    StoredCheckpoint,
    checkpoint_and_entry,
    checkpoint_at,
    checkpoints_for_consistency,
    database_scope,
    latest_checkpoint,
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


_SIGNED: dict[bytes, StoredCheckpoint] = {}


def signed_checkpoint(cp: StoredCheckpoint) -> StoredCheckpoint:
    """``cp`` with size and root read from its note's text (what its signature covers);
    :class:`StoredTreeMismatch` when the columns say otherwise. The signature itself is
    the reader's to check, against keys it trusts (the note is served as it is)."""
    known = _SIGNED.get(cp.note)
    if known is None:
        try:
            text = decode_note(cp.note)
            split = text.rfind("\n\n")
            parsed = parse_checkpoint(text[: split + 1] if split >= 0 else text)
        except LedgerError as exc:
            raise StoredTreeMismatch(f"the stored checkpoint of size {cp.tree_size} does "
                                     f"not parse: {exc.message}") from None
        known = StoredCheckpoint(parsed.size, parsed.root_hash, cp.note)
        if len(_SIGNED) > 64:
            _SIGNED.clear()
        _SIGNED[cp.note] = known
    if (known.tree_size, known.root_hash) != (cp.tree_size, cp.root_hash):
        raise StoredTreeMismatch(f"the stored checkpoint of size {cp.tree_size}: its "
                                 "columns differ from its signed note")
    return known


def checkpoint_for(cur: Any, tree_size: int | None) -> StoredCheckpoint:
    cp = latest_checkpoint(cur) if tree_size is None else checkpoint_at(cur, tree_size)
    return signed_checkpoint(_found(cp, tree_size))


def _found(cp: StoredCheckpoint | None, tree_size: int | None) -> StoredCheckpoint:
    if cp is None:
        if tree_size is None:
            raise NotYetIntegrated("the log has no checkpoint yet")
        raise NotFound(f"no checkpoint of tree size {tree_size}", code="no_such_checkpoint")
    return cp


def _verified(build: Callable[[dict[tuple[int, int], bytes] | None], T],
              check: Callable[[T], None], cur: Any, what: str) -> T:
    """``build(memo)`` a proof, ``check`` it; on failure once more without the cache
    (which may hold a hash read before a repair), then refuse."""
    scope = database_scope(cur)
    proof = build(SUBTREES.for_scope(scope))
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


def inclusion(session: Session, log_index: int, tree_size: int | None = None) -> InclusionReceipt:
    with raw_cursor(session) as cur:
        stored, entry = checkpoint_and_entry(cur, tree_size, log_index)
        cp = signed_checkpoint(_found(stored, tree_size))
        if log_index >= cp.tree_size:
            raise NotYetIntegrated(
                f"log index {log_index} is not in the latest checkpoint (size {cp.tree_size}) "
                "yet; retry shortly")
        if entry is None:
            raise NotFound(f"no log entry {log_index}")
        leaf = compute_leaf_hash(entry)
        reader = PgTileReader(cur)
        proof = _verified(
            lambda memo: inclusion_proof_from_tiles(log_index, cp.tree_size, reader, memo),
            lambda p: verify_inclusion(leaf, log_index, cp.tree_size, p, cp.root_hash),
            cur, f"inclusion proof of entry {log_index}")
    return InclusionReceipt(log_index, cp.tree_size, entry, leaf, proof, cp)


def consistency(session: Session, old_size: int, new_size: int | None) -> dict[str, Any]:
    with raw_cursor(session) as cur:
        new_stored, old_stored = checkpoints_for_consistency(cur, new_size, old_size)
        new_cp = signed_checkpoint(_found(new_stored, new_size))
        if old_size > new_cp.tree_size:
            raise TreeRangeError(f"from={old_size} is larger than to={new_cp.tree_size}")
        old_cp = signed_checkpoint(old_stored) if old_stored and old_size else None
        reader = PgTileReader(cur)

        def build(memo: dict[tuple[int, int], bytes] | None) -> tuple[list[bytes], bytes]:
            # Without a checkpoint at old_size the old root comes from the same stored
            # tree; the proof must still lead to the signed new root, which (unless
            # SHA-256 collides) only the true hashes do.
            return consistency_proof_and_old_root_from_tiles(old_size, new_cp.tree_size,
                                                             reader, memo)

        def check(built: tuple[list[bytes], bytes]) -> None:
            old_root = old_cp.root_hash if old_cp else built[1]
            verify_consistency(old_size, new_cp.tree_size, built[0], old_root,
                               new_cp.root_hash)

        proof, _ = _verified(build, check, cur,
                             f"consistency proof {old_size} -> {new_cp.tree_size}")
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


class BundleProofs:
    """Inclusion proofs of many entries against one signed checkpoint, for an export:
    JSON arrays of base64 hashes, as bundle records carry them.

    Entries come in index order, so the work is per level-0 tile, not per entry: each
    tile is read once (a few at a time, with its stored subtree hashes), the path above
    it is built and verified against the signed root once, and each entry's 8 hashes
    inside the tile are checked up to the tile's hash (8 SHA-256 calls). Where most of a
    tile is exported (the previous tile gave ``DENSE`` entries or more), the tile's
    subtree hashes are recomputed from its leaves instead (255 SHA-256 calls per tile,
    about one per entry) and the per-entry check is not needed. Entries of the rightmost
    partial tile are proved one by one and verified whole. Any failure is a
    :class:`StoredTreeMismatch`: nothing unverified goes into a bundle."""

    DENSE = 32
    PREFETCH = 8

    def __init__(self, cur: Any, cp: StoredCheckpoint) -> None:
        cp = signed_checkpoint(cp)
        self.size, self.root = cp.tree_size, cp.root_hash
        self.reader = PgTileReader(cur)
        self.memo: dict[tuple[int, int], bytes] = {}  # this export's subtree hashes
        self._full = self.size >> TILE_HEIGHT  # level-0 tiles that are full
        self._ahead: dict[int, tuple[bytes, bytes | None]] = {}
        self._tile = -1
        self._used = 0
        self._dense = False

    def proof_json(self, index: int) -> bytes:
        """``["<b64>", ...]`` of PATH(index, D[0:size]), verified."""
        if not 0 <= index < self.size:
            raise TreeRangeError(f"log index {index} is not in the tree of size {self.size}")
        tile = index >> TILE_HEIGHT
        if tile >= self._full:
            return self._one(index)
        if tile != self._tile:
            self._enter(tile)
        self._used += 1
        pos = index & (TILE_WIDTH - 1)
        enc = self._enc
        parts = []
        for j, base in _SIBLINGS:  # the sibling at in-tile level j, in the flat layout
            at = base + ((pos >> j) ^ 1)
            found = enc[at]
            if found is None:
                found = enc[at] = b2a_base64(self._flat(at), newline=False)
            parts.append(found)
        if not self._dense:
            self._check_inside(pos)
        return b'["' + b'","'.join(parts) + self._above

    def _enter(self, tile: int) -> None:
        self._dense = self._used >= self.DENSE
        self._used = 0
        self._tile = tile
        if tile not in self._ahead:
            want = [Tile(0, t) for t in range(tile, min(tile + self.PREFETCH, self._full))]
            self._ahead = dict(zip((t.index for t in want),
                                   self.reader.read_tiles_and_nodes(want), strict=True))
        data, nodes = self._ahead.pop(tile)
        if self._dense or nodes is None:
            nodes = tile_nodes(data)  # derived from the leaves: checked by construction
        self._all = data + nodes  # the 511 hashes: leaves, then tile_nodes' order
        self._enc: list[bytes | None] = [None] * (2 * TILE_WIDTH - 1)
        self._hash = nodes[-HASH_SIZE:]
        above = subtree_path_from_tiles(TILE_HEIGHT, tile, self.size, self.reader, self.memo)
        try:
            verify_inclusion(self._hash, tile, -(-self.size >> TILE_HEIGHT), above, self.root)
        except ProofError:
            raise StoredTreeMismatch(
                f"the stored tree above entries {tile << TILE_HEIGHT}.."
                f"{(tile << TILE_HEIGHT) + TILE_WIDTH - 1} does not verify against the "
                "signed checkpoint; run `ledger audit`") from None
        self._above = b"".join(b'","' + b2a_base64(h, newline=False) for h in above) + b'"]'

    def _flat(self, at: int) -> bytes:
        return self._all[at * HASH_SIZE : (at + 1) * HASH_SIZE]

    def _check_inside(self, pos: int) -> None:
        h = self._flat(pos)
        for j, base in _SIBLINGS:
            sibling = self._flat(base + ((pos >> j) ^ 1))
            h = node_hash(sibling, h) if (pos >> j) & 1 else node_hash(h, sibling)
        if h != self._hash:
            first = self._tile << TILE_HEIGHT
            raise StoredTreeMismatch(
                f"the stored subtree hashes of entries {first}..{first + TILE_WIDTH - 1} do "
                "not hash to their tile; run `ledger audit`")

    def _one(self, index: int) -> bytes:
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
