"""The transparency log served by a real `ledger serve`: receipts, proofs, tiles and
checkpoints, checked by our verifiers and by Go's sumdb/tlog + sumdb/note."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.core.keys import generate_private_key, private_pem
from ledger.core.logentry import log_entry_bytes
from ledger.core.merkle import leaf_hash, verify_consistency, verify_inclusion
from ledger.core.note import NoteVerifier, open_checkpoint, parse_verifier_key
from ledger.core.tiles import decode_entry_bundle
from tests.conftest import provision
from tests.helpers import ApiServer, run_server, signed, statement
from tests.interop.test_go_tlog import run_items, tlogcheck  # noqa: F401 - fixture

ORIGIN = "ledger.test/log"


@pytest.fixture(scope="module")
def log_api(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    keys, producer = provision(module_db_url)
    d = tmp_path_factory.mktemp("log")
    key_file = d / "log.pem"
    key_file.write_bytes(private_pem(generate_private_key()))
    env = {"LEDGER_LOG_KEY_FILE": str(key_file), "LEDGER_LOG_NAME": ORIGIN,
           "LEDGER_CHECKPOINT_SINK_DIR": str(d / "sink"), "LEDGER_INTEGRATE_INTERVAL_MS": "50"}
    with run_server(module_db_url, extra_env=env, log_dir=d) as server:
        server.keys = keys
        server.producer = producer  # type: ignore[attr-defined]
        server.sink = d / "sink"  # type: ignore[attr-defined]
        yield server


def _verifier(api: ApiServer) -> NoteVerifier:
    body = httpx.get(api.base_url + "/v1/log/checkpoint").json()
    assert body["origin"] == ORIGIN
    return parse_verifier_key(body["verifier_keys"][0])


def _ingest(api: ApiServer, n: int, *, wait: bool = False) -> dict[str, Any]:
    envs = [signed(statement(prompt_len=4, output_len=2), api.producer)  # type: ignore[attr-defined]
            for _ in range(n)]
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes/batch", params={"wait": wait, "timeout": 20},
                   json={"envelopes": envs})
    assert r.status_code == 200, r.text
    return r.json()


def check_receipt(receipt: dict[str, Any], verifier: NoteVerifier) -> None:
    cp = open_checkpoint(receipt["checkpoint"].encode(), [verifier], origin=ORIGIN)
    assert cp.size == receipt["tree_size"]
    entry = base64.b64decode(receipt["entry"])
    verify_inclusion(leaf_hash(entry), receipt["log_index"], cp.size,
                     [base64.b64decode(h) for h in receipt["inclusion_proof"]], cp.root_hash)


def test_single_ingest_with_wait_returns_a_self_contained_receipt(log_api: ApiServer) -> None:
    st = statement()
    env = signed(st, log_api.producer)  # type: ignore[attr-defined]
    with log_api.client("ingester") as c:
        r = c.post("/v1/envelopes", params={"wait": True, "timeout": 20}, json=env)
    assert r.status_code == 201, r.text
    receipt = r.json()["receipt"]
    assert receipt is not None and receipt["log_index"] == r.json()["log_index"]
    check_receipt(receipt, _verifier(log_api))
    # the entry commits to exactly the stored DSSE bytes
    with log_api.client("reviewer") as c:
        raw = c.get(f"/v1/envelopes/{st['predicate']['request_id']}").content
    dsse_bytes = raw[len(b'{"dsse":'):raw.index(b',"index":')]
    want = log_entry_bytes("envelope", st["predicate"]["request_id"],
                           hashlib.sha256(dsse_bytes).hexdigest())
    assert base64.b64decode(receipt["entry"]) == want
    # and the proof endpoint gives the same answer later
    with log_api.client("auditor") as c:
        proof = c.get(f"/v1/envelopes/{st['predicate']['request_id']}/proof").json()
    check_receipt(proof, _verifier(log_api))


def test_batch_receipts_and_go_verifies_proofs_and_checkpoints(
        log_api: ApiServer, tlogcheck: Path) -> None:  # noqa: F811
    first = _ingest(log_api, 300, wait=True)
    second = _ingest(log_api, 300, wait=True)
    verifier = _verifier(log_api)
    vkey = json.loads(httpx.get(log_api.base_url + "/v1/log/checkpoint").text)["verifier_keys"][0]
    items: dict[str, list[dict[str, Any]]] = {"inclusion": [], "consistency": [],
                                              "checkpoints": []}
    for res in first["results"][::37] + second["results"][::41]:
        rc = res["receipt"]
        check_receipt(rc, verifier)
        items["inclusion"].append({
            "name": f"receipt-{rc['log_index']}", "leaf_hash": rc["leaf_hash"],
            "index": rc["log_index"], "size": rc["tree_size"], "root": rc["root_hash"],
            "proof": rc["inclusion_proof"]})
        cp = open_checkpoint(rc["checkpoint"].encode(), [verifier], origin=ORIGIN)
        items["checkpoints"].append({
            "name": f"checkpoint-{cp.size}", "note": rc["checkpoint"], "verifier_key": vkey,
            "origin": ORIGIN, "size": cp.size, "root": rc["root_hash"]})
    old = first["results"][-1]["receipt"]
    with httpx.Client(base_url=log_api.base_url) as c:
        cons = c.get("/v1/log/consistency", params={"from": old["tree_size"]}).json()
    assert cons["old_checkpoint"] == old["checkpoint"]
    verify_consistency(cons["from"], cons["to"], [base64.b64decode(h) for h in cons["proof"]],
                       base64.b64decode(cons["old_root_hash"]),
                       base64.b64decode(cons["new_root_hash"]))
    items["consistency"].append({
        "name": "served-consistency", "old_size": cons["from"], "new_size": cons["to"],
        "old_root": cons["old_root_hash"], "new_root": cons["new_root_hash"],
        "proof": cons["proof"]})
    code, lines = run_items(tlogcheck, items)
    assert code == 0, lines
    assert all(line.startswith("OK") for line in lines)
    # a flipped hash in a served proof is rejected by Go too
    bad = json.loads(json.dumps(items))
    h = bytearray(base64.b64decode(bad["inclusion"][0]["proof"][0]))
    h[0] ^= 1
    bad["inclusion"][0]["proof"][0] = base64.b64encode(bytes(h)).decode()
    assert run_items(tlogcheck, bad)[0] != 0


def test_go_reads_the_live_log_over_tlog_tiles(log_api: ApiServer, tlogcheck: Path) -> None:  # noqa: F811
    _ingest(log_api, 50, wait=True)
    vkey = httpx.get(log_api.base_url + "/v1/log/checkpoint").json()["verifier_keys"][0]
    size = int(httpx.get(log_api.base_url + "/log/checkpoint").text.split("\n")[1])
    proc = subprocess.run([str(tlogcheck), "tiles", log_api.base_url + "/log", vkey, ORIGIN],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK tiles" in proc.stdout
    proved = int(proc.stdout.split("entries_proved=")[1].split()[0])
    assert proved >= size


def test_tile_paths_and_errors(log_api: ApiServer) -> None:
    _ingest(log_api, 260, wait=True)
    with httpx.Client(base_url=log_api.base_url) as c:
        note = c.get("/log/checkpoint")
        assert note.status_code == 200 and note.headers["cache-control"] == "no-cache"
        size = int(note.text.split("\n")[1])
        full = c.get("/log/tile/0/000")
        assert full.status_code == 200 and len(full.content) == 256 * 32
        assert "immutable" in full.headers["cache-control"]
        partial = c.get("/log/tile/0/000.p/10")
        assert partial.content == full.content[: 10 * 32]
        bundle = c.get("/log/tile/entries/000")
        entries = decode_entry_bundle(bundle.content, 256)
        assert json.loads(entries[0])["kind"] == "envelope"
        assert [leaf_hash(e) for e in entries] == [full.content[i * 32:(i + 1) * 32]
                                                    for i in range(256)]
        beyond = c.get(f"/log/tile/0/{(size // 256 + 1):03d}")
        assert beyond.status_code == 404 and beyond.json()["code"] == "no_such_tile"
        bad = c.get("/log/tile/0/0001")
        assert bad.status_code == 400 and bad.json()["code"] == "malformed_tile"
        assert c.get("/v1/log/consistency", params={"from": size + 10**6}).status_code == 422


def test_every_checkpoint_is_kept_and_copied_to_the_sink(log_api: ApiServer) -> None:
    _ingest(log_api, 5, wait=True)
    verifier = _verifier(log_api)
    sink: Path = log_api.sink  # type: ignore[attr-defined]
    files = sorted(sink.glob("checkpoint.*"))
    assert files, "the sink holds no checkpoints"
    sizes = [open_checkpoint(f.read_bytes(), [verifier], origin=ORIGIN).size for f in files]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    latest = httpx.get(log_api.base_url + "/log/checkpoint").content
    assert (sink / "checkpoint").read_bytes() == latest
