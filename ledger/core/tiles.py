"""C2SP tlog-tiles: tile coordinates and paths, entry bundles, and the Merkle tree on tiles.

References: https://c2sp.org/tlog-tiles, Go's ``golang.org/x/mod/sumdb/tlog`` (tile.go,
``TileHashReader``) and https://research.swtch.com/tlog#tiling_a_log.

A tile at level L, index N holds up to 256 consecutive hashes at tree level 8*L: at level
0 the leaf hashes, above that the Merkle Tree Hash of each *full* tile of the level below.
Tree levels 8*L+1 .. 8*L+7 are not part of a tile. For a *full* tile they are its
:func:`tile_nodes` (255 hashes), which storage may keep beside it (a full tile never
changes), so that a proof is lookups instead of up to 255 SHA-256 calls per element; a
reader without them, or a partial tile, has them recomputed from the tile's bottom row.
Stored nodes are derived data: whoever serves a proof built from them checks it against
the signed root first (``ledger.log.proofs``). The rightmost tile of a level is partial
(1..255 hashes) and is never hashed into the level above. Because the log only appends, a
partial tile of width W is a prefix of every later version of the same tile, so storage
can keep one row per (level, index) and answer any narrower read by truncating it.

Nothing here does I/O: storage is behind :class:`TileReader` (the integrator reads tiles
from Postgres; :class:`MemoryTileStore` is the in-memory one for tests and benchmarks).
Every function reads all the tiles it needs in one ``read_tiles`` call.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast

from ledger.core.errors import TileFormatError, TileNotFoundError, TreeRangeError
from ledger.core.merkle import (
    EMPTY_ROOT,
    HASH_SIZE,
    MAX_TREE_SIZE,
    NODE_PREFIX,
    consistency_proof_ranges,
    inclusion_proof_ranges,
)

TILE_HEIGHT = 8
TILE_WIDTH = 1 << TILE_HEIGHT  # 256 hashes in a full tile
FULL_TILE_BYTES = TILE_WIDTH * HASH_SIZE  # 8,192
TILE_NODES_BYTES = (TILE_WIDTH - 1) * HASH_SIZE  # 8,160: the 255 hashes above the bottom row
MAX_TILE_LEVEL = 63
MAX_ENTRY_SIZE = 0xFFFF  # entry bundles use a big-endian uint16 length prefix

_sha256 = hashlib.sha256


def _check_coordinates(index: int, width: int) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise TileFormatError(f"tile index {index!r} is not a non-negative integer")
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= TILE_WIDTH:
        raise TileFormatError(f"tile width {width!r} is not in 1..{TILE_WIDTH}")


def encode_tile_index(index: int) -> str:
    """N as zero-padded 3-digit path elements, all but the last prefixed with ``x``.

    >>> encode_tile_index(1234067)
    'x001/x234/067'
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise TileFormatError(f"tile index {index!r} is not a non-negative integer")
    parts = [f"{index % 1000:03d}"]
    index //= 1000
    while index:
        parts.append(f"x{index % 1000:03d}")
        index //= 1000
    return "/".join(reversed(parts))


def _suffix(width: int) -> str:
    return "" if width == TILE_WIDTH else f".p/{width}"


class _Coordinates:
    """What a hash tile and an entry bundle share: a width, partial below 256."""

    __slots__ = ()
    width: int

    @property
    def is_partial(self) -> bool:
        return self.width < TILE_WIDTH


@dataclass(frozen=True, slots=True, order=True)
class Tile(_Coordinates):
    """A hash tile: ``width`` hashes at tree level 8*``level``, starting at 256*``index``."""

    level: int
    index: int
    width: int = TILE_WIDTH

    def __post_init__(self) -> None:
        if (
            isinstance(self.level, bool)
            or not isinstance(self.level, int)
            or not 0 <= self.level <= MAX_TILE_LEVEL
        ):
            raise TileFormatError(f"tile level {self.level!r} is not in 0..{MAX_TILE_LEVEL}")
        _check_coordinates(self.index, self.width)

    @property
    def path(self) -> str:
        """The tlog-tiles path, e.g. ``tile/0/x001/x234/067.p/8``."""
        return f"tile/{self.level}/{encode_tile_index(self.index)}{_suffix(self.width)}"


