"""Postgres access for the log: tiles, entries, checkpoints (psycopg cursors, no ORM on
the hot paths)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.core.errors import TileNotFoundError
from ledger.core.merkle import HASH_SIZE
from ledger.core.tiles import Tile


class PgTileReader:
    """A :class:`ledger.core.tiles.TileReader` over the ``tiles`` table."""

    def __init__(self, cursor: Any) -> None:
        self.cur = cursor

    def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
        if not tiles:
            return []
        levels = [t.level for t in tiles]
        idxs = [t.index for t in tiles]
        self.cur.execute(
            "SELECT t.level, t.idx, t.data FROM tiles t "
            "JOIN unnest(%s::smallint[], %s::bigint[]) AS want(level, idx) "
            "ON t.level = want.level AND t.idx = want.idx", (levels, idxs))
        found = {(r[0], r[1]): bytes(r[2]) for r in self.cur.fetchall()}
        out = []
        for t in tiles:
            data = found.get((t.level, t.index), b"")
            need = t.width * HASH_SIZE
            if len(data) < need:
                raise TileNotFoundError(f"tile {t.path} is not stored")
            out.append(data[:need])
        return out


def write_tiles(cursor: Any, tiles: Mapping[Tile, bytes]) -> None:
    """Upsert tiles; a stored tile only ever grows (a narrower write never shrinks it)."""
    if not tiles:
        return
    rows = [(t.level, t.index, data) for t, data in tiles.items()]
    cursor.executemany(
        "INSERT INTO tiles (level, idx, data) VALUES (%s, %s, %s) "
        "ON CONFLICT (level, idx) DO UPDATE SET data = EXCLUDED.data "
        "WHERE octet_length(EXCLUDED.data) > octet_length(tiles.data)", rows)


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    tree_size: int
    root_hash: bytes
    note: bytes


def latest_checkpoint(cursor: Any) -> StoredCheckpoint | None:
    cursor.execute("SELECT tree_size, root_hash, note FROM checkpoints "
                   "ORDER BY tree_size DESC LIMIT 1")
    row = cursor.fetchone()
    return StoredCheckpoint(row[0], bytes(row[1]), bytes(row[2])) if row else None


def checkpoint_at(cursor: Any, size: int) -> StoredCheckpoint | None:
    cursor.execute("SELECT tree_size, root_hash, note FROM checkpoints WHERE tree_size = %s",
                   (size,))
    row = cursor.fetchone()
    return StoredCheckpoint(row[0], bytes(row[1]), bytes(row[2])) if row else None


def entries(cursor: Any, start: int, stop: int) -> list[bytes]:
    cursor.execute("SELECT idx, entry FROM log_entries WHERE idx >= %s AND idx < %s "
                   "ORDER BY idx", (start, stop))
    rows = cursor.fetchall()
    if len(rows) != stop - start or (rows and (rows[0][0] != start or rows[-1][0] != stop - 1)):
        raise TileNotFoundError(f"entries {start}..{stop - 1} are not all stored")
    return [bytes(r[1]) for r in rows]
