"""Acceptance 2 of issue 3: our proofs, checkpoints and tiles verify with Go's own
transparency-log code (golang.org/x/mod/sumdb/tlog and sumdb/note), not with ours.

Needs the Debian packages ``golang-go`` and ``golang-golang-x-mod-dev`` (x/mod sources
under /usr/share/gocode). The Go checker in ``tlogcheck/`` is built once per session in
GOPATH mode, offline. The HTTP test serves a tlog-tiles directory from a local
``http.server`` on 127.0.0.1 in a thread that the fixture shuts down.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import random
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.merkle import (
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_hash,
)
from ledger.core.note import (
    Checkpoint,
    format_checkpoint,
    format_verifier_key,
    sign_checkpoint,
    sign_note,
)
from ledger.core.tiles import (
    MemoryTileStore,
    consistency_proof_from_tiles,
    encode_entry_bundle,
    entry_bundles_for_size,
    inclusion_proof_from_tiles,
    integrate,
    root_from_tiles,
)

GOPATH_XMOD = Path("/usr/share/gocode")
TLOG_SRC = GOPATH_XMOD / "src/golang.org/x/mod/sumdb/tlog"
CHECKER_SRC = Path(__file__).parent / "tlogcheck"
BUILD_HINT = (
    "apt-get install -y golang-go golang-golang-x-mod-dev; then "
    "GO111MODULE=off GOPATH=/usr/share/gocode:$TMP go build ./tests/interop/tlogcheck"
)

ORIGIN = "ledger.example/interop"
LOG_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
VKEY = format_verifier_key(ORIGIN, LOG_KEY.public_key())
TILED_SIZE = 70_000  # the spec's example: partial tiles at levels 0, 1 and 2


def b64(h: bytes) -> str:
    return base64.b64encode(h).decode()


@pytest.fixture(scope="session")
def tlogcheck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip(f"the go toolchain is not installed ({BUILD_HINT})")
    if not TLOG_SRC.is_dir():
        pytest.skip(f"golang.org/x/mod sources are missing at {TLOG_SRC} ({BUILD_HINT})")
    work = tmp_path_factory.mktemp("tlogcheck")
    binary = work / "tlogcheck"
    env = {
        # Go's default build cache ($HOME/.cache/go-build) makes rebuilds fast.
        **({} if os.environ.get("HOME") else {"GOCACHE": str(work / "gocache")}),
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": f"{GOPATH_XMOD}:{work / 'gopath'}",
        "GOFLAGS": "",
        "CGO_ENABLED": "0",
    }
    subprocess.run(
        [go, "build", "-o", str(binary), "."], cwd=CHECKER_SRC, env=env, check=True, timeout=300
    )
    return binary


def run_items(binary: Path, doc: dict[str, Any]) -> tuple[int, list[str]]:
    proc = subprocess.run(
        [str(binary)], input=json.dumps(doc).encode(), capture_output=True, timeout=120
    )
    return proc.returncode, proc.stdout.decode().splitlines()


@functools.cache
def tiled_log() -> tuple[
    list[bytes], MemoryTileStore, list[tuple[int, bytes]], list[dict[Any, bytes]]
]:
    """70,000 entries integrated in uneven batches: entries, store, (size, root) per
    batch, and the tiles each batch wrote (partial versions included)."""
    rng = random.Random(3)
    entries = [b"entry %d " % i + b"x" * rng.randrange(0, 40) for i in range(TILED_SIZE)]
    entries[5] = b""
    leaves = [leaf_hash(e) for e in entries]
    store, size = MemoryTileStore(), 0
    history, writes = [], []
    while size < TILED_SIZE:
        batch = leaves[size : size + rng.choice([1, 17, 256, 300, 5000, 20_000])]
        result = integrate(size, batch, store)
        store.write_tiles(result.tiles)
        writes.append(dict(result.tiles))
        size = result.size
        history.append((size, result.root))
    return entries, store, history, writes


def items_document() -> dict[str, Any]:
    entries, store, history, _ = tiled_log()
    leaves = [leaf_hash(e) for e in entries[:4096]]
    inclusion, consistency, checkpoints = [], [], []
    for size in (1, 2, 3, 7, 8, 255, 256, 257, 1000, 4096):
        root = root_hash(leaves[:size])
        for index in sorted({0, size // 2, size - 1}):
            inclusion.append(
                {
                    "name": f"mem-{index}-of-{size}",
                    "leaf_hash": b64(leaves[index]),
                    "index": index,
                    "size": size,
                    "root": b64(root),
                    "proof": [b64(p) for p in inclusion_proof(index, size, leaves)],
                }
            )
        for m in sorted({1, size // 3 or 1, size - 1 or 1, size}):
            consistency.append(
                {
                    "name": f"mem-{m}-to-{size}",
                    "old_size": m,
                    "new_size": size,
                    "old_root": b64(root_hash(leaves[:m])),
                    "new_root": b64(root),
                    "proof": [b64(p) for p in consistency_proof(m, size, leaves)],
                }
            )
    tiled_leaves = [leaf_hash(e) for e in entries]
    for size, root in history[-3:]:
        for index in (0, 255, 256, 65_535, 65_536, size - 1):
            if index < size:
                inclusion.append(
                    {
                        "name": f"tiles-{index}-of-{size}",
                        "leaf_hash": b64(tiled_leaves[index]),
                        "index": index,
                        "size": size,
                        "root": b64(root),
                        "proof": [b64(p) for p in inclusion_proof_from_tiles(index, size, store)],
                    }
                )
        for m, old_root in history[:-1:3]:
            if m <= size:
                consistency.append(
                    {
                        "name": f"tiles-{m}-to-{size}",
                        "old_size": m,
                        "new_size": size,
                        "old_root": b64(old_root),
                        "new_root": b64(root),
                        "proof": [b64(p) for p in consistency_proof_from_tiles(m, size, store)],
                    }
                )
    for size, root in history[::4]:
        cp = Checkpoint(ORIGIN, size, root)
        checkpoints.append(
            {
                "name": f"checkpoint-{size}",
                "note": sign_checkpoint(cp, ORIGIN, LOG_KEY).decode(),
                "verifier_key": VKEY,
                "origin": ORIGIN,
                "size": size,
                "root": b64(root),
            }
        )
    # Extension lines and an unknown cosigner are allowed.
    size, root = history[-1]
    cp = Checkpoint(ORIGIN, size, root, ("extension line",))
    note = sign_checkpoint(cp, ORIGIN, LOG_KEY)
    witness = Ed25519PrivateKey.from_private_bytes(bytes(32))
    note += sign_note(format_checkpoint(cp), "witness.example", witness).split(b"\n\n")[1]
    checkpoints.append(
        {
            "name": "cosigned-with-extension",
            "note": note.decode(),
            "verifier_key": VKEY,
            "origin": ORIGIN,
            "size": size,
            "root": b64(root),
        }
    )
    return {"inclusion": inclusion, "consistency": consistency, "checkpoints": checkpoints}


def test_go_verifies_our_proofs_and_checkpoints(tlogcheck: Path) -> None:
    doc = items_document()
    code, lines = run_items(tlogcheck, doc)
    total = sum(len(v) for v in doc.values())
    assert code == 0, "\n".join(line for line in lines if line.startswith("FAIL"))
    assert len(lines) == total
    assert all(line.startswith("OK ") for line in lines)
    assert total > 80


def _flip(h: str, bit: int = 0) -> str:
    raw = bytearray(base64.b64decode(h))
    raw[bit // 8] ^= 1 << (bit % 8)
    return b64(bytes(raw))


def test_go_rejects_tampered_items(tlogcheck: Path) -> None:
    doc = items_document()
    inc = next(i for i in doc["inclusion"] if i["size"] == TILED_SIZE and i["index"] == 65_536)
    con = next(c for c in doc["consistency"] if c["new_size"] == TILED_SIZE and c["proof"])
    cp = doc["checkpoints"][-2]
    tampered: dict[str, list[dict[str, Any]]] = {
        "inclusion": [
            {
                **inc,
                "name": "flipped-proof-bit",
                "proof": [_flip(inc["proof"][0], 77), *inc["proof"][1:]],
            },
            {**inc, "name": "flipped-root-bit", "root": _flip(inc["root"], 200)},
            {**inc, "name": "flipped-leaf-bit", "leaf_hash": _flip(inc["leaf_hash"], 3)},
            {**inc, "name": "flipped-index-bit", "index": inc["index"] ^ 2},
            {**inc, "name": "trailing-hash", "proof": [*inc["proof"], inc["root"]]},
            {**inc, "name": "missing-hash", "proof": inc["proof"][:-1]},
        ],
        "consistency": [
            {
                **con,
                "name": "flipped-proof-bit",
                "proof": [*con["proof"][:-1], _flip(con["proof"][-1], 9)],
            },
            {**con, "name": "flipped-old-root", "old_root": _flip(con["old_root"])},
            {**con, "name": "trailing-hash", "proof": [*con["proof"], con["new_root"]]},
            {**con, "name": "missing-hash", "proof": con["proof"][1:]},
            {**con, "name": "old-size-plus-one", "old_size": con["old_size"] + 1},
        ],
        "checkpoints": [
            {
                **cp,
                "name": "size-edited",
                "note": cp["note"].replace(f"\n{cp['size']}\n", f"\n{cp['size'] + 1}\n", 1),
                "size": cp["size"] + 1,
            },
            {
                **cp,
                "name": "other-key",
                "verifier_key": format_verifier_key(
                    ORIGIN, Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key()
                ),
            },
            {**cp, "name": "other-origin", "origin": "someone.else/log"},
            {**cp, "name": "python-and-go-disagree", "size": cp["size"] - 1},
        ],
    }
    code, lines = run_items(tlogcheck, tampered)
    assert code == 1
    want = sum(len(v) for v in tampered.values())
    assert len(lines) == want and all(line.startswith("FAIL ") for line in lines), lines


def test_go_shares_the_size_ambiguity_of_rfc9162(tlogcheck: Path) -> None:
    """Our verifier and Go's accept the size-5 proof of leaf 0 at size 7 (same shape):
    the size is bound by the signed checkpoint, in both implementations."""
    leaves = [leaf_hash(b"%d" % i) for i in range(5)]
    doc = {
        "inclusion": [
            {
                "name": "size-5-proof-at-size-7",
                "leaf_hash": b64(leaves[0]),
                "index": 0,
                "size": 7,
                "root": b64(root_hash(leaves)),
                "proof": [b64(p) for p in inclusion_proof(0, 5, leaves)],
            }
        ],
        "consistency": [],
        "checkpoints": [],
    }
    assert run_items(tlogcheck, doc)[0] == 0


@pytest.fixture(scope="module")
def tile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A static tlog-tiles directory made by our core, served on 127.0.0.1."""
    entries, _, history, writes = tiled_log()
    root_dir = tmp_path_factory.mktemp("tlog")
    for tiles in writes:  # every version: old partial tiles stay, as in a static log
        for tile, data in tiles.items():
            path = root_dir / tile.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    size, root = history[-1]
    for bundle in entry_bundles_for_size(size):
        first = bundle.index * 256
        path = root_dir / bundle.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_entry_bundle(entries[first : first + bundle.width]))
    (root_dir / "checkpoint").write_bytes(
        sign_checkpoint(Checkpoint(ORIGIN, size, root), ORIGIN, LOG_KEY)
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(root_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root_dir
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def run_tiles(binary: Path, url: str, vkey: str = VKEY) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "tiles", url, vkey, ORIGIN], capture_output=True, text=True, timeout=300
    )