@dataclass(frozen=True, slots=True, order=True)
class EntryBundle(_Coordinates):
    """An entry bundle: entries 256*``index`` .. 256*``index`` + ``width`` - 1."""

    index: int
    width: int = TILE_WIDTH

    def __post_init__(self) -> None:
        _check_coordinates(self.index, self.width)

    @property
    def path(self) -> str:
        """The tlog-tiles path, e.g. ``tile/entries/000.p/17``."""
        return f"tile/entries/{encode_tile_index(self.index)}{_suffix(self.width)}"


_PATH_RE = re.compile(
    r"tile/(?P<level>entries|0|[1-9][0-9]?)/"
    r"(?P<index>(?:x[0-9]{3}/)*[0-9]{3})"
    r"(?:\.p/(?P<width>[1-9][0-9]{0,2}))?"
)


def parse_tile_path(path: str) -> Tile | EntryBundle:
    """Parse ``tile/<L>/<N>[.p/<W>]`` or ``tile/entries/<N>[.p/<W>]`` strictly.

    Only the canonical spelling is accepted (no leading zeros in L or W, no ``x000``
    leading group, W in 1..255): the path is re-encoded and compared, as Go's
    ``tlog.ParseTilePath`` does. Raises :class:`TileFormatError`.
    """
    m = _PATH_RE.fullmatch(path)
    if m is None:
        raise TileFormatError(f"not a tlog-tiles path: {path!r}")
    index = int(m["index"].replace("x", "").replace("/", ""))
    width = int(m["width"]) if m["width"] is not None else TILE_WIDTH
    if width >= TILE_WIDTH and m["width"] is not None:
        raise TileFormatError(f"partial tile width must be 1..255: {path!r}")
    tile: Tile | EntryBundle
    if m["level"] == "entries":
        tile = EntryBundle(index, width)
    else:
        level = int(m["level"])
        if level > MAX_TILE_LEVEL:
            raise TileFormatError(f"tile level must be 0..{MAX_TILE_LEVEL}: {path!r}")
        tile = Tile(level, index, width)
    if tile.path != path:
        raise TileFormatError(f"not the canonical spelling of a tile path: {path!r}")
    return tile


def tile_width(level: int, index: int, size: int) -> int:
    """How many hashes tile (``level``, ``index``) holds in a tree of ``size`` (0: none).

    The same count applies to entry bundles at level 0.
    """
    count = size >> (TILE_HEIGHT * level)
    return max(0, min(TILE_WIDTH, count - index * TILE_WIDTH))


def tiles_for_size(size: int) -> list[Tile]:
    """Every tile (full and partial, all levels) of the tree of ``size``, bottom level first."""
    _check_tree_size(size)
    tiles: list[Tile] = []
    level = 0
    while count := size >> (TILE_HEIGHT * level):
        full, rest = divmod(count, TILE_WIDTH)
        tiles.extend(Tile(level, n) for n in range(full))
        if rest:
            tiles.append(Tile(level, full, rest))
        level += 1
    return tiles


def entry_bundles_for_size(size: int) -> list[EntryBundle]:
    """Every entry bundle of the tree of ``size``; the last is partial unless size % 256 == 0."""
    _check_tree_size(size)
    full, rest = divmod(size, TILE_WIDTH)
    bundles = [EntryBundle(n) for n in range(full)]
    if rest:
        bundles.append(EntryBundle(full, rest))
    return bundles


def encode_entry_bundle(entries: Iterable[bytes]) -> bytes:
    """Concatenate entries, each prefixed with its length as a big-endian uint16."""
    parts: list[bytes] = []
    for entry in entries:
        if len(entry) > MAX_ENTRY_SIZE:
            raise TileFormatError(f"an entry bundle entry is at most {MAX_ENTRY_SIZE} bytes")
        parts.append(len(entry).to_bytes(2, "big"))
        parts.append(bytes(entry))
    if len(parts) > 2 * TILE_WIDTH:
        raise TileFormatError(f"an entry bundle holds at most {TILE_WIDTH} entries")
    return b"".join(parts)


