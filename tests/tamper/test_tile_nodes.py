"""Stored subtree hashes (``tile_nodes``, migration 0014) are derived data an insider can
edit: proofs and exports built from them are verified against the signed checkpoint
before they leave the ledger, so an edit is a refusal (``log_integrity``), never a wrong
proof, and ``ledger audit`` names the tile. A poisoned process cache is worked around;
a checkpoint whose columns disagree with its signed note is refused too.

The log: 600 real signed envelopes (two full level-0 tiles and a partial one), each
integration a checkpoint, superuser edits with the append-only triggers off.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine

from ledger.core.bundle import verify_lines
from ledger.core.keys import generate_private_key, private_pem
from ledger.core.merkle import verify_inclusion
from ledger.core.note import (
    Checkpoint,
    NoteVerifier,
    format_verifier_key,
    parse_verifier_key,
    sign_checkpoint,
)
from ledger.core.tiles import tile_nodes
from ledger.db.session import make_engine, session_scope
from ledger.errors import StoredTreeMismatch
from ledger.log import proofs
from ledger.log.audit import audit
from ledger.log.export import Selection, bundle_chunks, bundle_lines, write_bundle
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.log.store import FLAT_TILE_BYTES, SUBTREES
from ledger.replay.records import Signer
from ledger.services import ingest
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import run_server, signed, statement

ORIGIN = "ledger.test/tile-nodes"
N = 600


@dataclass
class Log:
    url: str
    pg: str
    engine: Engine
    signer: LogSigner
    service: Signer
    keys: dict[str, str]
    size: int


@pytest.fixture
def log(db_url: str) -> Iterator[Log]:
    keys, producer = provision(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=2)
    signer = LogSigner(ORIGIN, generate_private_key())
    service = Signer(generate_private_key(), "ledger", "ledger-service")
    with session_scope(engine) as s:
        signer.ensure_registered(s)
        service.ensure_registered(s)
        for start in range(0, N, 200):
            items = [signed(statement(f"nodes-{i}"), producer) for i in range(start, start + 200)]
            assert all(r.status == 201 for r in ingest.ingest(s, items, settings))
    integrate_all(engine, signer, max_entries=150)
    pg = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(pg) as conn:  # every integration stored the nodes of new full tiles
        assert conn.execute("SELECT count(*) FROM tile_nodes").fetchone() == (2,)
        row = conn.execute("SELECT max(tree_size) FROM checkpoints").fetchone()
    assert row is not None and 512 < row[0] < 768
    SUBTREES.forget_all()
    proofs.TILE_PATHS.forget()
    yield Log(db_url, pg, engine, signer, service, keys, row[0])
    SUBTREES.forget_all()
    proofs.TILE_PATHS.forget()
    engine.dispose()


def superuser(log: Log, sql: str, params: tuple[object, ...] = ()) -> None:
    with psycopg.connect(log.pg) as conn:
        conn.execute("SET session_replication_role = replica")  # triggers off
        conn.execute(sql, params)


def flip_node(log: Log, tile: int, node: int) -> None:
    """Flip one bit of hash ``node`` (0..254) in tile_nodes row (0, tile)."""
    superuser(log, "UPDATE tile_nodes SET nodes = overlay(nodes placing "
              "set_byte(substring(nodes from %s for 1), 0, "
              "get_byte(substring(nodes from %s for 1), 0) # 1) from %s for 1) "
              "WHERE level = 0 AND idx = %s", (node * 32 + 1,) * 3 + (tile,))


def inclusion(log: Log, index: int) -> proofs.InclusionReceipt:
    with session_scope(log.engine) as s:
        return proofs.inclusion(s, index)


def export(log: Log) -> list[bytes]:
    return b"".join(bundle_lines(log.engine, Selection(), log.service)).split(b"\n")[:-1]


def test_clean_log_serves_verified_proofs_and_exports(log: Log) -> None:
    """The control: proofs from the stored nodes verify, the export verifies offline,
    the audit passes."""
    for index in (0, 1, 255, 256, 300, 511, 512, log.size - 1):
        r = inclusion(log, index)
        verify_inclusion(r.leaf_hash, index, log.size, r.proof, r.checkpoint.root_hash)
    lines = export(log)
    pinned = [parse_verifier_key(format_verifier_key(ORIGIN, log.signer.key.public_key()))]
    assert verify_lines(lines, pinned_log_keys=pinned).records >= N
    report = audit(log.engine, ORIGIN)
    assert report.ok, report.problems


@pytest.mark.parametrize("node", [0, 127, 200, 254], ids=["level1", "level1-last",
                                                           "level3", "tile-hash"])
def test_edited_stored_node_is_refused_and_audited(log: Log, node: int) -> None:
    """Node 254 is the tile's own hash: no proof carries it (the tile above holds it),
    but an export checks the path above the tile from it."""
    flip_node(log, 0, node)
    # every entry whose proof uses the edited hash is refused; which ones depends on the
    # node, so try the whole tile: some must be refused, none may get a wrong proof
    refused = 0
    for index in range(256):
        try:
            r = inclusion(log, index)
        except StoredTreeMismatch as exc:
            assert "ledger audit" in exc.message
            refused += 1
            continue
        verify_inclusion(r.leaf_hash, index, log.size, r.proof, r.checkpoint.root_hash)
    assert (refused > 0) == (node != 254), refused
    with pytest.raises(StoredTreeMismatch):
        export(log)
    report = audit(log.engine, ORIGIN)
    assert not report.ok
    assert report.first_bad_index == 0
    assert any("tile/0/000" in p and "tile_nodes" in p for p in report.problems), \
        report.problems


def test_export_of_a_dense_tile_does_not_use_its_stored_nodes(log: Log) -> None:
    """Where most of a tile is exported its nodes are recomputed from its leaves: an
    edited row there changes nothing in the bundle (the audit still names it)."""
    clean = export(log)
    flip_node(log, 1, 3)
    assert export(log)[1:] == clean[1:]  # the records; the header has its own time
    assert audit(log.engine, ORIGIN).first_bad_index == 256


def test_edited_tile_is_refused(log: Log) -> None:
    """The tile row itself (not only its nodes): a leaf hash changed in tile 0/000 (one
    bit flipped: writing a fixed byte changed nothing when leaf 3's first byte was it,
    one run in 256)."""
    superuser(log, "UPDATE tiles SET data = set_byte(data, 96, get_byte(data, 96) # 1) "
              "WHERE level = 0 AND idx = 0")
    with pytest.raises(StoredTreeMismatch):
        inclusion(log, 2)  # its sibling's proof carries the edited leaf hash
    with pytest.raises(StoredTreeMismatch):
        export(log)
    assert not audit(log.engine, ORIGIN).ok


def test_poisoned_cache_is_dropped(log: Log) -> None:
    """A wrong hash in the process-wide subtree cache (read before a repair, say): the
    proof fails its check, the cache is dropped, the retry from the database is served."""
    good = inclusion(log, 300)
    memo = SUBTREES.for_scope(_scope(log))
    assert memo
    for key in list(memo):
        memo[key] = bytes(32)
    again = inclusion(log, 300)
    assert again.proof == good.proof


def _scope(log: Log) -> str:
    with psycopg.connect(log.pg) as conn:
        info = conn.info
        return f"{info.host}:{info.port}/{info.dbname}"


def test_poisoned_tile_cache_is_dropped(log: Log) -> None:
    """The full tiles a proof read whole are kept for the next proofs inside them: a
    wrong byte there fails the proof's check, the cache is dropped, the retry from the
    database is served. (A process's first proof reads the tiles it needs apart: it does
    not know the tree's size yet.)"""
    inclusion(log, log.size - 1)
    good = {index: inclusion(log, index) for index in (3, 300)}
    scope = _scope(log)
    kept = [(level, idx) for level, idx in ((0, 0), (0, 1)) if SUBTREES.tile(scope, level, idx)]
    assert kept == [(0, 0), (0, 1)]
    for level, idx in kept:
        SUBTREES.keep_tile(scope, level, idx, bytes(FLAT_TILE_BYTES))
    for index, receipt in good.items():
        assert inclusion(log, index).proof == receipt.proof
    assert SUBTREES.tile(scope, 0, 1) != bytes(FLAT_TILE_BYTES)  # read again


def test_a_kept_tile_is_not_read_again(log: Log) -> None:
    """Proofs inside a kept full tile take its hashes from the process, not the row: an
    edit made after it was read changes no proof (a full tile never changes; ``ledger
    audit`` names the row). A process that had not read it refuses."""
    inclusion(log, log.size - 1)  # the process learns the size
    before = inclusion(log, 257)
    flip_node(log, 1, 0)  # the hash of leaves 256 and 257: in the proofs of 258 and 259
    after = inclusion(log, 258)
    verify_inclusion(after.leaf_hash, 258, log.size, after.proof, before.checkpoint.root_hash)
    SUBTREES.forget_all()
    with pytest.raises(StoredTreeMismatch):
        inclusion(log, 258)


def test_a_full_tile_without_stored_nodes_is_proved_from_its_leaves(log: Log) -> None:
    inclusion(log, log.size - 1)
    good = inclusion(log, 400)
    SUBTREES.forget_all()
    superuser(log, "DELETE FROM tile_nodes WHERE level = 0 AND idx = 1")
    inclusion(log, log.size - 1)
    assert inclusion(log, 400).proof == good.proof
    with psycopg.connect(log.pg) as conn:
        row = conn.execute("SELECT data FROM tiles WHERE level = 0 AND idx = 1").fetchone()
    assert row is not None
    assert SUBTREES.tile(_scope(log), 0, 1) == bytes(row[0]) + tile_nodes(bytes(row[0]))


def test_checkpoint_columns_must_match_the_signed_note(log: Log) -> None:
    superuser(log, "UPDATE checkpoints SET root_hash = sha256('x'::bytea) "
              "WHERE tree_size = %s", (log.size,))
    with pytest.raises(StoredTreeMismatch, match="signed note"):
        inclusion(log, 5)


def test_http_refusal_is_a_problem(log: Log, tmp_path: Path) -> None:
    flip_node(log, 0, 0)  # hash of leaves 0 and 1: in the proofs of 2 and 3
    with run_server(log.url, extra_env={"LEDGER_LOG_NAME": ORIGIN},
                    log_dir=tmp_path) as srv:
        srv.keys = log.keys
        with srv.client("reviewer") as c:
            bad = c.get("/v1/log/proof", params={"index": 2})
            ok = c.get("/v1/log/proof", params={"index": 300})
    assert bad.status_code == 500
    assert bad.headers["content-type"].startswith("application/problem+json")
    assert bad.json()["code"] == "log_integrity"
    assert ok.status_code == 200
    body = ok.json()
    verify_inclusion(base64.b64decode(body["leaf_hash"]), 300, log.size,
                     [base64.b64decode(h) for h in body["inclusion_proof"]],
                     base64.b64decode(body["root_hash"]))


def forge_latest_note(log: Log) -> None:
    """Replace the latest checkpoint's note by one for the same size and root signed by
    a key that is not the log's (the columns still agree with its text)."""
    with psycopg.connect(log.pg) as conn:
        row = conn.execute("SELECT root_hash FROM checkpoints WHERE tree_size = %s",
                           (log.size,)).fetchone()
    assert row is not None
    forged = sign_checkpoint(Checkpoint(ORIGIN, log.size, bytes(row[0])), ORIGIN,
                             generate_private_key())
    superuser(log, "UPDATE checkpoints SET note = %s WHERE tree_size = %s",
              (forged, log.size))


def test_with_the_log_keys_a_checkpoint_not_signed_by_them_is_refused(log: Log) -> None:
    """The proof routes hold the log's key from outside the database: a note it did
    not sign is refused, though its text matches the columns and the tree. What was
    verified is remembered by the note's exact bytes, so a note changed after it was
    checked is checked again."""
    keys = (log.signer.verifier(),)
    other: tuple[NoteVerifier, ...] = (LogSigner(ORIGIN, generate_private_key()).verifier(),)
    with session_scope(log.engine) as s:
        good = proofs.inclusion(s, 5, log_keys=keys)  # verified and remembered
        proofs.consistency(s, 300, None, log_keys=keys)
        with pytest.raises(StoredTreeMismatch, match="not a checkpoint signed by the log"):
            proofs.inclusion(s, 5, log_keys=other)
    forge_latest_note(log)
    with session_scope(log.engine) as s:
        with pytest.raises(StoredTreeMismatch, match="not a checkpoint signed by the log"):
            proofs.inclusion(s, 5, log_keys=keys)
        with pytest.raises(StoredTreeMismatch, match="not a checkpoint signed by the log"):
            proofs.consistency(s, 300, None, log_keys=keys)
        # without keys the note is served as it is, for its reader to check
        assert proofs.inclusion(s, 5).proof == good.proof


def test_http_proofs_check_the_note_with_the_log_key_file(log: Log, tmp_path: Path) -> None:
    key_file = tmp_path / "log.pem"
    key_file.write_bytes(private_pem(log.signer.key))
    env = {"LEDGER_LOG_NAME": ORIGIN, "LEDGER_LOG_KEY_FILE": str(key_file),
           "LEDGER_INTEGRATE_IN_API": "false"}
    with run_server(log.url, extra_env=env, log_dir=tmp_path) as srv:
        srv.keys = log.keys
        with srv.client("reviewer") as c:
            assert c.get("/v1/log/proof", params={"index": 7}).status_code == 200
            assert c.get("/v1/log/consistency", params={"from": 300}).status_code == 200
            forge_latest_note(log)
            bad = c.get("/v1/log/proof", params={"index": 7})
            bad_consistency = c.get("/v1/log/consistency", params={"from": 300})
    for r in (bad, bad_consistency):
        assert r.status_code == 500, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["code"] == "log_integrity"


def test_export_in_chunks_and_to_a_file_is_the_export_by_line(log: Log,
                                                              tmp_path: Path) -> None:
    lines = export(log)
    chunks = list(bundle_chunks(log.engine, Selection(), log.service))
    assert chunks[0].count(b"\n") == 1 and chunks[0].endswith(b"\n")  # the header alone
    assert b"".join(chunks[1:]).split(b"\n")[:-1] == lines[1:]
    out = tmp_path / "bundle.jsonl"
    with out.open("wb") as fh:
        fh.write(b"before\n")  # written from where the file is
        assert write_bundle(log.engine, Selection(), fh, log.service) == len(lines) - 1
        fh.write(b"after\n")
    written = out.read_bytes().split(b"\n")
    assert written[0] == b"before" and written[-2:] == [b"after", b""]
    assert written[2:-2] == lines[1:]
    pinned = [parse_verifier_key(format_verifier_key(ORIGIN, log.signer.key.public_key()))]
    assert verify_lines(written[1:-2], pinned_log_keys=pinned).records == len(lines) - 1


def test_proofs_from_what_earlier_proofs_proved_are_the_full_proofs(
        log: Log, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a proof went through a full tile, the next proofs in that (kept) tile take
    their 8 in-tile siblings from it and the path above from what was proved
    (``proofs.TilePaths``), without building anything: the same proofs, for every entry,
    as built from the tiles, each verifying against the signed root; entries of the
    partial tile are built as before."""
    from ledger.core import tiles

    inclusion(log, log.size - 1)                       # the process learns the size
    built = {i: inclusion(log, i) for i in range(log.size)}   # built (and learned)
    for i, r in built.items():
        verify_inclusion(r.leaf_hash, i, log.size, r.proof, r.checkpoint.root_hash)
    calls: list[int] = []
    real = proofs.inclusion_proof_from_tiles

    def counted(index: int, *args: object, **kwargs: object) -> list[bytes]:
        calls.append(index)
        return real(index, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(proofs, "inclusion_proof_from_tiles", counted)
    for i in range(log.size):
        assert inclusion(log, i).proof == built[i].proof, i
    full = log.size >> tiles.TILE_HEIGHT << tiles.TILE_HEIGHT
    assert calls == list(range(full, log.size))         # only the partial tile's entries


def consistency(log: Log, old_size: int) -> dict[str, object]:
    with session_scope(log.engine) as s:
        return proofs.consistency(s, old_size, None)


def test_consistency_proofs_from_what_earlier_proofs_proved_are_the_full_proofs(
        log: Log, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consistency proof from m goes through the tile of entry m - 1: once that tile is
    kept and its path above known (``proofs.TilePaths``, here learned from the
    consistency proofs themselves), the proof is made from them, every one the same as
    built from the tiles and verified against the signed roots (the old one too, where
    a checkpoint of size m exists); sizes whose entry m - 1 is in the partial tile, 0
    and the tree's size are built as before."""
    from ledger.core import tiles
    from ledger.core.merkle import verify_consistency

    consistency(log, 1)                                  # the process learns the size
    with monkeypatch.context() as m:
        m.setattr(proofs.TILE_PATHS, "consistency", lambda *_args: None)
        built = {n: consistency(log, n) for n in range(log.size + 1)}  # built, learned
    with psycopg.connect(log.pg) as conn:
        signed_sizes = {r[0] for r in conn.execute("SELECT tree_size FROM checkpoints")}
    assert any(built[n]["old_root_hash"] for n in range(1, 512)), signed_sizes
    calls: list[int] = []
    real = proofs.consistency_proof_and_old_root_from_tiles

    def counted(old_size: int, *args: object, **kwargs: object) -> tuple[list[bytes], bytes]:
        calls.append(old_size)
        return real(old_size, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(proofs, "consistency_proof_and_old_root_from_tiles", counted)
    new_root = base64.b64decode(str(built[0]["new_root_hash"]))
    for n in range(log.size + 1):
        got = consistency(log, n)
        assert got == built[n], n
        assert (got["old_root_hash"] is not None) == (n in signed_sizes and n > 0), n
        if got["old_root_hash"] is not None:
            verify_consistency(n, log.size, [base64.b64decode(str(h)) for h in got["proof"]],
                               base64.b64decode(str(got["old_root_hash"])), new_root)
    full = log.size >> tiles.TILE_HEIGHT << tiles.TILE_HEIGHT
    assert calls == [0, *range(full + 1, log.size + 1)]


def test_a_poisoned_kept_tile_gives_the_consistency_proof_from_the_database(
        log: Log) -> None:
    """The quick consistency proof verifies what it took from the kept tile: a wrong
    byte there fails that check, the database's kept tiles and hashes are dropped and
    the proof built from the database is served."""
    consistency(log, 1)
    good = {n: consistency(log, n) for n in (3, 300, 301, 512)}  # 512: above the tile
    scope = _scope(log)
    for idx in (0, 1):
        assert SUBTREES.tile(scope, 0, idx) is not None
        SUBTREES.keep_tile(scope, 0, idx, bytes(FLAT_TILE_BYTES))
    for n, proof in good.items():
        assert consistency(log, n) == proof, n
    assert SUBTREES.tile(scope, 0, 1) != bytes(FLAT_TILE_BYTES)  # read again


def test_an_exports_later_kinds_reuse_a_verified_path_only_for_the_same_tile(
        log: Log, monkeypatch: pytest.MonkeyPatch) -> None:
    """An export goes through the tiles once per kind: the path above a tile, verified
    on the first pass, serves the later ones only while the tile hashes to the same
    value; an edit in between is refused, never served."""
    from ledger.log.store import latest_checkpoint

    calls: list[int] = []
    real = proofs.subtree_path_from_tiles

    def counted(level: int, index: int, *args: object, **kwargs: object) -> list[bytes]:
        calls.append(index)
        return real(level, index, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(proofs, "subtree_path_from_tiles", counted)
    with psycopg.connect(log.pg) as conn, conn.cursor(binary=True) as cur:
        cp = latest_checkpoint(cur)
        assert cp is not None
        bundle = proofs.BundleProofs(cur, cp)
        first = {i: bundle.record_suffix(i) for i in (3, 300)}   # first kind
        assert calls == [0, 1]
        assert {i: bundle.record_suffix(i) for i in (3, 300)} == first  # the next kind
        assert calls == [0, 1]
        flip_node(log, 1, 254)  # tile 1's own hash, as its stored nodes say
        assert bundle.record_suffix(4).startswith(b',"inclusion_proof":["')
        with pytest.raises(StoredTreeMismatch):
            bundle.record_suffix(300)
        assert calls == [0, 1, 1]


def test_a_planted_old_checkpoint_is_refused_by_the_quick_consistency_proof(
        log: Log) -> None:
    """Where a checkpoint of the old size exists, the quick proof must lead to its signed
    root too: a planted one (not the tree's root) gives no quick proof, and the full path
    refuses it."""
    consistency(log, 1)
    for n in (300, 302, 303):
        consistency(log, n)                   # tile 1 and its path are known
    planted = sign_checkpoint(Checkpoint(ORIGIN, 301, bytes(32)), ORIGIN,
                              generate_private_key())
    superuser(log, "INSERT INTO checkpoints (tree_size, root_hash, note) "
              "VALUES (301, %s, %s)", (bytes(32), planted))
    with pytest.raises(StoredTreeMismatch):
        consistency(log, 301)
    assert consistency(log, 302)["old_root_hash"] is None  # its neighbours still served


@pytest.mark.parametrize("index", [-1, -256, -257])
def test_an_exports_proof_of_a_negative_index_is_a_range_error(log: Log, index: int) -> None:
    """An index below 0 (a row an insider stored) is refused by its range, also as the
    first index asked for (tile -1 was the 'no tile yet' marker)."""
    from ledger.core.errors import TreeRangeError
    from ledger.log.store import latest_checkpoint

    with psycopg.connect(log.pg) as conn, conn.cursor(binary=True) as cur:
        cp = latest_checkpoint(cur)
        assert cp is not None
        with pytest.raises(TreeRangeError):
            proofs.BundleProofs(cur, cp).record_suffix(index)
