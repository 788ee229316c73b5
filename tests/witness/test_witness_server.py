"""`ledger witness serve` as a separate process, driven over HTTP as C2SP tlog-witness
specifies: what it cosigns, what it refuses (and with which status), that its state is
durable, and that concurrent requests cannot both advance from the same size."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.cosignature import generate_witness_key, parse_witness_signer_key
from ledger.core.keys import public_raw
from ledger.core.merkle import consistency_proof, leaf_hash, root_hash
from ledger.core.note import Checkpoint, NoteVerifier, format_verifier_key, sign_checkpoint
from ledger.witness.protocol import format_add_checkpoint
from ledger.witness.service import SizeConflict, Witness, WitnessConfig
from ledger.witness.state import LogState, WitnessState
from tests.witness import spec_cosig
from tests.witness.helpers import WitnessProcess, make_witness_key, run_witness

ORIGIN = "ledger.test/witnessed"
LOG_KEY = Ed25519PrivateKey.generate()
OTHER_KEY = Ed25519PrivateKey.generate()


def leaves(n: int, salt: str = "") -> list[bytes]:
    return [leaf_hash(f"{salt}entry {i}".encode()) for i in range(n)]


def note(hashes: list[bytes], key: Ed25519PrivateKey = LOG_KEY, origin: str = ORIGIN) -> bytes:
    return sign_checkpoint(Checkpoint(origin, len(hashes), root_hash(hashes)), origin, key)


@pytest.fixture
def witness(tmp_path: Path) -> Iterator[WitnessProcess]:
    key_file, vkey = make_witness_key(tmp_path, "witness.test/w1")
    with run_witness(tmp_path, key_file, vkey,
                     [format_verifier_key(ORIGIN, public_raw(LOG_KEY))]) as w:
        yield w


def _cosigned(w: WitnessProcess, r: httpx.Response, n: bytes) -> int:
    assert r.status_code == 200, r.text
    assert r.text.endswith("\n") and r.text.startswith("\u2014 ")
    return spec_cosig.verify(n + r.content, w.name, w.public_key)


def test_cosigns_consistent_checkpoints_and_refuses_what_the_spec_refuses(
        witness: WitnessProcess) -> None:
    tree = leaves(40)
    n10, n25, n40 = note(tree[:10]), note(tree[:25]), note(tree[:40])
    # first contact: old 0, no proof (trust on first use)
    _cosigned(witness, witness.add(0, [], n10), n10)
    # a client that does not know the witness's size learns it from a 409
    r = witness.add(0, [], n25)
    assert r.status_code == 409
    assert r.headers["content-type"].startswith("text/x.tlog.size")
    assert r.text == "10\n"
    _cosigned(witness, witness.add(10, consistency_proof(10, 25, tree), n25), n25)
    # the same checkpoint again is cosigned again (a lost answer can be recovered)
    _cosigned(witness, witness.add(25, [], n25), n25)

    # truncated log: a smaller checkpoint (old = what the witness has) is a bad request...
    r = witness.add(25, [], n10)
    assert r.status_code == 400
    # ...and claiming the smaller old size is a conflict naming the real one
    r = witness.add(10, consistency_proof(10, 10, tree), n10)
    assert (r.status_code, r.text) == (409, "25\n")
    # forked log, same size, other root
    fork = leaves(25, salt="fork ")
    r = witness.add(25, [], note(fork))
    assert (r.status_code, r.text) == (409, "25\n")
    # rewritten log: the proof is genuine for the rewritten tree, not for what was cosigned
    rewritten = leaves(40, salt="rewritten ")
    r = witness.add(25, consistency_proof(25, 40, rewritten), note(rewritten))
    assert r.status_code == 422, r.text
    # a wrong proof for the real tree is refused too; the right one is cosigned
    proof = consistency_proof(25, 40, tree)
    r = witness.add(25, [proof[0], *proof[1:-1], bytes(32)], n40)
    assert r.status_code == 422
    _cosigned(witness, witness.add(25, proof, n40), n40)

    # unknown origin 404; signed by a key the witness does not trust 403; garbage 400
    assert witness.add(0, [], note(tree[:3], origin="other.test/log")).status_code == 404
    assert witness.add(40, [], note(tree[:41] + leaves(1), key=OTHER_KEY)).status_code == 403
    assert httpx.post(witness.base_url + "/add-checkpoint", content=b"old 01\n\n" + n40,
                      timeout=10).status_code == 400
    assert httpx.post(witness.base_url + "/add-checkpoint", content=b"nonsense",
                      timeout=10).status_code == 400
    assert witness.add(41, [], n40).status_code == 400  # old above the checkpoint size
    # the validly signed refusals were kept as evidence of misbehaviour
    evidence = sorted(witness.state.with_name(witness.state.name + ".evidence").iterdir())
    assert len(evidence) == 3  # the fork, the rewrite, the bad proof
    assert note(fork) in evidence[0].read_bytes() and note(rewritten) in evidence[1].read_bytes()

    info = httpx.get(witness.base_url + "/").json()
    assert info["logs"] == [{"origin": ORIGIN, "log_keys": [format_verifier_key(
        ORIGIN, public_raw(LOG_KEY))], "size": 40, "root_hash": n40.split(b"\n")[2].decode()}]
    assert info["verifier_key"] == witness.vkey


def test_state_survives_a_restart(tmp_path: Path) -> None:
    key_file, vkey = make_witness_key(tmp_path, "witness.test/durable")
    log_keys = [format_verifier_key(ORIGIN, public_raw(LOG_KEY))]
    tree = leaves(12)
    with run_witness(tmp_path, key_file, vkey, log_keys) as w:
        assert w.add(0, [], note(tree[:12])).status_code == 200
        state = json.loads(w.state.read_text())
        assert state["logs"][ORIGIN]["size"] == 12  # on disk before the answer came
    with run_witness(tmp_path, key_file, vkey, log_keys, state=w.state) as w2:
        r = w2.add(0, [], note(tree[:5]))
        assert (r.status_code, r.text) == (409, "12\n")
        assert w2.add(12, [], note(leaves(12, salt="x"))).status_code == 409


def test_concurrent_requests_cannot_both_advance_from_one_size(
        witness: WitnessProcess) -> None:
    tree = leaves(64)
    assert witness.add(0, [], note(tree[:8])).status_code == 200
    results: list[int] = []
    barrier = threading.Barrier(8)

    def submit(size: int) -> None:
        body = note(tree[:size])
        barrier.wait()
        results.append(witness.add(8, consistency_proof(8, size, tree), body).status_code)

    threads = [threading.Thread(target=submit, args=(s,)) for s in range(20, 60, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200] + [409] * 7
    # the survivor's size is what the witness now holds
    state = json.loads(witness.state.read_text())["logs"][ORIGIN]
    assert state["size"] in range(20, 60, 5)
    r = witness.add(8, [], note(tree[:8]))
    assert (r.status_code, r.text) == (409, f"{state['size']}\n")


class SlowDiskState(WitnessState):
    """The real state file, on a disk whose writes take a while: the window in which an
    unserialised witness would let a second request read the old size."""

    def _write(self, logs: dict[str, LogState]) -> None:
        time.sleep(0.2)
        super()._write(logs)


def test_check_and_update_are_atomic_even_on_a_slow_disk(tmp_path: Path) -> None:
    signer = parse_witness_signer_key(generate_witness_key("witness.test/slow")[0])
    witness = Witness(WitnessConfig.from_keys(signer, [NoteVerifier.from_public_key(
        ORIGIN, public_raw(LOG_KEY))]), SlowDiskState(tmp_path / "state.json"))
    tree = leaves(64)
    witness.add_checkpoint(format_add_checkpoint(0, [], note(tree[:8])))
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def submit(size: int) -> None:
        body = format_add_checkpoint(8, consistency_proof(8, size, tree), note(tree[:size]))
        barrier.wait()
        try:
            witness.add_checkpoint(body)
            outcomes.append("cosigned")
        except SizeConflict:
            outcomes.append("409")

    threads = [threading.Thread(target=submit, args=(s,)) for s in (20, 25, 30, 35, 40, 45)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["409"] * 5 + ["cosigned"]
    # and a second process on the same file takes its turn too (flock): it sees the update
    assert WitnessState(tmp_path / "state.json").get(ORIGIN).size in (20, 25, 30, 35, 40, 45)