def decode_entry_bundle(data: bytes, width: int | None = None) -> list[bytes]:
    """Split an entry bundle into its entries; with ``width``, require exactly that many."""
    entries: list[bytes] = []
    pos, end = 0, len(data)
    while pos < end:
        if pos + 2 > end:
            raise TileFormatError("entry bundle ends inside a length prefix")
        n = int.from_bytes(data[pos : pos + 2], "big")
        pos += 2
        if pos + n > end:
            raise TileFormatError("entry bundle ends inside an entry")
        entries.append(bytes(data[pos : pos + n]))
        pos += n
        if len(entries) > TILE_WIDTH:
            raise TileFormatError(f"an entry bundle holds at most {TILE_WIDTH} entries")
    if width is not None and len(entries) != width:
        raise TileFormatError(f"entry bundle has {len(entries)} entries, expected {width}")
    return entries


class TileReader(Protocol):
    """Where tile data comes from (the integrator's Postgres store, or memory in tests)."""

    def read_tiles(self, tiles: Sequence[Tile]) -> Sequence[bytes]:
        """Return the data of every requested tile, in order.

        Each item must be exactly ``tile.width * 32`` bytes: a store that keeps only the
        widest version of a tile returns its first ``width`` hashes. Raise
        :class:`TileNotFoundError` for a tile it does not have.
        """
        ...


class TileNodeReader(TileReader, Protocol):
    """A :class:`TileReader` that may also hold the :func:`tile_nodes` of full tiles."""

    def read_tiles_and_nodes(
        self, tiles: Sequence[Tile]
    ) -> Sequence[tuple[bytes, bytes | None]]:
        """(data, nodes) for every requested tile, in order: ``data`` as
        :meth:`TileReader.read_tiles` returns it; ``nodes`` the 255 hashes of
        :func:`tile_nodes` for a full tile that has them stored, else None."""
        ...


class MemoryTileStore:
    """A :class:`TileReader` over a dict; keeps the widest version of each tile, and the
    :func:`tile_nodes` of full tiles given to :meth:`write_nodes`."""

    def __init__(self) -> None:
        self._tiles: dict[tuple[int, int], bytes] = {}
        self._nodes: dict[tuple[int, int], bytes] = {}
        self.read_calls = 0
        self.tiles_read = 0

    def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
        self.read_calls += 1
        self.tiles_read += len(tiles)
        out: list[bytes] = []
        for t in tiles:
            data = self._tiles.get((t.level, t.index), b"")
            need = t.width * HASH_SIZE
            if len(data) < need:
                raise TileNotFoundError(f"no tile {t.path}")
            out.append(data if len(data) == need else data[:need])
        return out

    def write_tiles(self, tiles: Mapping[Tile, bytes]) -> None:
        """Store tiles from :func:`integrate`; refuses to change a hash already stored."""
        for t, data in tiles.items():
            if len(data) != t.width * HASH_SIZE:
                raise TileFormatError(f"{t.path}: {len(data)} bytes for {t.width} hashes")
            old = self._tiles.get((t.level, t.index), b"")
            if len(old) > len(data) or data[: len(old)] != old:
                raise TileFormatError(f"{t.path} would change hashes already stored")
            self._tiles[(t.level, t.index)] = bytes(data)

    def write_nodes(self, nodes: Mapping[Tile, bytes]) -> None:
        """Keep the :func:`tile_nodes` of full tiles (from :attr:`Integration.nodes`)."""
        for t, data in nodes.items():
            if t.is_partial or len(data) != TILE_NODES_BYTES:
                raise TileFormatError(f"{t.path}: nodes are kept for full tiles only")
            self._nodes[(t.level, t.index)] = bytes(data)

    def nodes(self) -> dict[tuple[int, int], bytes]:
        """The nodes kept, by (level, index)."""
        return dict(self._nodes)

    def read_tiles_and_nodes(self, tiles: Sequence[Tile]) -> list[tuple[bytes, bytes | None]]:
        data = self.read_tiles(tiles)
        return [(d, None if t.is_partial else self._nodes.get((t.level, t.index)))
                for t, d in zip(tiles, data, strict=True)]

    def __len__(self) -> int:
        return len(self._tiles)


def _check_tree_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_TREE_SIZE:
        raise TreeRangeError(f"tree size {size!r} is not an integer in [0, 2**63)")


