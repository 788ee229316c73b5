"""C2SP tlog-tiles: paths, entry bundles, the tree on tiles and the integrator."""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core.errors import TileFormatError, TileNotFoundError, TreeRangeError
from ledger.core.merkle import (
    EMPTY_ROOT,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_hash,
    verify_consistency,
    verify_inclusion,
)
from ledger.core.tiles import (
    EntryBundle,
    MemoryTileStore,
    NodeSlice,
    Tile,
    consistency_proof_and_old_root_from_tiles,
    consistency_proof_from_tiles,
    consistency_proof_slices,
    decode_entry_bundle,
    encode_entry_bundle,
    encode_tile_index,
    entry_bundles_for_size,
    hash_from_slice,
    inclusion_proof_from_tiles,
    inclusion_proof_slices,
    integrate,
    parse_tile_path,
    root_from_tiles,
    subtree_path_from_tiles,
    tile_node_offset,
    tile_nodes,
    tile_width,
    tiles_for_size,
)

BIG = 70_000  # the tlog-tiles spec's example size: three tile levels, all partial at the edge
LEAVES = [leaf_hash(b"entry %d" % i) for i in range(BIG)]


@cache
def node_store() -> MemoryTileStore:
    """The same tree with the subtree hashes of its full tiles kept (as Postgres does)."""
    store, size, rng = MemoryTileStore(), 0, random.Random(8)
    while size < BIG:
        batch = LEAVES[size : size + rng.choice([1, 255, 256, 3000])]
        result = integrate(size, batch, store)
        store.write_tiles(result.tiles)
        store.write_nodes(result.nodes)
        size = result.size
    return store


@cache
def big_store() -> MemoryTileStore:
    """A 70,000-leaf tiled tree, integrated in uneven batches."""
    store, size, rng = MemoryTileStore(), 0, random.Random(7)
    while size < BIG:
        batch = LEAVES[size : size + rng.choice([1, 3, 255, 256, 257, 1000, 4097])]
        result = integrate(size, batch, store)
        store.write_tiles(result.tiles)
        size = result.size
    return store


def naive_tile(level: int, index: int, size: int) -> bytes:
    """Tile contents straight from the spec: MTH(D[(n*256+i)*256**l : (n*256+i+1)*256**l])."""
    span = 256**level
    out = []
    for i in range(tile_width(level, index, size)):
        lo = (index * 256 + i) * span
        out.append(root_hash(LEAVES[lo : lo + span]))
    return b"".join(out)


# --- paths ---

GOOD_PATHS = [
    ("tile/0/000", Tile(0, 0)),
    ("tile/0/001", Tile(0, 1)),
    ("tile/0/001.p/5", Tile(0, 1, 5)),
    ("tile/5/x123/x456/078", Tile(5, 123456078)),
    ("tile/5/x123/x456/078.p/2", Tile(5, 123456078, 2)),
    ("tile/0/x003/x057/500", Tile(0, 3057500)),
    ("tile/63/999.p/255", Tile(63, 999, 255)),
    ("tile/entries/x001/x234/067", EntryBundle(1234067)),
    ("tile/entries/000.p/1", EntryBundle(0, 1)),
]
BAD_PATHS = [
    "tile/0/1", "tile/00/000", "tile/01/000", "tile/64/000", "tile/-1/000", "tile/data/000",
    "tile/0/x000/001", "tile/0/001/x002", "tile/0/x1/000", "tile/0/000.p/0", "tile/0/000.p/256",
    "tile/0/000.p/05", "tile/0/000.p/", "tile/0/000/", "/tile/0/000", "tile/8/0/000",
    "tile/entries/000.p/256", "tile/entries/1", "tile/0/000.p/1/2", "tile/0/0000", "checkpoint",
    "tile/0/000.p/1 ", "tile/0/\u0660\u0660\u0660",
]


@pytest.mark.parametrize(("path", "tile"), GOOD_PATHS)
def test_good_paths(path: str, tile: Tile | EntryBundle) -> None:
    assert tile.path == path
    assert parse_tile_path(path) == tile