def test_go_reads_our_tiled_log_over_http(tlogcheck: Path, tile_server: tuple[str, Path]) -> None:
    url, _ = tile_server
    _, store, history, _ = tiled_log()
    assert root_from_tiles(TILED_SIZE, store) == history[-1][1]
    proc = run_tiles(tlogcheck, url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK tiles size={TILED_SIZE} " in proc.stdout
    assert f"entries_proved={TILED_SIZE} " in proc.stdout


@pytest.mark.parametrize(
    "victim", ["tile/0/100", "tile/1/001.p/17", "tile/entries/100", "tile/0/273.p/112"]
)
def test_go_rejects_a_tampered_tile(
    tlogcheck: Path, tile_server: tuple[str, Path], victim: str
) -> None:
    url, root_dir = tile_server
    path = root_dir / victim
    original = path.read_bytes()
    tampered = bytearray(original)
    tampered[40] ^= 0x01
    path.write_bytes(bytes(tampered))
    try:
        proc = run_tiles(tlogcheck, url)
    finally:
        path.write_bytes(original)
    assert proc.returncode == 1
    assert proc.stdout.startswith("FAIL tiles:"), proc.stdout


def test_go_rejects_a_checkpoint_signed_by_another_key(
    tlogcheck: Path, tile_server: tuple[str, Path]
) -> None:
    url, _ = tile_server
    other = format_verifier_key(
        ORIGIN, Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key()
    )
    proc = run_tiles(tlogcheck, url, other)
    assert proc.returncode == 1
    assert "note has no verifiable signatures" in proc.stdout