def _mth_aligned(data: bytes) -> bytes:
    """MTH of a power-of-two run of hashes laid end to end (e.g. a full tile)."""
    while len(data) > HASH_SIZE:
        data = b"".join(
            [_sha256(NODE_PREFIX + data[i : i + 64]).digest() for i in range(0, len(data), 64)]
        )
    return data


def tile_nodes(data: bytes) -> bytes:
    """The 255 hashes inside a full tile, above its 256 hashes: the 128 pairs' hashes
    (tree level 8*L+1), then the 64 above them, ..., and last the tile's own MTH (the hash
    the tile above holds for it). Node k of in-tile level j (1..8) is at hash offset
    ``256 - (512 >> j) + k`` (:func:`tile_node_offset`)."""
    if len(data) != FULL_TILE_BYTES:
        raise TileFormatError(f"tile nodes are made from a full tile, not {len(data)} bytes")
    out: list[bytes] = []
    row = data
    while len(row) > HASH_SIZE:
        row = b"".join(
            [_sha256(NODE_PREFIX + row[i : i + 64]).digest() for i in range(0, len(row), 64)]
        )
        out.append(row)
    return b"".join(out)


def tile_node_offset(j: int, k: int) -> int:
    """Byte offset in :func:`tile_nodes` of node ``k`` at in-tile level ``j`` (1..8)."""
    return (TILE_WIDTH - (2 * TILE_WIDTH >> j) + k) * HASH_SIZE


def _fold(blocks: Sequence[bytes]) -> bytes:
    """Combine the full-subtree hashes of a range, largest (leftmost) first, into its MTH."""
    h = blocks[-1]
    for b in reversed(blocks[:-1]):
        h = _sha256(NODE_PREFIX + b + h).digest()
    return h


def _full_subtrees(lo: int, hi: int) -> list[tuple[int, int]]:
    """Split [lo, hi) into the full subtrees (tree level, index) whose fold is MTH(D[lo:hi]).

    MTH splits at the largest power of two below n, so the pieces are the binary digits of
    hi - lo from the top; ``lo`` is aligned to the largest piece in every range we use.
    """
    out: list[tuple[int, int]] = []
    n = hi - lo
    while n:
        level = n.bit_length() - 1
        assert lo % (1 << level) == 0, (lo, hi)
        out.append((level, lo >> level))
        lo += 1 << level
        n -= 1 << level
    return out


def _read_checked(reader: TileReader, tiles: list[Tile]) -> dict[Tile, bytes]:
    data = reader.read_tiles(tiles)
    if len(data) != len(tiles):
        raise TileFormatError(f"tile reader returned {len(data)} tiles for {len(tiles)}")
    for t, d in zip(tiles, data, strict=True):
        if len(d) != t.width * HASH_SIZE:
            raise TileFormatError(f"{t.path}: reader returned {len(d)} bytes")
    return dict(zip(tiles, data, strict=True))


def _read_with_nodes(reader: TileReader, tiles: list[Tile]
                     ) -> dict[Tile, tuple[bytes, bytes | None]]:
    # hasattr, not isinstance: a runtime Protocol check costs more than the lookups
    if not hasattr(reader, "read_tiles_and_nodes"):
        return {t: (d, None) for t, d in _read_checked(reader, tiles).items()}
    got = cast(TileNodeReader, reader).read_tiles_and_nodes(tiles)
    if len(got) != len(tiles):
        raise TileFormatError(f"tile reader returned {len(got)} tiles for {len(tiles)}")
    for t, (d, nodes) in zip(tiles, got, strict=True):
        if len(d) != t.width * HASH_SIZE:
            raise TileFormatError(f"{t.path}: reader returned {len(d)} bytes")
        if nodes is not None and (t.is_partial or len(nodes) != TILE_NODES_BYTES):
            raise TileFormatError(f"{t.path}: reader returned {len(nodes)} bytes of nodes")
    return dict(zip(tiles, got, strict=True))


