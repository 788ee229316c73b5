"""Keys that cannot be forged, end to end on a real ledger: small-order and non-canonical
Ed25519 keys are refused by POST /v1/keys, `ledger keys register` and the key service;
a signature that needs no private key (R = identity, S = 0) is refused by envelope ingest
(one and batch) and by `ledger audit` on records stored before these checks existed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.core import dsse
from ledger.core.canonical import canonical_json
from ledger.core.ed25519_strict import SMALL_ORDER_ENCODINGS, L, P
from ledger.core.envelope import Limits, index_fields, parse_statement
from ledger.core.errors import KeyError_
from ledger.core.keys import generate_private_key, key_id, private_pem, public_raw
from ledger.db.session import make_engine, session_scope
from ledger.log.audit import audit
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.services import ingest
from ledger.services.keys import register_key
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import REPO, ApiServer, signed, statement

IDENTITY = (1).to_bytes(32, "little")
FORGED_SIG = IDENTITY + bytes(32)  # R = identity, S = 0
SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
NON_CANONICAL = [(y | (s << 255)).to_bytes(32, "little") for y in range(P, 2**255)
                 for s in (0, 1)]
# an honest key plus the order-2 point (0, -1): y -> -y, x -> -x; mixed order
_honest = public_raw(Ed25519PrivateKey.generate())
MIXED = ((P - (int.from_bytes(_honest, "little") & (2**255 - 1)))
         | ((_honest[31] >> 7 ^ 1) << 255)).to_bytes(32, "little")
OFF_CURVE = (2).to_bytes(32, "little")  # y = 2: x^2 = 3 / (4d + 1) has no root
WEAK = sorted(SMALL_ORDER_ENCODINGS) + NON_CANONICAL + [MIXED, OFF_CURVE]
CODES = {"weak_public_key", "non_canonical_public_key", "public_key_not_on_curve"}


def pg(api_or_url: ApiServer | str) -> str:
    url = api_or_url if isinstance(api_or_url, str) else api_or_url.db_url  # type: ignore[attr-defined]
    return url.replace("postgresql+psycopg://", "postgresql://")


def counts(url: str) -> dict[str, int]:
    with psycopg.connect(pg(url)) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM signing_keys), (SELECT count(*) FROM audit_events), "
            "(SELECT count(*) FROM envelopes), (SELECT count(*) FROM log_entries), "
            "(SELECT size FROM log_state)").fetchone()
    assert row is not None
    return dict(zip(("keys", "audit", "envelopes", "entries", "size"), map(int, row),
                    strict=True))


def insert_key_as_superuser(url: str, public_key: bytes, name: str) -> str:
    kid = key_id(public_key)
    with psycopg.connect(pg(url)) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute("INSERT INTO signing_keys (keyid, public_key, purpose, name) "
                     "VALUES (%s, %s, 'producer', %s) ON CONFLICT DO NOTHING",
                     (kid, public_key, name))
    return kid


def forged_envelope(keyid: str, sig: bytes = FORGED_SIG,
                    st: dict[str, Any] | None = None) -> dict[str, Any]:
    payload = canonical_json(st or statement())
    return {"payload": base64.b64encode(payload).decode(),
            "payloadType": dsse.PAYLOAD_TYPE_INTOTO,
            "signatures": [{"keyid": keyid, "sig": base64.b64encode(sig).decode()}]}


def openssl_accepts(pk: bytes, env: dict[str, Any]) -> bool:
    message = dsse.pae(env["payloadType"], base64.b64decode(env["payload"]))
    try:
        Ed25519PublicKey.from_public_bytes(pk).verify(
            base64.b64decode(env["signatures"][0]["sig"]), message)
    except InvalidSignature:
        return False
    return True


def assert_problem(r: Any, code: str | set[str]) -> None:
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    codes = {code} if isinstance(code, str) else code
    assert r.json()["code"] in codes, r.text


# --- registration ---


def test_post_keys_refuses_every_weak_key_and_writes_nothing(api: ApiServer) -> None:
    before = counts(api.db_url)  # type: ignore[attr-defined]
    with api.client("admin") as c:
        for pk in WEAK:
            r = c.post("/v1/keys", json={"public_key": base64.b64encode(pk).decode(),
                                         "purpose": "producer", "name": "forger"})
            assert_problem(r, CODES)
            assert r.status_code == 422
        for pk in (IDENTITY, MIXED):
            pem = ("-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(SPKI_PREFIX + pk).decode()
                   + "\n-----END PUBLIC KEY-----\n")
            r = c.post("/v1/keys", json={"public_key": pem, "purpose": "worker",
                                         "name": "forger"})
            assert_problem(r, "weak_public_key")
        # the codes say which rule: a small-order key, a y >= p spelling, off the curve
        r = c.post("/v1/keys", json={"public_key": base64.b64encode(IDENTITY).decode(),
                                     "purpose": "producer", "name": "forger"})
        assert r.json()["code"] == "weak_public_key" and "small-order" in r.json()["detail"]
        r = c.post("/v1/keys", json={"public_key": base64.b64encode(NON_CANONICAL[9]).decode(),
                                     "purpose": "producer", "name": "forger"})
        assert r.json()["code"] == "non_canonical_public_key"
        r = c.post("/v1/keys", json={"public_key": base64.b64encode(OFF_CURVE).decode(),
                                     "purpose": "producer", "name": "forger"})
        assert r.json()["code"] == "public_key_not_on_curve"
    assert counts(api.db_url) == before  # type: ignore[attr-defined]
    # an honest key still registers (the refusals above are not a broken endpoint)
    honest = public_raw(Ed25519PrivateKey.generate())
    with api.client("admin") as c:
        r = c.post("/v1/keys", json={"public_key": base64.b64encode(honest).decode(),
                                     "purpose": "producer", "name": "honest"})
    assert r.status_code == 201, r.text
    assert counts(api.db_url)["keys"] == before["keys"] + 1  # type: ignore[attr-defined]


def test_register_key_service_refuses_weak_keys(api: ApiServer) -> None:
    before = counts(api.db_url)  # type: ignore[attr-defined]
    engine = make_engine(url=api.db_url, pool_size=1)  # type: ignore[attr-defined]
    try:
        for pk in WEAK:
            with pytest.raises(KeyError_) as err, session_scope(engine) as session:
                register_key(session, public_key=pk, purpose="producer", name="forger")
            assert err.value.code in CODES
    finally:
        engine.dispose()
    assert counts(api.db_url) == before  # type: ignore[attr-defined]


def ledger_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "250", **env}, timeout=120)


def test_cli_keys_register_refuses_weak_keys_in_one_line(api: ApiServer, tmp_path: Path) -> None:
    before = counts(api.db_url)  # type: ignore[attr-defined]
    env = {"LEDGER_DATABASE_URL": api.db_url}  # type: ignore[attr-defined]
    cases = [(IDENTITY, "weak_public_key"), (sorted(SMALL_ORDER_ENCODINGS)[-1], "weak_public_key"),
             (NON_CANONICAL[4], "non_canonical_public_key"), (MIXED, "weak_public_key")]
    for i, (pk, code) in enumerate(cases):
        key_file = tmp_path / f"weak{i}.pub"
        if i % 2:
            key_file.write_text("-----BEGIN PUBLIC KEY-----\n"
                                + base64.b64encode(SPKI_PREFIX + pk).decode()
                                + "\n-----END PUBLIC KEY-----\n")
        else:
            key_file.write_text(base64.b64encode(pk).decode() + "\n")
        for extra in ([], ["--api"]):
            r = ledger_cli("keys", "register", str(key_file), "--purpose", "producer",
                           "--name", "forger", *extra,
                           env={**env, "LEDGER_API_URL": api.base_url,
                                "LEDGER_API_KEY": api.keys["admin"]})
            assert r.returncode == 1, r.stdout + r.stderr
            assert "Traceback" not in r.stdout + r.stderr
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"refused: {code}: "), r.stderr
    assert counts(api.db_url) == before  # type: ignore[attr-defined]
    good = tmp_path / "good.pub"
    good.write_text(base64.b64encode(public_raw(Ed25519PrivateKey.generate())).decode())
    r = ledger_cli("keys", "register", str(good), "--purpose", "producer", "--name", "honest",
                   env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["created"] is True


# --- ingest ---


def test_forged_envelope_under_a_small_order_key_is_refused(api: ApiServer) -> None:
    """A superuser puts the identity point into signing_keys; its "signature" R = identity,
    S = 0 verifies in OpenSSL over any payload. Ingest refuses it, writing nothing."""
    kid = insert_key_as_superuser(api.db_url, IDENTITY, "superuser-planted")  # type: ignore[attr-defined]
    env = forged_envelope(kid)
    assert openssl_accepts(IDENTITY, env)
    before = counts(api.db_url)  # type: ignore[attr-defined]
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes", json=env)
        assert_problem(r, "weak_public_key")
        assert r.status_code == 422
        batch = c.post("/v1/envelopes/batch", json={"envelopes": [env, forged_envelope(kid)]})
        assert batch.status_code == 200, batch.text
        body = batch.json()
        assert [x["status"] for x in body["results"]] == [422, 422]
        assert {x["problem"]["code"] for x in body["results"]} == {"weak_public_key"}
        assert body["created"] == 0 and body["rejected"] == 2
        atomic = c.post("/v1/envelopes/batch?atomic=true", json={"envelopes": [env]})
        assert_problem(atomic, "batch_rejected")
        assert atomic.status_code == 422
        assert atomic.json()["results"][0]["problem"]["code"] == "weak_public_key"
    assert counts(api.db_url) == before  # type: ignore[attr-defined]


def test_every_small_order_key_planted_by_a_superuser_is_refused_at_ingest(
        api: ApiServer) -> None:
    envs = []
    for pk in sorted(SMALL_ORDER_ENCODINGS):
        kid = insert_key_as_superuser(api.db_url, pk, f"planted-{pk.hex()[:8]}")  # type: ignore[attr-defined]
        envs.append(forged_envelope(kid))
    before = counts(api.db_url)  # type: ignore[attr-defined]
    with api.client("ingester") as c:
        body = c.post("/v1/envelopes/batch", json={"envelopes": envs}).json()
    assert [x["status"] for x in body["results"]] == [422] * len(envs)
    assert {x["problem"]["code"] for x in body["results"]} == {"weak_public_key"}
    assert counts(api.db_url) == before  # type: ignore[attr-defined]


def test_forged_or_non_canonical_signature_under_a_registered_key_is_refused(
        api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    kid = key_id(public_raw(key))
    honest = signed(statement(), key)
    sig = base64.b64decode(honest["signatures"][0]["sig"])
    s_plus_l = sig[:32] + (int.from_bytes(sig[32:], "little") + L).to_bytes(32, "little")
    cases = [(forged_envelope(kid), "weak_signature"),
             ({**honest, "signatures": [{"keyid": kid,
                                         "sig": base64.b64encode(s_plus_l).decode()}]},
              "non_canonical_signature")]
    before = counts(api.db_url)  # type: ignore[attr-defined]
    with api.client("ingester") as c:
        for env, code in cases:
            r = c.post("/v1/envelopes", json=env)
            assert_problem(r, code)
        body = c.post("/v1/envelopes/batch", json={"envelopes": [e for e, _ in cases]}).json()
        assert [x["problem"]["code"] for x in body["results"]] == [c for _, c in cases]
        assert counts(api.db_url) == before  # type: ignore[attr-defined]
        assert c.post("/v1/envelopes", json=honest).status_code == 201


# --- audit of records stored before the strict rules ---


def test_audit_refuses_a_forged_envelope_stored_by_an_older_ledger(
        db_url: str, tmp_path: Path) -> None:
    """Strict rules apply to stored records too: an envelope that a lenient ledger once
    accepted (stored here without verification, as it would have been) fails
    ``ledger audit --signatures`` with the reason, while its honest neighbours pass."""
    _, producer = provision(db_url)
    origin = "ledger.test/forged"
    signer = LogSigner(origin, generate_private_key())
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    kid = insert_key_as_superuser(db_url, IDENTITY, "planted")
    forged = dsse.envelope_from_obj(forged_envelope(kid))
    assert openssl_accepts(IDENTITY, forged_envelope(kid, st=json.loads(forged.payload)))
    try:
        with session_scope(engine) as s:
            signer.ensure_registered(s)
            assert all(r.status == 201 for r in ingest.ingest(
                s, [signed(statement(), producer) for _ in range(3)], settings))
            # what a lenient ledger did: ingest.prepare without the (strict) verification
            st = parse_statement(forged.payload, Limits())
            dsse_bytes = forged.canonical_bytes()
            old = ingest.Prepared(dsse_bytes, hashlib.sha256(dsse_bytes).digest(), [kid],
                                  index_fields(st), st.predicate.runtime.model_dump(mode="json"))
            conn = s.connection().connection.driver_connection
            with conn.cursor() as cur:
                forged_index = ingest._write(cur, [old])
            assert all(r.status == 201 for r in ingest.ingest(
                s, [signed(statement(), producer)], settings))
        integrate_all(engine, signer, max_entries=10)
        report = audit(engine, origin, signatures=True)
    finally:
        engine.dispose()
    assert not report.ok
    assert report.signatures_checked == 4
    assert report.first_bad_index == forged_index
    assert len(report.problems) == 1 and "small-order" in report.problems[0], report.problems
    # the same through the command line, with the key file of the log
    key_file = tmp_path / "log.pem"
    key_file.write_bytes(private_pem(signer.key))
    r = ledger_cli("audit", "--signatures",
                   env={"LEDGER_DATABASE_URL": db_url, "LEDGER_LOG_NAME": origin,
                        "LEDGER_LOG_KEY_FILE": str(key_file)})
    assert r.returncode != 0, r.stdout + r.stderr
    assert "small-order" in r.stdout + r.stderr