@pytest.mark.parametrize("path", BAD_PATHS)
def test_bad_paths(path: str) -> None:
    with pytest.raises(TileFormatError):
        parse_tile_path(path)


def test_index_encoding() -> None:
    assert encode_tile_index(1234067) == "x001/x234/067"
    assert encode_tile_index(0) == "000"
    assert encode_tile_index(999) == "999"
    assert encode_tile_index(1000) == "x001/000"
    assert encode_tile_index(123456789) == "x123/x456/789"


@settings(max_examples=200, deadline=None)
@given(
    level=st.integers(0, 63),
    index=st.one_of(st.integers(0, 2000), st.integers(0, 2**56)),
    width=st.integers(1, 256),
)
def test_path_round_trip(level: int, index: int, width: int) -> None:
    tile = Tile(level, index, width)
    assert parse_tile_path(tile.path) == tile
    bundle = EntryBundle(index, width)
    assert parse_tile_path(bundle.path) == bundle


def test_bad_coordinates() -> None:
    for args in ((64, 0, 256), (-1, 0, 256), (0, -1, 256), (0, 0, 0), (0, 0, 257)):
        with pytest.raises(TileFormatError):
            Tile(*args)


# --- layout ---


def test_layout_of_the_spec_example() -> None:
    """tlog-tiles: 70,000 leaves are 273 full level-0 tiles, a level-0 partial of width 112,
    one full level-1 tile, a level-1 partial of width 17 and a level-2 partial of width 1."""
    tiles = tiles_for_size(70_000)
    assert sum(1 for t in tiles if t.level == 0 and not t.is_partial) == 273
    assert [t for t in tiles if t.level > 0 or t.is_partial] == [
        Tile(0, 273, 112), Tile(1, 0), Tile(1, 1, 17), Tile(2, 0, 1)
    ]
    assert tiles_for_size(256) == [Tile(0, 0), Tile(1, 0, 1)]
    assert tiles_for_size(0) == []
    assert entry_bundles_for_size(513) == [EntryBundle(0), EntryBundle(1), EntryBundle(2, 1)]
    assert tile_width(0, 273, 70_000) == 112
    assert tile_width(0, 274, 70_000) == 0


def test_big_store_tiles_match_the_spec_definition() -> None:
    store = big_store()
    tiles = tiles_for_size(BIG)
    data = store.read_tiles(tiles)
    assert len(store) == len(tiles)
    for t, d in zip(tiles, data, strict=True):
        if t.level > 0 or t.index % 50 == 0 or t.is_partial:
            assert d == naive_tile(t.level, t.index, BIG), t.path


# --- entry bundles ---


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=256))
def test_entry_bundle_round_trip(entries: list[bytes]) -> None:
    data = encode_entry_bundle(entries)
    assert decode_entry_bundle(data, len(entries)) == entries
    if data:
        with pytest.raises(TileFormatError):
            decode_entry_bundle(data[:-1], len(entries))


def test_entry_bundle_limits() -> None:
    assert encode_entry_bundle([b"ab", b""]) == b"\x00\x02ab\x00\x00"
    assert decode_entry_bundle(encode_entry_bundle([b"x" * 65535])) == [b"x" * 65535]
    with pytest.raises(TileFormatError):
        encode_entry_bundle([b"x" * 65536])
    with pytest.raises(TileFormatError):
        encode_entry_bundle([b""] * 257)
    with pytest.raises(TileFormatError):
        decode_entry_bundle(b"\x00\x00" * 257)
    with pytest.raises(TileFormatError):
        decode_entry_bundle(b"\x00\x01a", width=2)
    with pytest.raises(TileFormatError):
        decode_entry_bundle(b"\x00")


# --- integrate ---