def _coordinates(level: int, index: int) -> tuple[int, int, int, int]:
    """(tile level L, in-tile level j, tile index, offset of the first hash in the tile)
    of the full subtree (tree ``level``, ``index``): a subtree at tree level 8*L + j is
    the MTH of 2**j consecutive hashes of tile level L."""
    tile_level, j = divmod(level, TILE_HEIGHT)
    first = index << j  # index of the subtree's first hash at tree level 8*tile_level
    return tile_level, j, first >> TILE_HEIGHT, first & (TILE_WIDTH - 1)


def _locate(level: int, index: int, size: int) -> tuple[Tile, int, int]:
    """Where the full subtree (tree ``level``, ``index``) is found in the tree of ``size``:
    (its tile, its in-tile level j, the offset of its first hash in the tile)."""
    tile_level, j, n, offset = _coordinates(level, index)
    return Tile(tile_level, n, tile_width(tile_level, n, size)), j, offset


class NodeSlice(NamedTuple):
    """Where the bytes of one full subtree's hash lie in storage: ``length`` bytes at
    ``offset`` of ``tile``'s data, or of its stored :func:`tile_nodes` (``in_nodes``).
    32 bytes are the hash itself; more (a run of hashes of a partial tile) are hashed
    into it by :func:`hash_from_slice`."""

    node: tuple[int, int]  # (tree level, index)
    tile: Tile
    in_nodes: bool
    offset: int
    length: int


def _slices_for(
    size: int,
    ranges: Sequence[tuple[int, int]],
    memo: Mapping[tuple[int, int], bytes] | None,
) -> list[NodeSlice]:
    out: dict[tuple[int, int], NodeSlice] = {}
    made: dict[tuple[int, int], Tile] = {}  # a Tile checks its fields: one per tile
    for lo, hi in ranges:
        for node in _full_subtrees(lo, hi):
            if node in out or (memo is not None and node in memo):
                continue
            tile_level, j, n, offset = _coordinates(*node)
            tile = made.get((tile_level, n))
            if tile is None:
                tile = made[(tile_level, n)] = Tile(tile_level, n,
                                                    tile_width(tile_level, n, size))
            if j and not tile.is_partial:
                out[node] = NodeSlice(node, tile, True, tile_node_offset(j, offset >> j),
                                      HASH_SIZE)
            else:
                out[node] = NodeSlice(node, tile, False, offset * HASH_SIZE, HASH_SIZE << j)
    return list(out.values())


def hash_from_slice(piece: NodeSlice, data: bytes) -> bytes:
    """The subtree hash from the bytes at ``piece`` (``len(data) == piece.length``)."""
    if len(data) != piece.length:
        raise TileFormatError(f"{piece.tile.path}: {len(data)} bytes for {piece.length}")
    return data if len(data) == HASH_SIZE else _mth_aligned(data)


def inclusion_proof_slices(
    index: int, size: int, memo: Mapping[tuple[int, int], bytes] | None = None
) -> list[NodeSlice]:
    """Where the hashes :func:`inclusion_proof_from_tiles` needs for (``index``,
    ``size``) and ``memo`` lacks are stored: so a caller can read just those bytes in
    the round trip that reads the entry, and hand them in through ``memo``."""
    return _slices_for(size, inclusion_proof_ranges(index, size), memo)


def consistency_proof_slices(
    old_size: int, new_size: int, memo: Mapping[tuple[int, int], bytes] | None = None
) -> list[NodeSlice]:
    """:func:`inclusion_proof_slices` for
    :func:`consistency_proof_and_old_root_from_tiles`."""
    ranges = consistency_proof_ranges(old_size, new_size)
    return _slices_for(new_size, [*ranges, (0, old_size)] if old_size else ranges, memo)


