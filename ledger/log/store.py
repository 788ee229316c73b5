"""Postgres access for the log: every SQL statement over the log tables (``log_state``,
``log_entries``, ``log_tree``, ``tiles``, ``tile_nodes``, ``checkpoints``) is here, over
psycopg cursors (:func:`ledger.db.session.raw_cursor`; no ORM on the hot paths). The sequencer, the
integrator, the proofs and the tlog-tiles routes call these; ``ledger.log.audit`` still
reads the tables itself (its streaming pass is being tuned separately)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from ledger.core.errors import TileNotFoundError
from ledger.core.merkle import HASH_SIZE
from ledger.core.tiles import (
    FULL_TILE_BYTES,
    TILE_NODES_BYTES,
    NodeSlice,
    Tile,
    hash_from_slice,
    tile_nodes,
)
from ledger.db.arrays import ByteaArray, TextArray

#: A full tile laid flat: its 256 hashes, then the 255 above them (``tile_nodes``' order).
FLAT_TILE_BYTES = FULL_TILE_BYTES + TILE_NODES_BYTES


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


class SubtreeCache:
    """Process-wide hashes of full subtrees, keyed by (tree level, index) per database,
    and the full tiles proofs read, whole (:data:`FLAT_TILE_BYTES`: the 256 hashes, then
    the 255 of :func:`~ledger.core.tiles.tile_nodes`), keyed by (level, index).

    A full subtree's hash never changes once its leaves exist, whatever the tree size, and
    neither does a full tile, so the hashes near the top of the tree, which every proof
    needs, are computed or read once, and a tile a proof read serves the next proofs
    inside it. What is cached came from the database: the proofs built from it are
    verified against the signed root before they are served, and a failure clears the
    database's entries (:meth:`forget`). Bounded: when full, a database's hashes are
    dropped; tiles go least recently used first (``tiles`` of them, ~16 KiB each)."""

    def __init__(self, capacity: int = 200_000, tiles: int = 4096) -> None:
        # ~30 MiB of dict at capacity, and 4,096 tiles (64 MiB): the full tiles of
        # 1,048,576 entries
        self.capacity = capacity
        self.tile_capacity = tiles
        self._scopes: dict[str, dict[tuple[int, int], bytes]] = {}
        self._tiles: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def for_scope(self, scope: str) -> dict[tuple[int, int], bytes]:
        with self._lock:
            memo = self._scopes.get(scope)
            if memo is None or len(memo) > self.capacity:
                memo = self._scopes[scope] = {}
            return memo

    def tile(self, scope: str, level: int, index: int) -> bytes | None:
        """The full tile (``level``, ``index``) laid flat, if kept."""
        key = (scope, level, index)
        with self._lock:
            flat = self._tiles.get(key)
            if flat is not None:
                self._tiles.move_to_end(key)
            return flat

    def keep_tile(self, scope: str, level: int, index: int, flat: bytes) -> None:
        assert len(flat) == FLAT_TILE_BYTES, "only full tiles, with their nodes"
        with self._lock:
            self._tiles[(scope, level, index)] = flat
            self._tiles.move_to_end((scope, level, index))
            while len(self._tiles) > self.tile_capacity:
                self._tiles.popitem(last=False)

    def forget(self, scope: str) -> None:
        with self._lock:
            self._scopes.pop(scope, None)
            for key in [k for k in self._tiles if k[0] == scope]:
                del self._tiles[key]

    def forget_all(self) -> None:
        with self._lock:
            self._scopes.clear()
            self._tiles.clear()


SUBTREES = SubtreeCache()


def database_scope(cursor: Any) -> str:
    """Which database a cursor talks to: one process-wide cache, many databases."""
    info = cursor.connection.info
    return f"{info.host}:{info.port}/{info.dbname}"


class PgTileReader:
    """A :class:`ledger.core.tiles.TileNodeReader` over the ``tiles`` and ``tile_nodes``
    tables (one query for whatever the process-wide full-tile cache does not hold)."""

    def __init__(self, cursor: Any, cache: FullTileCache | None = FULL_TILES,
                 scope: str | None = None) -> None:
        self.cur = cursor
        self.cache = cache
        self.scope = database_scope(cursor) if scope is None else scope

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
                _int_arrays(want))
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

    def read_tiles_and_nodes(self, tiles: Sequence[Tile]) -> list[tuple[bytes, bytes | None]]:
        """Tiles with the stored nodes of the full ones, in one query (not cached: the
        subtree cache keeps what a proof needs of them)."""
        if not tiles:
            return []
        with self.cur.connection.cursor(binary=True) as bcur:  # 16 KiB a tile, not hex
            bcur.execute(
                "SELECT want.level, want.idx, t.data, n.nodes "
                "FROM unnest(%s::text::smallint[], %s::text::bigint[]) AS want(level, idx) "
                "JOIN tiles t ON t.level = want.level AND t.idx = want.idx "
                "LEFT JOIN tile_nodes n ON n.level = want.level AND n.idx = want.idx",
                _int_arrays(tiles))
            found = {(level, idx): (bytes(data), bytes(nodes) if nodes is not None else None)
                     for level, idx, data, nodes in bcur.fetchall()}
        out: list[tuple[bytes, bytes | None]] = []
        for t in tiles:
            data, nodes = found.get((t.level, t.index), (b"", None))
            need = t.width * HASH_SIZE
            if len(data) < need:
                raise TileNotFoundError(f"tile {t.path} is not stored")
            full = need == FULL_TILE_BYTES
            out.append((data[:need], nodes if full and nodes is not None
                        and len(nodes) == TILE_NODES_BYTES else None))
        return out


@dataclass(frozen=True, slots=True)
class ProofRows:
    """What one :func:`read_for_proof` round trip found."""

    checkpoints: list[StoredCheckpoint]
    entry: bytes | None
    hashes: dict[tuple[int, int], bytes]
    """The subtree hashes of the slices that were found whole, by (tree level, index)."""


def read_for_proof(cursor: Any, sizes: Sequence[int | None], index: int | None,
                   slices: Sequence[NodeSlice], cache: SubtreeCache | None = None,
                   scope: str | None = None) -> ProofRows:
    """In one round trip: the checkpoints of ``sizes`` (None: the latest), log entry
    ``index`` (when not None) and the hashes ``slices`` name. A slice of a full tile
    comes from the tile kept in ``cache``, or the tile is read whole (its data and
    stored nodes, each one TOAST fetch: cheaper than a ``substring()`` per slice, which
    fetches each slice on its own) and kept; a slice of a partial tile is read as just
    its bytes. A slice not found (a tile or its nodes not stored) is left out; the
    caller reads it the usual way. ``cursor`` should be binary (bytes as they are, not
    hex); ``scope`` is :func:`database_scope` of it (computed when not given)."""
    if scope is None:
        scope = database_scope(cursor)
    hashes: dict[tuple[int, int], bytes] = {}
    by_tile: dict[Tile, tuple[list[NodeSlice], list[NodeSlice]]] = {}
    whole: dict[Tile, list[NodeSlice]] = {}
    for piece in slices:
        tile = piece.tile
        if tile.is_partial:
            by_tile.setdefault(tile, ([], []))[piece.in_nodes].append(piece)
            continue
        flat = cache.tile(scope, tile.level, tile.index) if cache is not None else None
        if flat is None:
            whole.setdefault(tile, []).append(piece)
        else:
            hashes[piece.node] = _from_flat(piece, flat)
    shape = (tuple(size is None for size in sizes), index is not None,
             tuple((tuple(p.length for p in data), tuple(p.length for p in nodes))
                   for data, nodes in by_tile.values()), len(whole))
    params: list[Any] = [size for size in sizes if size is not None]
    if index is not None:
        params.append(index)
    for tile, (data, nodes) in by_tile.items():
        params += [p.offset + 1 for p in data]
        params += [p.offset + 1 for p in nodes]
        params += [tile.level, tile.index]
    for tile in whole:
        params += [tile.level, tile.index]
    cursor.execute(_proof_sql(shape), params)
    checkpoints: list[StoredCheckpoint] = []
    entry = None
    found: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = {}
    read_whole: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = {}
    for part, a, b, x, y in cursor.fetchall():
        if part == 0:
            checkpoints.append(StoredCheckpoint(a, x, y))
        elif part == 1:
            entry = x
        else:
            (found if part == 2 else read_whole)[(a, b)] = (x, y)
    for tile, groups in by_tile.items():
        got = found.get((tile.level, tile.index))
        if got is None:
            continue
        for blob, group in zip(got, groups, strict=True):
            if blob is None or len(blob) != sum(p.length for p in group):
                continue  # nodes not stored, or a tile narrower than wanted
            at = 0
            for piece in group:
                hashes[piece.node] = hash_from_slice(piece, blob[at : at + piece.length])
                at += piece.length
    for tile, pieces in whole.items():
        leaves, above = read_whole.get((tile.level, tile.index), (None, None))
        if leaves is None or len(leaves) != FULL_TILE_BYTES:
            continue  # not stored (whole)
        if above is None or len(above) != TILE_NODES_BYTES:
            above = tile_nodes(leaves)  # nodes not stored: from the leaves
        flat = leaves + above
        if cache is not None:
            cache.keep_tile(scope, tile.level, tile.index, flat)
        for piece in pieces:
            hashes[piece.node] = _from_flat(piece, flat)
    return ProofRows(checkpoints, entry, hashes)


def _from_flat(piece: NodeSlice, flat: bytes) -> bytes:
    at = piece.offset + (FULL_TILE_BYTES if piece.in_nodes else 0)
    return hash_from_slice(piece, flat[at : at + piece.length])


_ProofShape = tuple[tuple[bool, ...], bool,
                    tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], int]


@lru_cache(maxsize=256)
def _proof_sql(shape: _ProofShape) -> str:
    """The statement :func:`read_for_proof` sends for one shape (which checkpoints, an
    entry or not, how many slices of which lengths in each partial tile, how many whole
    tiles): the same few texts over and over, so psycopg prepares them; the values
    (sizes, index, offsets, tile coordinates) are parameters, the lengths (a run of
    hashes of a partial tile, or 32 bytes) numbers of ours."""
    latest, with_entry, tiles, whole = shape
    conds = ["tree_size = (SELECT max(tree_size) FROM checkpoints)" if is_latest
             else "tree_size = %s" for is_latest in latest]
    parts = ["SELECT 0, tree_size, NULL::bigint, root_hash, note FROM checkpoints "  # noqa: S608
             f"WHERE {' OR '.join(conds)}"]
    if with_entry:
        parts.append("SELECT 1, idx, NULL::bigint, entry, NULL::bytea FROM log_entries "
                     "WHERE idx = %s")
    for data, nodes in tiles:
        cols = [" || ".join(f"substring({source} from %s::int for {int(length)})"
                            for length in lengths) or "NULL::bytea"
                for source, lengths in (("t.data", data), ("n.nodes", nodes))]
        join = " LEFT JOIN tile_nodes n ON n.level = t.level AND n.idx = t.idx" if nodes else ""
        parts.append(f"SELECT 2, t.level::bigint, t.idx, {cols[0]}, {cols[1]} "  # noqa: S608
                     f"FROM tiles t{join} WHERE t.level = %s AND t.idx = %s")
    parts += ["SELECT 3, t.level::bigint, t.idx, t.data, n.nodes FROM tiles t "
              "LEFT JOIN tile_nodes n ON n.level = t.level AND n.idx = t.idx "
              "WHERE t.level = %s AND t.idx = %s"] * whole
    return " UNION ALL ".join(parts)


def _int_arrays(tiles: Sequence[Tile]) -> tuple[str, str]:
    """The tiles' levels and indices as array literals (psycopg's list adaptation
    inspects every element: a quarter of a millisecond per proof)."""
    levels = ",".join(str(t.level) for t in tiles)
    indices = ",".join(str(t.index) for t in tiles)
    return f"{{{levels}}}", f"{{{indices}}}"


def write_tiles(cursor: Any, tiles: Mapping[Tile, bytes]) -> None:
    """Upsert tiles; a stored tile only ever grows (a narrower write never shrinks it)."""
    if not tiles:
        return
    rows = [(t.level, t.index, data) for t, data in tiles.items()]
    cursor.executemany(
        "INSERT INTO tiles (level, idx, data) VALUES (%s, %s, %s) "
        "ON CONFLICT (level, idx) DO UPDATE SET data = EXCLUDED.data "
        "WHERE octet_length(EXCLUDED.data) > octet_length(tiles.data)", rows)


def write_tile_nodes(cursor: Any, nodes: Mapping[Tile, bytes]) -> None:
    """Store the nodes of tiles that became full; a full tile's nodes are never rewritten."""
    if not nodes:
        return
    cursor.executemany(
        "INSERT INTO tile_nodes (level, idx, nodes) VALUES (%s, %s, %s) "
        "ON CONFLICT (level, idx) DO NOTHING",
        [(t.level, t.index, data) for t, data in nodes.items()])


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


