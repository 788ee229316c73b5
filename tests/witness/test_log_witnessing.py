"""The log submits its checkpoints to witnesses: a real `ledger serve` (integrator thread
with LEDGER_WITNESSES) and a real `ledger witness serve` process, plus a "tarpit" witness
that accepts connections and never answers.

Shown here: cosignatures accumulate during ingest and are served in /log/checkpoint (valid
under the spec's second implementation and still a note the log key alone opens); the
witness refuses a truncated, a forked and a rewritten log; a witness that is down or hangs
does not stall integration, its status says why, and cosigning resumes when it is back;
audit_cosignatures catches a checkpoint rewritten after it was cosigned and a quorum that
lags."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.cosignature import QuorumError, check_quorum
from ledger.core.keys import generate_private_key, key_id, private_pem, public_raw
from ledger.core.merkle import consistency_proof, leaf_hash, root_hash
from ledger.core.note import (
    Checkpoint,
    NoteVerifier,
    format_verifier_key,
    open_checkpoint,
    sign_checkpoint,
)
from ledger.core.trust import TrustPolicy, format_trust_policy, parse_witness_key
from ledger.db.session import make_engine, session_scope
from ledger.log.witnessing import audit_cosignatures, cosigned_note
from tests.conftest import provision
from tests.helpers import REPO, ApiServer, free_port, run_server, signed, statement
from tests.witness import spec_cosig
from tests.witness.helpers import make_witness_key, run_witness

ORIGIN = "ledger.test/witnessed-log"
W1 = "witness.test/w1"
TARPIT = "witness.test/tarpit"


class Tarpit:
    """A TCP server that accepts connections and never says a word."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.held.append(conn)
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self.held:
            c.close()
        self.sock.close()


class Setup:
    api: ApiServer
    log_key: Ed25519PrivateKey
    witness_key_file: Path
    witness_vkey: str
    witness_port: int
    tarpit_vkey: str
    dir: Path
    db_url: str
    producer: Ed25519PrivateKey


@pytest.fixture(scope="module")
def setup(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup()
    keys, s.producer = provision(module_db_url)
    s.dir = tmp_path_factory.mktemp("witnessed")
    s.db_url = module_db_url
    s.log_key = generate_private_key()
    (s.dir / "log.pem").write_bytes(private_pem(s.log_key))
    s.witness_key_file, s.witness_vkey = make_witness_key(s.dir, W1)
    _, s.tarpit_vkey = make_witness_key(s.dir, TARPIT)
    s.witness_port = free_port()
    tarpit = Tarpit()
    env = {"LEDGER_LOG_KEY_FILE": str(s.dir / "log.pem"), "LEDGER_LOG_NAME": ORIGIN,
           "LEDGER_INTEGRATE_INTERVAL_MS": "50",
           "LEDGER_WITNESSES": f"http://127.0.0.1:{s.witness_port} {s.witness_vkey}, "
                               f"http://127.0.0.1:{tarpit.port} {s.tarpit_vkey}",
           "LEDGER_WITNESS_TIMEOUT_S": "5", "LEDGER_WITNESS_INTERVAL_MS": "100",
           "LEDGER_WITNESS_MAX_BACKOFF_S": "1"}
    try:
        with run_server(module_db_url, extra_env=env, log_dir=s.dir) as api:
            api.keys = keys
            s.api = api
            yield s
    finally:
        tarpit.close()


def _log_vkey(s: Setup) -> str:
    return format_verifier_key(ORIGIN, public_raw(s.log_key))


def _ingest(s: Setup, n: int) -> float:
    """Ingest n envelopes and wait for their receipts; returns the seconds it took."""
    envs = [signed(statement(prompt_len=4, output_len=2), s.producer) for _ in range(n)]
    start = time.monotonic()
    with s.api.client("ingester") as c:
        r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 20},
                   json={"envelopes": envs})
    assert r.status_code == 200, r.text
    assert all(item["receipt"] is not None for item in r.json()["results"]), r.text
    return time.monotonic() - start


def _status(s: Setup) -> dict[str, Any]:
    with s.api.client("auditor") as c:
        body = c.get("/v1/log/witnesses").json()
    return {"tree_size": body["tree_size"], **{w["name"]: w for w in body["witnesses"]}}