def _subtree_hashes(
    size: int,
    nodes: Iterable[tuple[int, int]],
    reader: TileReader,
    memo: MutableMapping[tuple[int, int], bytes] | None = None,
) -> dict[tuple[int, int], bytes]:
    """Hashes of full subtrees (tree level, index) of the tree of ``size``, in one read.

    A subtree at tree level 8*L + j is the MTH of 2**j consecutive hashes of tile level L
    (like Go's ``tlog.TileHashReader``), so only tiles at level L are read for it: looked
    up in the tile's :func:`tile_nodes` where the reader has them, else recomputed.
    ``memo`` (a full subtree's hash does not depend on the tree size) is consulted first
    and given what was read.
    """
    out: dict[tuple[int, int], bytes] = {}
    where: dict[tuple[int, int], tuple[Tile, int, int]] = {}
    wanted: dict[Tile, None] = {}
    for level, index in nodes:
        if memo is not None:
            known = memo.get((level, index))
            if known is not None:
                out[(level, index)] = known
                continue
        tile, j, offset = _locate(level, index, size)
        where[(level, index)] = (tile, j, offset)
        wanted[tile] = None
    if not wanted:
        return out
    data = _read_with_nodes(reader, list(wanted))
    for node, (t, j, offset) in where.items():
        tile_data, stored_nodes = data[t]
        if j == 0:
            h = tile_data[offset * HASH_SIZE : (offset + 1) * HASH_SIZE]
        elif stored_nodes is not None:
            at = tile_node_offset(j, offset >> j)
            h = stored_nodes[at : at + HASH_SIZE]
        else:
            h = _mth_aligned(tile_data[offset * HASH_SIZE : (offset + (1 << j)) * HASH_SIZE])
        out[node] = h
    if memo is not None:
        memo.update((node, out[node]) for node in where)
    return out


def _range_hashes(
    size: int,
    ranges: Sequence[tuple[int, int]],
    reader: TileReader,
    memo: MutableMapping[tuple[int, int], bytes] | None = None,
) -> list[bytes]:
    pieces = [_full_subtrees(lo, hi) for lo, hi in ranges]
    hashes = _subtree_hashes(size, (node for p in pieces for node in p), reader, memo)
    return [_fold([hashes[node] for node in p]) for p in pieces]


def root_from_tiles(
    size: int,
    reader: TileReader,
    memo: MutableMapping[tuple[int, int], bytes] | None = None,
    *,
    tree_size: int | None = None,
) -> bytes:
    """MTH(D[0:size]) from the tiles of a tree of at least ``size`` leaves; with
    ``tree_size``, reading the tiles as they are in the tree of that size (full ones,
    with their stored nodes, rather than partial prefixes)."""
    _check_tree_size(size)
    if size == 0:
        return EMPTY_ROOT
    if tree_size is not None and tree_size < size:
        raise TreeRangeError(f"tree size {tree_size} is smaller than {size}")
    return _range_hashes(tree_size or size, [(0, size)], reader, memo)[0]


def inclusion_proof_from_tiles(
    index: int,
    size: int,
    reader: TileReader,
    memo: MutableMapping[tuple[int, int], bytes] | None = None,
) -> list[bytes]:
    """PATH(index, D[0:size]) (RFC 9162 2.1.3.1) from tiles; same output as the in-memory one.

    ``memo``: full-subtree hashes by (tree level, index), consulted and filled (see
    :func:`_subtree_hashes`). Hashes come from storage: check the proof against the signed
    root before serving it."""
    return _range_hashes(size, inclusion_proof_ranges(index, size), reader, memo)


def consistency_proof_and_old_root_from_tiles(
    old_size: int,
    new_size: int,
    reader: TileReader,
    memo: MutableMapping[tuple[int, int], bytes] | None = None,
) -> tuple[list[bytes], bytes]:
    """PROOF(m, D[0:n]) and MTH(D[0:m]), from one read of the tiles of the tree of
    ``new_size`` (to check the proof where no checkpoint of ``old_size`` exists)."""
    ranges = consistency_proof_ranges(old_size, new_size)
    if old_size == 0:
        return _range_hashes(new_size, ranges, reader, memo), EMPTY_ROOT
    *proof, old_root = _range_hashes(new_size, [*ranges, (0, old_size)], reader, memo)
    return proof, old_root


def subtree_path_from_tiles(
    level: int,
    index: int,
    size: int,
    reader: TileReader,
    memo: MutableMapping[tuple[int, int], bytes] | None = None,
) -> list[bytes]:
    """The proof elements above the full subtree (tree ``level``, ``index``), which must
    lie inside the tree of ``size``: PATH(index << level, D[0:size]) without its first
    ``level`` elements, which are inside the subtree. With the subtree's hash ``h``,
    ``verify_inclusion(h, index, ceil(size / 2**level), path, root)`` checks it: the
    tree seen from that level is the same left-balanced tree."""
    if (index + 1) << level > size:
        raise TreeRangeError(f"subtree ({level}, {index}) is not full in a tree of {size}")
    return _range_hashes(size, inclusion_proof_ranges(index << level, size)[level:], reader,
                         memo)