def checkpoint_times(cursor: Any) -> list[tuple[int, datetime]]:
    """(tree size, when it was stored) of every checkpoint, in size order."""
    cursor.execute("SELECT tree_size, created_at FROM checkpoints ORDER BY tree_size")
    return [(int(r[0]), r[1]) for r in cursor.fetchall()]


def entries(cursor: Any, start: int, stop: int) -> list[bytes]:
    cursor.execute("SELECT idx, entry FROM log_entries WHERE idx >= %s AND idx < %s "
                   "ORDER BY idx", (start, stop))
    rows = cursor.fetchall()
    if len(rows) != stop - start or (rows and (rows[0][0] != start or rows[-1][0] != stop - 1)):
        raise TileNotFoundError(f"entries {start}..{stop - 1} are not all stored")
    return [bytes(r[1]) for r in rows]


def integrated_size(cursor: Any) -> int:
    """How many entries the Merkle tree holds (``log_tree``)."""
    cursor.execute("SELECT size FROM log_tree WHERE id = 1")
    row = cursor.fetchone()
    return int(row[0]) if row else 0


def sequenced_size(cursor: Any, *, lock: bool = False) -> int:
    """How many entries were sequenced (``log_state``); ``lock`` holds the row for this
    transaction (the sequencer's lock, which :data:`SEQUENCE` also takes)."""
    cursor.execute("SELECT size FROM log_state WHERE id = 1 FOR UPDATE" if lock
                   else "SELECT size FROM log_state WHERE id = 1")
    row = cursor.fetchone()
    assert row is not None, "log_state row missing: run `ledger db upgrade`"
    return int(row[0])