def _wait_for(s: Setup, predicate: Any, what: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(s)
        if W1 in st and predicate(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {st}")
        time.sleep(0.1)


def _cosigned_sizes(s: Setup, name: str) -> list[int]:
    with psycopg.connect(s.db_url.replace("postgresql+psycopg", "postgresql")) as conn:
        rows = conn.execute("SELECT tree_size FROM checkpoint_cosignatures WHERE "
                            "witness_name = %s ORDER BY tree_size", (name,)).fetchall()
    return [r[0] for r in rows]


def _policy(s: Setup, quorum: int, *vkeys: str) -> TrustPolicy:
    return TrustPolicy(ORIGIN, (NoteVerifier.from_public_key(ORIGIN, public_raw(s.log_key)),),
                       (), tuple(parse_witness_key(v) for v in vkeys), quorum)


def _audit(s: Setup, policy: TrustPolicy, **kw: Any) -> list[tuple[int | None, str]]:
    engine = make_engine(url=s.db_url, pool_size=1)
    try:
        with session_scope(engine) as session:
            return audit_cosignatures(session, policy, **kw)
    finally:
        engine.dispose()


def test_witnessed_log_lifecycle(setup: Setup) -> None:
    s = setup
    with run_witness(s.dir, s.witness_key_file, s.witness_vkey, [_log_vkey(s)],
                     port=s.witness_port) as witness:
        # --- cosignatures accumulate during ingest; the tarpit delays nothing ----------
        for _ in range(4):
            took = _ingest(s, 3)
            assert took < 4, f"ingest with receipts took {took:.1f} s"
            _wait_for(s, lambda st: st[W1]["cosigned_size"] == st["tree_size"],
                      "the witness to cosign the newest checkpoint")
        sizes = _cosigned_sizes(s, W1)
        assert len(sizes) >= 4 and sizes[-1] == 12
        st = _wait_for(s, lambda st: st[TARPIT]["last_error"] is not None,
                       "the tarpit's timeout to show")
        assert st[W1]["last_error"] is None and st[W1]["verifier_key"] == s.witness_vkey
        assert st[TARPIT]["cosigned_size"] is None
        schema = httpx.get(s.api.base_url + "/openapi.json", timeout=10).json()
        route = schema["paths"]["/v1/log/witnesses"]["get"]["responses"]["200"]
        assert route["content"]["application/json"]["schema"]["$ref"].endswith("/WitnessesOut")
        assert "Timeout" in st[TARPIT]["last_error"], st[TARPIT]

        # --- the served checkpoint carries the cosignature ----------------------------
        served = httpx.get(s.api.base_url + "/log/checkpoint", timeout=10).content
        assert spec_cosig.verify(served, witness.name, witness.public_key) > 0
        cp = open_checkpoint(served, [NoteVerifier.from_public_key(ORIGIN,
                                                                    public_raw(s.log_key))],
                             origin=ORIGIN)
        assert cp.size == 12
        assert check_quorum(served, _policy(s, 1, s.witness_vkey)) == [W1]
        with pytest.raises(QuorumError):
            check_quorum(served, _policy(s, 1, s.tarpit_vkey))

        # --- the witness refuses a truncated, a forked and a rewritten log -------------
        # (an insider holding the log key signs each of them)
        with psycopg.connect(s.db_url.replace("postgresql+psycopg", "postgresql")) as conn:
            older = conn.execute("SELECT tree_size, note FROM checkpoints WHERE tree_size < 12 "
                                 "ORDER BY tree_size LIMIT 1").fetchone()
        assert older is not None
        r = witness.add(12, [], bytes(older[1]))
        assert r.status_code == 400  # older than what it cosigned
        r = witness.add(older[0], [], bytes(older[1]))
        assert (r.status_code, r.text) == (409, "12\n")
        fork = [leaf_hash(b"forged %d" % i) for i in range(12)]
        forged = sign_checkpoint(Checkpoint(ORIGIN, 12, root_hash(fork)), ORIGIN, s.log_key)
        r = witness.add(12, [], forged)
        assert (r.status_code, r.text) == (409, "12\n")
        rewritten = [leaf_hash(b"rewritten %d" % i) for i in range(20)]
        r = witness.add(12, consistency_proof(12, 20, rewritten),
                        sign_checkpoint(Checkpoint(ORIGIN, 20, root_hash(rewritten)), ORIGIN,
                                        s.log_key))
        assert r.status_code == 422, r.text

    # --- the witness is down: integration goes on, the status says why ----------------
    took = _ingest(s, 3)
    assert took < 4, f"ingest with a witness down took {took:.1f} s"
    st = _wait_for(s, lambda st: st[W1]["last_error"] is not None, "the error to show")
    assert st["tree_size"] == 15 and st[W1]["cosigned_size"] == 12
    assert "Connect" in st[W1]["last_error"], st[W1]
    # the audit's liveness rule: a checkpoint waiting too long for quorum is reported
    policy = _policy(s, 1, s.witness_vkey)
    assert _audit(s, policy) == []
    late = _audit(s, policy, now=datetime.now(UTC) + timedelta(hours=2))
    assert [size for size, _ in late] == [15]

    # --- it comes back (same state file): cosigning resumes ---------------------------
    with run_witness(s.dir, s.witness_key_file, s.witness_vkey, [_log_vkey(s)],
                     port=s.witness_port) as witness:
        st = _wait_for(s, lambda st: st[W1]["cosigned_size"] == 15 and
                       st[W1]["last_error"] is None, "cosigning to resume")
        served = httpx.get(s.api.base_url + "/log/checkpoint", timeout=10).content
        assert spec_cosig.verify(served, witness.name, witness.public_key) > 0
    assert _audit(s, policy, now=datetime.now(UTC) + timedelta(hours=2)) == []


def _ledger(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_verify_trust_enforces_the_witness_quorum(setup: Setup) -> None:
    """`ledger verify --trust` with quorum 1: the exported checkpoint carries the witness's
    cosignature and verifies; under a policy whose one witness never cosigned, it fails."""
    s = setup
    service = generate_private_key()
    (s.dir / "service.pem").write_bytes(private_pem(service))
    env = {"LEDGER_DATABASE_URL": s.db_url, "LEDGER_LOG_NAME": ORIGIN,
           "LEDGER_SERVICE_KEY_FILE": str(s.dir / "service.pem"),
           "LEDGER_WITNESSES": f"http://127.0.0.1:{s.witness_port} {s.witness_vkey}"}
    with run_witness(s.dir, s.witness_key_file, s.witness_vkey, [_log_vkey(s)],
                     port=s.witness_port):
        # the producer key, registered before registry leaves existed here, is vouched for
        r = _ledger(["keys", "attest", key_id(public_raw(s.producer))], env)
        assert r.returncode == 0, r.stdout + r.stderr
        _ingest(s, 2)
        _wait_for(s, lambda st: st[W1]["cosigned_size"] == st["tree_size"],
                  "the witness to cosign the newest checkpoint")
        bundle = s.dir / "bundle.jsonl"
        r = _ledger(["export", "--out", str(bundle)], env)
        assert r.returncode == 0, r.stdout + r.stderr
    policies = {}
    for name, vkey in (("witnessed", s.witness_vkey), ("tarpit", s.tarpit_vkey)):
        policies[name] = s.dir / f"trust-{name}.toml"
        policies[name].write_text(format_trust_policy(
            ORIGIN, [public_raw(s.log_key)], [public_raw(service)], [parse_witness_key(vkey)],
            quorum=1))
    ok = _ledger(["verify", str(bundle), "--trust", str(policies["witnessed"])], env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = _ledger(["verify", str(bundle), "--trust", str(policies["tarpit"])], env)
    assert refused.returncode != 0, refused.stdout
    assert "witness" in (refused.stdout + refused.stderr).lower()
    assert "Traceback" not in refused.stderr


def test_audit_catches_a_checkpoint_rewritten_after_it_was_cosigned(setup: Setup) -> None:
    s = setup
    policy = _policy(s, 1, s.witness_vkey)
    sizes = _cosigned_sizes(s, W1)
    assert sizes and _audit(s, policy) == []
    # quorum 2 with a witness that never answered: no checkpoint reaches it
    two = _policy(s, 2, s.witness_vkey, s.tarpit_vkey)
    assert (None, "no checkpoint is cosigned by 2 of the trust policy's witnesses") in \
        _audit(s, two)
    # an insider with the superuser and the log key rewrites a cosigned checkpoint
    victim = sizes[1]
    other = [leaf_hash(b"other %d" % i) for i in range(victim)]
    note = sign_checkpoint(Checkpoint(ORIGIN, victim, root_hash(other)), ORIGIN, s.log_key)
    with psycopg.connect(s.db_url.replace("postgresql+psycopg", "postgresql")) as conn:
        conn.execute("ALTER TABLE checkpoints DISABLE TRIGGER checkpoints_append_only")
        conn.execute("UPDATE checkpoints SET note = %s, root_hash = %s WHERE tree_size = %s",
                     (note, root_hash(other), victim))
        conn.execute("ALTER TABLE checkpoints ENABLE TRIGGER checkpoints_append_only")
    problems = _audit(s, policy)
    assert problems and problems[0][0] == victim, problems
    assert "rewritten" in problems[0][1]
    # what the log would now serve for that size fails the spec's verifier as well
    engine = make_engine(url=s.db_url, pool_size=1)
    try:
        with session_scope(engine) as session:
            served = cosigned_note(session, victim)
    finally:
        engine.dispose()
    with pytest.raises(Exception):  # noqa: B017 - InvalidSignature from cryptography
        spec_cosig.verify(served, W1, parse_witness_key(s.witness_vkey).public_key)