def _run(batches: Sequence[int], start: int = 0, store: MemoryTileStore | None = None) -> tuple[
    MemoryTileStore, list[tuple[int, bytes, set[Tile]]]
]:
    store = MemoryTileStore() if store is None else store
    size, steps = start, []
    for b in batches:
        calls = store.read_calls
        result = integrate(size, LEAVES[size : size + b], store)
        assert store.read_calls - calls <= 1  # one batched read, or none
        store.write_tiles(result.tiles)
        for t, data in result.tiles.items():
            assert len(data) == t.width * 32
        steps.append((result.size, result.root, set(result.tiles)))
        size = result.size
    return store, steps


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 700), min_size=1, max_size=12))
def test_integrate_in_any_batches_equals_one_batch(batches: list[int]) -> None:
    total = sum(batches)
    one, _ = _run([total])
    many, steps = _run(batches)
    assert many._tiles == one._tiles
    old = 0
    for size, root, changed in steps:
        assert root == root_hash(LEAVES[:size])
        # Exactly the tiles that are new or wider than at the old size.
        assert changed == set(tiles_for_size(size)) - set(tiles_for_size(old))
        old = size
    for t in tiles_for_size(total):
        assert many.read_tiles([t])[0] == naive_tile(t.level, t.index, total)


@cache
def _prefix_store(size: int) -> MemoryTileStore:
    store = MemoryTileStore()
    store.write_tiles(integrate(0, LEAVES[:size], store).tiles)
    return store


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 900), min_size=1, max_size=5))
def test_integrate_across_the_second_tile_level(batches: list[int]) -> None:
    """Appending across 65,536 leaves creates the first level-2 tile."""
    start = 65_536 - 700
    base = _prefix_store(start)
    one = MemoryTileStore()
    one._tiles = dict(base._tiles)
    many = MemoryTileStore()
    many._tiles = dict(base._tiles)
    _run([sum(batches)], start, one)
    _, steps = _run(batches, start, many)
    assert many._tiles == one._tiles
    for size, root, _changed in steps[-2:]:
        assert root == root_from_tiles(size, big_store())


def test_integrate_edge_cases() -> None:
    store = MemoryTileStore()
    assert integrate(0, [], store) == (0, EMPTY_ROOT, {}, {})
    result = integrate(0, LEAVES[:1], store)
    assert result == (1, LEAVES[0], {Tile(0, 0, 1): LEAVES[0]}, {})
    store.write_tiles(result.tiles)
    assert integrate(1, [], store) == (1, LEAVES[0], {}, {})
    result = integrate(1, LEAVES[1:256], store)
    assert set(result.tiles) == {Tile(0, 0), Tile(1, 0, 1)}
    assert result.tiles[Tile(1, 0, 1)] == root_hash(LEAVES[:256])
    with pytest.raises(TileFormatError):
        integrate(1, [b"short"], store)
    with pytest.raises(TileNotFoundError):
        integrate(5, LEAVES[5:6], store)  # the reader has no 5-wide tile
    with pytest.raises(TreeRangeError):
        integrate(-1, [], store)


def test_store_refuses_to_rewrite_history() -> None:
    store = MemoryTileStore()
    store.write_tiles(integrate(0, LEAVES[:3], store).tiles)
    with pytest.raises(TileFormatError):
        store.write_tiles({Tile(0, 0, 3): LEAVES[1] + LEAVES[0] + LEAVES[2]})
    with pytest.raises(TileFormatError):
        store.write_tiles({Tile(0, 0, 2): LEAVES[0]})


def test_integrate_a_large_batch_quickly() -> None:
    """Throughput floor: well above the 20,000 entries/s target, even on a busy runner."""
    import time

    store = MemoryTileStore()
    t0 = time.perf_counter()
    result = integrate(0, LEAVES, store)
    elapsed = time.perf_counter() - t0
    assert result.root == root_from_tiles(BIG, big_store())
    assert BIG / elapsed > 50_000, f"{BIG / elapsed:.0f} leaves/s"


# --- proofs from tiles ---