class SequenceRefused(Exception):
    """The sequencing statement's guard did not hold: nothing was sequenced or stored."""


#: The sequencing statement. ``seq`` moves ``log_state`` past the new entries: that UPDATE
#: takes the row lock that serialises sequencing, first among the row locks of the
#: statement (everything else reads ``seq``), and the statement's commit releases it. The
#: ``{records}`` CTEs store the records that carry the indices (``seq.start + ord - 1``) in
#: the same statement. An optional ``{guard}`` CTE (one boolean column, ``ok``) is a
#: condition read before the lock is taken: when it is false ``seq`` has no row, nothing
#: is written, and :func:`sequence` raises :class:`SequenceRefused`.
SEQUENCE = """
WITH {guard}seq AS (
  UPDATE log_state SET size = size + %(n)s::bigint WHERE id = 1{guarded}
  RETURNING size - %(n)s::bigint AS start
), sequenced AS (
  INSERT INTO log_entries (idx, kind, ref, entry, leaf_hash)
  SELECT seq.start + l.ord - 1, l.kind, l.ref, l.entry, l.leaf_hash
  FROM seq, unnest(%(kind)b::text[], %(ref)s::text[], %(entry)b::bytea[],
                   %(leaf_hash)b::bytea[]) WITH ORDINALITY AS l(kind, ref, entry, leaf_hash, ord)
){records}
SELECT start FROM seq
"""


