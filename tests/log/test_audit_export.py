"""Audit against tampering on a real PostgreSQL, and offline verification of exports.

Tampering is done the way an insider with superuser rights would: triggers off
(``session_replication_role = replica``), then edit rows directly.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.bundle import BundleError, verify_lines
from ledger.core.keys import generate_private_key, private_pem
from ledger.core.note import format_verifier_key, parse_verifier_key
from ledger.db.session import make_engine, session_scope
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.log.sink import DirectorySink
from ledger.services import ingest
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import REPO, TEST_PEPPER, run_server, signed, statement

ORIGIN = "ledger.test/audit"
N = 40


@dataclass
class Log:
    db_url: str
    pg_url: str
    key_file: Path
    sink: Path
    producer: Ed25519PrivateKey
    signer: LogSigner
    request_ids: list[str]
    env: dict[str, str]


@pytest.fixture
def small_log(db_url: str, tmp_path: Path) -> Iterator[Log]:
    """N envelopes, integrated one at a time: a checkpoint at every size, each copied to
    a sink directory outside the database."""
    _, producer = provision(db_url)
    key_file = tmp_path / "log.pem"
    log_key = generate_private_key()
    key_file.write_bytes(private_pem(log_key))
    service_file = tmp_path / "service.pem"  # signs export manifests
    service_file.write_bytes(private_pem(generate_private_key()))
    signer = LogSigner(ORIGIN, log_key)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    rids = []
    with session_scope(engine) as s:
        signer.ensure_registered(s)
        sts = [statement() for _ in range(N)]
        rids = [st["predicate"]["request_id"] for st in sts]
        res = ingest.ingest(s, [signed(st, producer) for st in sts], settings)
        assert all(r.status == 201 for r in res)
    sink = DirectorySink(tmp_path / "sink")
    integrate_all(engine, signer, max_entries=1, sink=sink)
    engine.dispose()
    env = {"LEDGER_DATABASE_URL": db_url, "LEDGER_LOG_NAME": ORIGIN,
           "LEDGER_LOG_KEY_FILE": str(key_file), "LEDGER_SERVICE_KEY_FILE": str(service_file)}
    yield Log(db_url, db_url.replace("postgresql+psycopg://", "postgresql://"), key_file,
              tmp_path / "sink", producer, signer, rids, env)


def ledger(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "250", **env},
                          timeout=300)


def tamper(log: Log, *sql: tuple[str, tuple[object, ...]]) -> None:
    with psycopg.connect(log.pg_url) as conn:
        conn.execute("SET session_replication_role = replica")
        for statement_sql, params in sql:
            conn.execute(statement_sql, params)


def test_audit_is_clean_on_an_untouched_log(small_log: Log) -> None:
    r = ledger("audit", "--signatures", "--against", str(small_log.sink), env=small_log.env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and f"{N}" in r.stdout


def test_audit_names_a_changed_byte(small_log: Log) -> None:
    k = 17
    tamper(small_log, ("UPDATE envelopes SET dsse = overlay(dsse placing '7' from 40 for 1) "
                       "WHERE log_index = %s", (k,)))
    r = ledger("audit", env=small_log.env)
    assert r.returncode == 1
    assert f"first bad index {k}" in r.stdout, r.stdout


def test_audit_names_a_deleted_row(small_log: Log) -> None:
    k = 23
    tamper(small_log, ("DELETE FROM envelopes WHERE log_index = %s", (k,)),
           ("DELETE FROM log_entries WHERE idx = %s", (k,)))
    r = ledger("audit", env=small_log.env)
    assert r.returncode == 1
    assert f"first bad index {k}" in r.stdout, r.stdout


def test_audit_names_a_deleted_envelope_whose_entry_remains(small_log: Log) -> None:
    tamper(small_log, ("DELETE FROM envelopes WHERE log_index = 5", ()))
    r = ledger("audit", env=small_log.env)
    assert r.returncode == 1 and "first bad index 5" in r.stdout, r.stdout


def test_audit_names_swapped_rows(small_log: Log) -> None:
    i, j = 9, 31
    tamper(small_log,
           ("UPDATE envelopes SET log_index = -1 WHERE log_index = %s", (i,)),
           ("UPDATE envelopes SET log_index = %s WHERE log_index = %s", (i, j)),
           ("UPDATE envelopes SET log_index = %s WHERE log_index = -1", (j,)))
    r = ledger("audit", env=small_log.env)
    assert r.returncode == 1
    assert f"first bad index {i}" in r.stdout, r.stdout


def test_consistent_rewrite_passes_audit_but_not_against_saved_checkpoints(
        small_log: Log) -> None:
    """An insider rewrites envelope k with a validly signed alternative, recomputes every
    hash, tile and checkpoint and re-signs them with the log key: the database agrees
    with itself, and only checkpoints saved elsewhere expose it."""
    k = 26
    st = statement(small_log.request_ids[k])
    forged = signed(st, small_log.producer)
    from ledger.core.dsse import envelope_from_obj
    from ledger.core.logentry import dsse_digest, log_entry_bytes
    from ledger.core.merkle import leaf_hash

    dsse_bytes = envelope_from_obj(forged).canonical_bytes()
    digest = dsse_digest(dsse_bytes)
    entry = log_entry_bytes("envelope", small_log.request_ids[k], digest)
    tamper(small_log,
           # index columns too: audit cross-checks them against the signed payload
           ("UPDATE envelopes SET dsse = %s, dsse_sha256 = %s, recorded_at = %s "
            "WHERE log_index = %s",
            (dsse_bytes, bytes.fromhex(digest), st["predicate"]["recorded_at"], k)),
           ("UPDATE log_entries SET entry = %s, leaf_hash = %s WHERE idx = %s",
            (entry, leaf_hash(entry), k)),
           ("DELETE FROM checkpoints", ()), ("DELETE FROM tiles", ()),
           ("UPDATE log_tree SET size = 0, root_hash = %s", (bytes.fromhex(
               "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),)))
    engine = make_engine(Settings(database_url=small_log.db_url), pool_size=1)
    integrate_all(engine, small_log.signer, max_entries=7)  # re-signed, no external sink
    engine.dispose()
    inside = ledger("audit", "--signatures", env=small_log.env)
    assert inside.returncode == 0, inside.stdout  # the rewrite is self-consistent
    against = ledger("audit", "--against", str(small_log.sink), env=small_log.env)
    assert against.returncode == 1
    assert f"rewritten at entry {k}" in against.stdout, against.stdout
    assert f"first bad index {k}" in against.stdout
    one_file = ledger("audit", "--against", str(small_log.sink / "checkpoint"),
                      env=small_log.env)
    assert one_file.returncode == 1 and "disagrees with the log" in one_file.stdout


def test_export_verifies_offline_and_every_flipped_byte_is_detected(
        small_log: Log, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle.jsonl"
    r = ledger("export", "--out", str(bundle), env=small_log.env)
    assert r.returncode == 0, r.stderr
    vkey = format_verifier_key(ORIGIN, small_log.signer.public_key)
    ok = subprocess.run([sys.executable, "-m", "ledger.cli.main", "verify", str(bundle),
                         "--log-key", vkey], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "LEDGER_DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/x"},
                        timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"envelope records verified │ {N}" in ok.stdout.replace("  ", " ") or str(N) in ok.stdout
    data = bundle.read_bytes()
    lines = data.split(b"\n")[:-1]
    pinned = [parse_verifier_key(vkey)]
    verify_lines(lines, pinned_log_keys=pinned)  # intact: no error

    # byte positions inside the signed manifest (header), every DSSE envelope and every
    # proof (tests/log/test_bundle_whole.py flips bytes anywhere, under a trust policy)
    regions: list[tuple[int, int, int]] = []  # (line, start, end)
    head = lines[0]
    regions.append((0, head.index(b'"manifest":') + len(b'"manifest":'),
                    head.index(b',"records":')))
    for n, line in enumerate(lines[1:], start=1):
        d0 = line.index(b'"dsse":') + len(b'"dsse":')
        d1 = line.index(b',"inclusion_proof":')
        regions.append((n, d0, d1))
        regions.append((n, d1 + len(b',"inclusion_proof":'), len(line)))
    rng = random.Random(20261129)
    detected = 0
    for _ in range(1000):
        ln, a, b = rng.choice(regions)
        pos = rng.randrange(a, b)
        mutated = bytearray(lines[ln])
        mutated[pos] ^= 1 << rng.randrange(8)
        trial = list(lines)
        trial[ln] = bytes(mutated)
        try:
            verify_lines(trial, pinned_log_keys=pinned)
        except BundleError:
            detected += 1
        else:
            pytest.fail(f"undetected flip: line {ln} byte {pos}: "
                        f"{lines[ln][max(0, pos - 30):pos + 30]!r} -> "
                        f"{bytes(mutated[max(0, pos - 30):pos + 30])!r}")
    assert detected == 1000
    # removing a record, or pinning another log key, fails too
    with pytest.raises(BundleError, match="announces"):
        verify_lines(lines[:-1], pinned_log_keys=pinned)
    other = parse_verifier_key(format_verifier_key(ORIGIN, generate_private_key().public_key()))
    with pytest.raises(BundleError, match="checkpoint"):
        verify_lines(lines, pinned_log_keys=[other])
    bad = tmp_path / "bad.jsonl"
    flipped = bytearray(data)
    flipped[len(lines[0]) + 60] ^= 4
    bad.write_bytes(bytes(flipped))
    fail = ledger("verify", str(bad), "--log-key", vkey, env={})
    assert fail.returncode == 1 and "FAIL" in fail.stdout and "line 2" in fail.stdout


def test_auditor_exports_over_the_api(small_log: Log, tmp_path: Path) -> None:
    keys, _ = provision(small_log.db_url) if False else ({}, None)  # keys made below
    from ledger.services.apikeys import create_api_key

    engine = make_engine(Settings(database_url=small_log.db_url), pool_size=1)
    with session_scope(engine) as s:
        _, auditor = create_api_key(s, name="auditor-x", role="auditor", pepper=TEST_PEPPER)
        _, reviewer = create_api_key(s, name="reviewer-x", role="reviewer", pepper=TEST_PEPPER)
    engine.dispose()
    with run_server(small_log.db_url, extra_env={
            "LEDGER_LOG_NAME": ORIGIN,
            "LEDGER_SERVICE_KEY_FILE": small_log.env["LEDGER_SERVICE_KEY_FILE"]},
            log_dir=tmp_path) as server:
        r = httpx.get(server.base_url + "/v1/export",
                      params={"request_id": small_log.request_ids[:5]},
                      headers={"Authorization": f"Bearer {auditor}"}, timeout=60)
        denied = httpx.get(server.base_url + "/v1/export",
                           headers={"Authorization": f"Bearer {reviewer}"})
        events = httpx.get(server.base_url + "/v1/audit-events",
                           headers={"Authorization": f"Bearer {auditor}"}).json()["items"]
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    summary = verify_lines(r.content.split(b"\n")[:-1],
                           pinned_log_keys=[small_log.signer.verifier()])
    assert summary.records == 5
    assert denied.status_code == 403
    assert any(e["action"] == "export" for e in events)
    del keys


def test_an_empty_export_fails_unless_allowed_and_verify_says_what_it_verified(
        small_log: Log, tmp_path: Path) -> None:
    """Issue 13: `--model-sha256 deadbeef` wrote 0 records and verify said OK."""
    empty = tmp_path / "empty.jsonl"
    r = ledger("export", "--out", str(empty), "--model-sha256", "deadbeef", env=small_log.env)
    assert r.returncode == 2 and not empty.exists(), r.stdout + r.stderr
    assert "matched no records" in r.stderr and "--allow-empty" in r.stderr
    assert "Traceback" not in r.stderr
    r = ledger("export", "--out", str(empty), "--model-sha256", "deadbeef", "--allow-empty",
               env=small_log.env)
    assert r.returncode == 0 and empty.exists(), r.stderr

    bundle = tmp_path / "bundle.jsonl"
    assert ledger("export", "--out", str(bundle), env=small_log.env).returncode == 0
    vkey = format_verifier_key(ORIGIN, small_log.signer.public_key)
    ok = ledger("verify", str(bundle), "--log-key", vkey, env={})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = " ".join(ok.stdout.replace("│", " ").split())
    assert f"envelope records verified {N}" in text, text
    assert f"checkpoint tree size {N}" in text
    with psycopg.connect(small_log.pg_url) as conn:
        size_root = conn.execute("SELECT root_hash FROM checkpoints WHERE tree_size = %s",
                                 (N,)).fetchone()
    assert f"checkpoint root {bytes(size_root[0]).hex()}" in text, text
    from ledger.core.keys import key_id, public_raw

    assert f"producer key {key_id(public_raw(small_log.producer))}" in text, text


def test_apikey_list_and_revoke(small_log: Log) -> None:
    made = ledger("apikey", "create", "--role", "reviewer", "--name", "ops-list",
                  env=small_log.env)
    assert made.returncode == 0, made.stderr
    listed = ledger("apikey", "list", env=small_log.env)
    row = next(ln for ln in listed.stdout.splitlines() if "ops-list" in ln)
    key_id_ = row.split("│")[1].strip()
    assert "reviewer" in row and row.rstrip("│ ").endswith("-"), row
    revoked = ledger("apikey", "revoke", key_id_, env=small_log.env)
    assert revoked.returncode == 0, revoked.stderr
    row = next(ln for ln in ledger("apikey", "list", env=small_log.env).stdout.splitlines()
               if "ops-list" in ln)
    assert not row.rstrip("│ ").endswith("-"), row  # a revocation time now
    missing = ledger("apikey", "revoke", "00000000-0000-0000-0000-000000000000",
                     env=small_log.env)
    assert missing.returncode == 2 and "ledger apikey list" in missing.stderr