@settings(max_examples=30, deadline=None)
@given(data=st.data(), size=st.one_of(st.integers(1, BIG), st.sampled_from([1, 256, 65_536, BIG])))
def test_tile_proofs_equal_in_memory_proofs(data: st.DataObject, size: int) -> None:
    store = big_store()
    index = data.draw(st.one_of(st.integers(0, size - 1), st.just(size - 1)))
    m = data.draw(st.one_of(st.integers(0, size), st.sampled_from([0, 1, size])))
    calls = store.read_calls
    root = root_from_tiles(size, store)
    proof = inclusion_proof_from_tiles(index, size, store)
    cproof = consistency_proof_from_tiles(m, size, store)
    assert store.read_calls - calls <= 3  # one read per function, or none
    # Against the reference implementation (its cost grows with size: compare small ones).
    if size <= 5000:
        assert root == root_hash(LEAVES[:size])
        assert proof == inclusion_proof(index, size, LEAVES)
        assert cproof == consistency_proof(m, size, LEAVES)
    verify_inclusion(LEAVES[index], index, size, proof, root)
    verify_consistency(m, size, cproof, root_from_tiles(m, store), root)


def test_tile_proofs_at_full_size_equal_reference() -> None:
    store = big_store()
    root = root_hash(LEAVES)
    assert root_from_tiles(BIG, store) == root
    for index in (0, 255, 256, 65_535, 65_536, BIG - 1):
        assert inclusion_proof_from_tiles(index, BIG, store) == inclusion_proof(index, BIG, LEAVES)
    for m in (1, 256, 65_536, BIG - 1):
        assert consistency_proof_from_tiles(m, BIG, store) == consistency_proof(m, BIG, LEAVES)


def test_tile_readers_are_batched_and_checked() -> None:
    store = big_store()
    calls, read = store.read_calls, store.tiles_read
    inclusion_proof_from_tiles(12_345, BIG, store)
    assert store.read_calls == calls + 1
    assert store.tiles_read - read <= 5  # tiles at levels 0, 1 and 2

    class Short:
        def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
            return [b"\0" * 32 for _ in tiles]

    with pytest.raises(TileFormatError):
        root_from_tiles(1000, Short())

    class Missing:
        def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
            return []

    with pytest.raises(TileFormatError):
        root_from_tiles(1000, Missing())
    with pytest.raises(TileNotFoundError):
        root_from_tiles(BIG + 1, store)
    with pytest.raises(TreeRangeError):
        inclusion_proof_from_tiles(BIG, BIG, store)
    with pytest.raises(TreeRangeError):
        consistency_proof_from_tiles(BIG, 10, store)
    assert root_from_tiles(0, store) == EMPTY_ROOT
    assert inclusion_proof_from_tiles(0, 1, store) == []


def test_tile_nodes_are_the_subtrees_of_a_full_tile() -> None:
    data = b"".join(LEAVES[256:512])
    nodes = tile_nodes(data)
    assert len(nodes) == 255 * 32
    for j in range(1, 9):
        for k in range(256 >> j):
            at = tile_node_offset(j, k)
            lo = 256 + (k << j)
            assert nodes[at : at + 32] == root_hash(LEAVES[lo : lo + (1 << j)]), (j, k)
    assert nodes[-32:] == root_hash(LEAVES[256:512])
    with pytest.raises(TileFormatError):
        tile_nodes(data[:-32])


def test_integrate_returns_the_nodes_of_tiles_that_became_full() -> None:
    store = MemoryTileStore()
    first = integrate(0, LEAVES[:300], store)
    assert set(first.nodes) == {Tile(0, 0)}
    assert first.nodes[Tile(0, 0)] == tile_nodes(b"".join(LEAVES[:256]))
    store.write_tiles(first.tiles)
    second = integrate(300, LEAVES[300:511], store)
    assert second.nodes == {}  # tile 0/1 is still partial (255 wide)
    store.write_tiles(second.tiles)
    third = integrate(511, LEAVES[511:513], store)
    assert set(third.nodes) == {Tile(0, 1)}  # full now; tile 0/0 was not rewritten
    with pytest.raises(TileFormatError):
        store.write_nodes({Tile(0, 2, 1): b"\0" * 255 * 32})  # only full tiles have nodes


