"""Export bundles covered whole: every byte of a bundle is bound by a signature or a digest
that `ledger verify --trust` checks, and with a trust policy only the policy's keys, and
the keys the bundle's signed registry records vouch for, are believed.

Real PostgreSQL, real `ledger trust init`, `ledger export` and `ledger verify` processes;
the 1,000 flips call :func:`ledger.core.bundle.verify_bundle`, the function the verify
command runs, on the file's bytes (a few flips go through the command too)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.bundle import BundleError, header_bytes, verify_bundle
from ledger.core.dsse import envelope_from_obj
from ledger.core.keys import generate_private_key, key_id, private_pem, public_raw
from ledger.core.note import format_verifier_key, parse_verifier_key
from ledger.core.trust import TrustPolicy, load_trust_policy
from ledger.db.session import make_engine, session_scope
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.producer import sign_statement
from ledger.replay.records import Signer
from ledger.services import ingest
from ledger.services.keys import register_key
from ledger.settings import Settings
from tests.helpers import REPO, signed, statement

ORIGIN = "ledger.test/bundle"
N = 12


@dataclass
class Exported:
    db_url: str
    tmp: Path
    env: dict[str, str]
    bundle: Path
    policy_file: Path
    policy: TrustPolicy
    producer: Ed25519PrivateKey
    log: LogSigner


def ledger(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "250", **env})


def populate(db_url: str, tmp: Path, *, rogue: Ed25519PrivateKey | None = None
             ) -> tuple[dict[str, str], Ed25519PrivateKey, LogSigner]:
    """Keys registered as registry leaves, N envelopes, one checkpoint."""
    log_key, service_key, producer = (generate_private_key() for _ in range(3))
    (tmp / "log.pem").write_bytes(private_pem(log_key))
    (tmp / "service.pem").write_bytes(private_pem(service_key))
    service = Signer(service_key, "ledger", "ledger-service")
    log = LogSigner(ORIGIN, log_key)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    with session_scope(engine) as s:
        service.ensure_registered(s)
        log.ensure_registered(s, service)
        register_key(s, public_key=public_raw(producer), purpose="producer", name="gw",
                     signer=service)
        if rogue is not None:  # what an insider does: a row, no leaf
            register_key(s, public_key=public_raw(rogue), purpose="producer", name="gw")
        envs = [signed(statement(), producer) for _ in range(N)]
        if rogue is not None:
            envs.append(signed(statement("rogue-record"), rogue))
        assert all(r.status == 201 for r in ingest.ingest(s, envs, settings))
    integrate_all(engine, log)
    engine.dispose()
    env = {"LEDGER_DATABASE_URL": db_url, "LEDGER_LOG_NAME": ORIGIN,
           "LEDGER_LOG_KEY_FILE": str(tmp / "log.pem"),
           "LEDGER_SERVICE_KEY_FILE": str(tmp / "service.pem")}
    return env, producer, log


@pytest.fixture
def exported(db_url: str, tmp_path: Path) -> Iterator[Exported]:
    env, producer, log = populate(db_url, tmp_path)
    policy_file = tmp_path / "trust.toml"
    r = ledger("trust", "init", "--out", str(policy_file), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    bundle = tmp_path / "bundle.jsonl"
    r = ledger("export", "--out", str(bundle), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    yield Exported(db_url, tmp_path, env, bundle, policy_file, load_trust_policy(policy_file),
                   producer, log)


def test_trust_init_writes_the_policy_of_the_key_files(exported: Exported) -> None:
    policy = exported.policy
    assert policy.origin == ORIGIN
    assert [v.verifier_key for v in policy.log_keys] == [exported.log.verifier().verifier_key]
    service = Signer.from_file(exported.tmp / "service.pem", "ledger", "x")
    assert service is not None and policy.service_keys == (public_raw(service.key),)
    again = ledger("trust", "init", "--out", str(exported.policy_file), env=exported.env)
    assert again.returncode == 2 and "exists" in again.stderr  # never overwritten silently


def test_verify_with_trust_accepts_an_honest_bundle(exported: Exported) -> None:
    r = ledger("verify", str(exported.bundle), "--trust", str(exported.policy_file),
               env={"LEDGER_DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/x"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "from the trust policy" in r.stdout
    assert re.search(r"admin_event records verified\s*│\s*3\s", r.stdout), r.stdout
    assert re.search(rf"envelope records verified\s*│\s*{N}\s", r.stdout), r.stdout
    summary = verify_bundle(exported.bundle.read_bytes(), trust=exported.policy)
    assert summary.by_kind == {"admin_event": 3, "envelope": N}
    assert summary.log_key_source == "trust" and summary.created_at


def test_a_thousand_flipped_bytes_anywhere_are_a_thousand_failures(exported: Exported) -> None:
    data = exported.bundle.read_bytes()
    verify_bundle(data, trust=exported.policy)  # intact: no error
    rng = random.Random(20261201)
    header_len = data.index(b"\n")
    undetected = []
    for trial in range(1000):
        # a third of the flips in the header (manifest, record count, format), the rest
        # anywhere in the file, newlines included
        pos = rng.randrange(header_len + 1) if trial % 3 == 0 else rng.randrange(len(data))
        mutated = bytearray(data)
        mutated[pos] ^= 1 << rng.randrange(8)
        try:
            verify_bundle(bytes(mutated), trust=exported.policy)
        except BundleError:
            continue
        undetected.append((pos, data[max(0, pos - 30):pos + 30]))
    assert undetected == [], undetected[:5]
    # the command runs that same function: a few flips through it
    for pos in (5, header_len // 2, header_len + 40, len(data) - 20):
        mutated = bytearray(data)
        mutated[pos] ^= 0x04
        bad = exported.tmp / f"bad-{pos}.jsonl"
        bad.write_bytes(bytes(mutated))
        r = ledger("verify", str(bad), "--trust", str(exported.policy_file), env={})
        assert r.returncode == 1 and "FAIL" in r.stdout, (pos, r.stdout)


def test_unsigned_header_fields_cannot_be_changed(exported: Exported) -> None:
    """The fields v1 left unsigned (selection, created_at, key metadata) live in the
    signed manifest now; re-signing it with any key but a policy service key fails."""
    lines = exported.bundle.read_bytes().split(b"\n")
    head = orjson.loads(lines[0])
    env = envelope_from_obj(head["manifest"])
    st = orjson.loads(env.payload)
    for field, value in (("selection", {"request_ids": ["x"]}),
                         ("created_at", "2020-01-01T00:00:00+00:00"),
                         ("keys", [])):
        forged = {**st, "predicate": {**st["predicate"], field: value}}
        rogue = generate_private_key()
        line = header_bytes(head["records"], sign_statement(forged, rogue))
        with pytest.raises(BundleError, match="not a trusted service key"):
            verify_bundle(b"\n".join([line, *lines[1:]]), trust=exported.policy)
    # a record removed, and the count and digest "fixed" without the service key: no
    with pytest.raises(BundleError):
        verify_bundle(b"\n".join([lines[0], *lines[2:]]), trust=exported.policy)


def test_a_policy_for_another_log_or_service_key_refuses_the_bundle(
        exported: Exported) -> None:
    data = exported.bundle.read_bytes()
    other_log = TrustPolicy(ORIGIN, (parse_verifier_key(format_verifier_key(
        ORIGIN, public_raw(generate_private_key()))),), exported.policy.service_keys)
    with pytest.raises(BundleError, match="checkpoint"):
        verify_bundle(data, trust=other_log)
    other_service = TrustPolicy(ORIGIN, exported.policy.log_keys,
                                (public_raw(generate_private_key()),))
    with pytest.raises(BundleError, match="not a trusted service key"):
        verify_bundle(data, trust=other_service)


def test_a_producer_key_without_a_registry_leaf_fails_only_under_the_policy(
        db_url: str, tmp_path: Path) -> None:
    rogue = generate_private_key()
    env, _, log = populate(db_url, tmp_path, rogue=rogue)
    policy = tmp_path / "trust.toml"
    assert ledger("trust", "init", "--out", str(policy), env=env).returncode == 0
    bundle = tmp_path / "bundle.jsonl"
    assert ledger("export", "--out", str(bundle), env=env).returncode == 0
    # pinning only the log key believes the database's key table (integrity, not origin)
    pinned = ledger("verify", str(bundle), "--log-key", log.verifier().verifier_key, env={})
    assert pinned.returncode == 0, pinned.stdout
    trusted = ledger("verify", str(bundle), "--trust", str(policy), env={})
    assert trusted.returncode == 1
    assert (f"signing key {key_id(public_raw(rogue))} is not vouched for in the bundle"
            in trusted.stdout), trusted.stdout
    assert "rogue-record" in trusted.stdout