@lru_cache(maxsize=64)
def _sequence_sql(records: str, guard: str) -> str:
    return SEQUENCE.format(records=records, guard=f"{guard}, " if guard else "",
                           guarded=" AND (SELECT ok FROM guard)" if guard else "")


def sequence(cursor: Any, rows: Sequence[tuple[str, str, bytes, bytes]], records: str = "",
             params: Mapping[str, Any] | None = None, guard: str = "") -> int:
    """Write (kind, ref, entry, leaf hash) rows at the next free indices, in one statement
    with the ``records`` CTEs (and their ``params``), if the ``guard`` CTE (``guard AS
    (SELECT ... AS ok)``, its parameters in ``params``) holds; returns the first index."""
    assert rows, "nothing to sequence"
    cursor.execute(_sequence_sql(records, guard), {
        # kinds are ours; a ref may be any caller's text, so psycopg adapts it as before
        "n": len(rows), "kind": TextArray(r[0] for r in rows), "ref": [r[1] for r in rows],
        "entry": ByteaArray(r[2] for r in rows), "leaf_hash": ByteaArray(r[3] for r in rows),
        **(params or {})})
    row = cursor.fetchone()
    if row is None and guard:
        raise SequenceRefused
    assert row is not None, "log_state row missing: run `ledger db upgrade`"
    return int(row[0])


def entry_at(cursor: Any, index: int) -> bytes | None:
    cursor.execute("SELECT entry FROM log_entries WHERE idx = %s", (index,))
    row = cursor.fetchone()
    return bytes(row[0]) if row else None


def entries_with_leaf_hashes(cursor: Any, start: int, stop: int
                             ) -> list[tuple[int, bytes, bytes]]:
    """(index, entry, stored leaf hash) for ``start <= index < stop``, in order (gaps are
    the caller's to find)."""
    cursor.execute("SELECT idx, entry, leaf_hash FROM log_entries "
                   "WHERE idx >= %s AND idx < %s ORDER BY idx", (start, stop))
    return [(int(i), bytes(e), bytes(h)) for i, e, h in cursor.fetchall()]


def lock_tree(cursor: Any) -> int | None:
    """Take the ``log_tree`` row for this transaction; its size, or None when another
    integrator holds it (``SKIP LOCKED``: integrators take turns, never wait)."""
    cursor.execute("SELECT size, root_hash FROM log_tree WHERE id = 1 FOR UPDATE SKIP LOCKED")
    row = cursor.fetchone()
    return int(row[0]) if row else None


def publish_checkpoint(cursor: Any, size: int, root_hash: bytes, note: bytes) -> None:
    """Store a signed checkpoint and move ``log_tree`` to it (under :func:`lock_tree`)."""
    cursor.execute("INSERT INTO checkpoints (tree_size, root_hash, note) VALUES (%s, %s, %s)",
                   (size, root_hash, note))
    cursor.execute("UPDATE log_tree SET size = %s, root_hash = %s, updated_at = now() "
                   "WHERE id = 1", (size, root_hash))