def test_proofs_from_stored_nodes_and_a_memo_equal_the_reference() -> None:
    """Stored nodes (lookups) and a memo of subtree hashes give the same proofs as the
    in-memory reference, at every kind of position; and read fewer hashes."""
    rng = random.Random(11)
    memo: dict[tuple[int, int], bytes] = {}
    for _ in range(25):  # the reference rehashes the whole tree for each proof
        size = rng.choice([256, 257, 65_536, 65_537, BIG, rng.randrange(1, BIG + 1)])
        index = rng.randrange(size)
        old = rng.randrange(size + 1)
        want = inclusion_proof(index, size, LEAVES)
        assert inclusion_proof_from_tiles(index, size, node_store()) == want
        assert inclusion_proof_from_tiles(index, size, node_store(), memo) == want
        assert consistency_proof_from_tiles(old, size, node_store(), memo) == \
            consistency_proof(old, size, LEAVES)
        assert root_from_tiles(old, node_store(), memo, tree_size=size) == \
            root_hash(LEAVES[:old])
    assert memo  # filled, and used on the way


def test_subtree_path_verifies_from_the_tile_hash() -> None:
    rng = random.Random(12)
    for _ in range(15):
        size = rng.randrange(256, BIG + 1)
        tile = rng.randrange(size >> 8)
        path = subtree_path_from_tiles(8, tile, size, node_store())
        assert path == inclusion_proof(tile * 256, size, LEAVES)[8:]
        verify_inclusion(root_hash(LEAVES[tile * 256 : tile * 256 + 256]), tile,
                         -(-size // 256), path, root_hash(LEAVES[:size]))
    with pytest.raises(TreeRangeError):
        subtree_path_from_tiles(8, 3, 1000, node_store())  # tile 0/3 is partial at 1000


class _NoReads:
    """A tile reader for proofs that must need none (everything is in the memo)."""

    def read_tiles(self, tiles: Sequence[Tile]) -> list[bytes]:
        raise AssertionError(f"read {[t.path for t in tiles]}")


def _read_slices(store: MemoryTileStore, slices: list[NodeSlice]) -> dict[tuple[int, int], bytes]:
    """What ``ledger.log.store.read_for_proof`` does in SQL (substring of the tile or of
    its stored nodes), over the in-memory store."""
    out = {}
    for piece in slices:
        data, nodes = store.read_tiles_and_nodes([piece.tile])[0]
        source = nodes if piece.in_nodes else data
        assert source is not None, piece
        out[piece.node] = hash_from_slice(piece,
                                          source[piece.offset : piece.offset + piece.length])
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.one_of(st.integers(1, BIG),
                                      st.sampled_from([1, 255, 256, 257, 65_536, BIG])))
def test_proof_slices_are_all_a_proof_needs(data: st.DataObject, size: int) -> None:
    """The bytes the slices name, and nothing else, make the same proofs as the tiles;
    with a memo that holds some hashes already, only the missing ones are named."""
    store = node_store()
    memo: dict[tuple[int, int], bytes] = {}
    for _ in range(3):  # the memo fills from one proof to the next
        index = data.draw(st.integers(0, size - 1))
        old = data.draw(st.one_of(st.integers(0, size), st.sampled_from([0, 1, size])))
        slices = inclusion_proof_slices(index, size, memo)
        assert not any(piece.node in memo for piece in slices)
        memo.update(_read_slices(store, slices))
        assert inclusion_proof_from_tiles(index, size, _NoReads(), memo) == \
            inclusion_proof_from_tiles(index, size, store)
        memo.update(_read_slices(store, consistency_proof_slices(old, size, memo)))
        proof, old_root = consistency_proof_and_old_root_from_tiles(old, size, _NoReads(), memo)
        assert proof == consistency_proof_from_tiles(old, size, store)
        assert old_root == root_from_tiles(old, store, tree_size=size)


def test_a_wrong_slice_length_is_refused() -> None:
    piece = inclusion_proof_slices(3, 300)[0]
    with pytest.raises(TileFormatError):
        hash_from_slice(piece, b"\0" * (piece.length + 1))