def consistency_proof_from_tiles(
    old_size: int,
    new_size: int,
    reader: TileReader,
    memo: MutableMapping[tuple[int, int], bytes] | None = None,
) -> list[bytes]:
    """PROOF(m, D[0:n]) (RFC 9162 2.1.4.1) from tiles; same output as the in-memory one."""
    return _range_hashes(new_size, consistency_proof_ranges(old_size, new_size), reader, memo)


class Integration(NamedTuple):
    """What :func:`integrate` produced: the new tree, every tile it created or changed, and
    the :func:`tile_nodes` of every tile that became full (hashed on the way anyway)."""

    size: int
    root: bytes
    tiles: dict[Tile, bytes]
    nodes: dict[Tile, bytes]


def integrate(old_size: int, new_leaf_hashes: Sequence[bytes], reader: TileReader) -> Integration:
    """Append leaf hashes to the tiled tree of ``old_size``.

    Returns the new size, the new root and every tile, at every level, that the append
    creates or changes (full tiles with width 256, the new rightmost tiles as partial).
    Reads the old rightmost partial tile of each level, in one ``read_tiles`` call, and
    nothing else. The caller stores the tiles (upsert by level and index) and the nodes of
    the tiles that became full, and signs a checkpoint for (size, root).
    """
    _check_tree_size(old_size)
    for h in new_leaf_hashes:
        if not isinstance(h, bytes) or len(h) != HASH_SIZE:
            raise TileFormatError("every leaf hash must be 32 bytes")
    new_size = old_size + len(new_leaf_hashes)
    _check_tree_size(new_size)
    if new_size == 0:
        return Integration(0, EMPTY_ROOT, {}, {})

    # The old rightmost partial tile of every level: the only stored hashes we need.
    old_partials: list[Tile] = []
    level = 0
    while count := old_size >> (TILE_HEIGHT * level):
        if count % TILE_WIDTH:
            old_partials.append(Tile(level, count >> TILE_HEIGHT, count % TILE_WIDTH))
        level += 1
    prefix: dict[int, bytes] = {}
    if old_partials:
        prefix = {t.level: d for t, d in _read_checked(reader, old_partials).items()}

    changed: dict[Tile, bytes] = {}
    full_nodes: dict[Tile, bytes] = {}
    blocks: list[bytes] = []  # full subtrees of the new root, smallest (rightmost) first
    appended = b"".join(new_leaf_hashes)  # new hashes at tree level 8*level
    level = 0
    while new_count := new_size >> (TILE_HEIGHT * level):
        old_count = old_size >> (TILE_HEIGHT * level)
        first_tile = old_count >> TILE_HEIGHT
        buf = prefix.get(level, b"") + appended
        assert len(buf) == (new_count - first_tile * TILE_WIDTH) * HASH_SIZE
        parents: list[bytes] = []
        for offset in range(0, len(buf), FULL_TILE_BYTES):
            chunk = buf[offset : offset + FULL_TILE_BYTES]
            width = len(chunk) // HASH_SIZE
            tile = Tile(level, first_tile + offset // FULL_TILE_BYTES, width)
            if appended:
                changed[tile] = chunk
            if width == TILE_WIDTH:  # newly full: every full tile of buf is new
                nodes = tile_nodes(chunk)
                full_nodes[tile] = nodes
                parents.append(nodes[-HASH_SIZE:])
            else:  # the new rightmost partial tile: its pieces of the root, right to left
                pos = 0
                pieces: list[bytes] = []
                for bit in range(TILE_HEIGHT - 1, -1, -1):
                    if width >> bit & 1:
                        end = pos + (HASH_SIZE << bit)
                        pieces.append(_mth_aligned(chunk[pos:end]))
                        pos = end
                blocks.extend(reversed(pieces))
        appended = b"".join(parents)
        level += 1
    return Integration(new_size, _fold(blocks[::-1]), changed, full_nodes)
