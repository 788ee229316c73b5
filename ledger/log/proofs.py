"""Inclusion and consistency proofs served from stored tiles, against stored checkpoints."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from ledger.core.errors import TreeRangeError
from ledger.core.merkle import leaf_hash as compute_leaf_hash
from ledger.core.tiles import consistency_proof_from_tiles, inclusion_proof_from_tiles
from ledger.db.session import raw_cursor
from ledger.errors import NotFound
from ledger.log.store import (
    PgTileReader,
    StoredCheckpoint,
    checkpoint_at,
    entry_at,
    latest_checkpoint,
)


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


def checkpoint_for(cur: Any, tree_size: int | None) -> StoredCheckpoint:
    cp = latest_checkpoint(cur) if tree_size is None else checkpoint_at(cur, tree_size)
    if cp is None:
        if tree_size is None:
            raise NotYetIntegrated("the log has no checkpoint yet")
        raise NotFound(f"no checkpoint of tree size {tree_size}", code="no_such_checkpoint")
    return cp


def inclusion(session: Session, log_index: int, tree_size: int | None = None) -> InclusionReceipt:
    with raw_cursor(session) as cur:
        cp = checkpoint_for(cur, tree_size)
        if log_index >= cp.tree_size:
            raise NotYetIntegrated(
                f"log index {log_index} is not in the latest checkpoint (size {cp.tree_size}) "
                "yet; retry shortly")
        entry = entry_at(cur, log_index)
        if entry is None:
            raise NotFound(f"no log entry {log_index}")
        proof = inclusion_proof_from_tiles(log_index, cp.tree_size, PgTileReader(cur))
    return InclusionReceipt(log_index, cp.tree_size, entry, compute_leaf_hash(entry), proof, cp)


def consistency(session: Session, old_size: int, new_size: int | None) -> dict[str, Any]:
    with raw_cursor(session) as cur:
        new_cp = checkpoint_for(cur, new_size)
        if old_size > new_cp.tree_size:
            raise TreeRangeError(f"from={old_size} is larger than to={new_cp.tree_size}")
        old_cp = checkpoint_at(cur, old_size) if old_size else None
        proof = consistency_proof_from_tiles(old_size, new_cp.tree_size, PgTileReader(cur))
    return {
        "from": old_size,
        "to": new_cp.tree_size,
        "proof": [_b64(h) for h in proof],
        "old_root_hash": _b64(old_cp.root_hash) if old_cp else None,
        "new_root_hash": _b64(new_cp.root_hash),
        "old_checkpoint": old_cp.note.decode() if old_cp else None,
        "new_checkpoint": new_cp.note.decode(),
    }
