"""Postgres access for the log: tiles, entries, checkpoints (psycopg cursors, no ORM on
the hot paths)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.core.errors import TileNotFoundError
from ledger.core.merkle import HASH_SIZE
from ledger.core.tiles import FULL_TILE_BYTES, Tile


class FullTileCache:
    """Process-wide LRU of *full* tiles. A full tile never changes once written (the log
    only appends), so caching it can never serve stale data; partial tiles are not cached."""

    def __init__(self, capacity: int = 2048) -> None:  # 2,048 x 8 KiB = 16 MiB
        self.capacity = capacity
        self._data: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int, int]) -> bytes | None:
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self._data.move_to_end(key)
            return data

    def put(self, key: tuple[str, int, int], data: bytes) -> None:
        if len(data) != FULL_TILE_BYTES:
            return
        with self._lock:
            self._data[key] = data
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)


FULL_TILES = FullTileCache()


class PgTileReader:
    """A :class:`ledger.core.tiles.TileReader` over the ``tiles`` table (one query for
    whatever the process-wide full-tile cache does not hold)."""

    def __init__(self, cursor: Any, cache: FullTileCache | None = FULL_TILES) -> None:
        self.cur = cursor
        self.cache = cache
        info = cursor.connection.info
        self.scope = f"{info.host}:{info.port}/{info.dbname}"  # one cache, many databases

    def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
        if not tiles:
            return []
        found: dict[tuple[int, int], bytes] = {}
        want = []
        for t in tiles:
            cached = self.cache.get((self.scope, t.level, t.index)) if self.cache else None
            if cached is not None:
                found[(t.level, t.index)] = cached
            else:
                want.append(t)
        if want:
            self.cur.execute(
                "SELECT t.level, t.idx, t.data FROM tiles t "
                "JOIN unnest(%s::smallint[], %s::bigint[]) AS want(level, idx) "
                "ON t.level = want.level AND t.idx = want.idx",
                ([t.level for t in want], [t.index for t in want]))
            for level, idx, data in self.cur.fetchall():
                found[(level, idx)] = bytes(data)
                if self.cache:
                    self.cache.put((self.scope, level, idx), found[(level, idx)])
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
