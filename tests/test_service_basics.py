"""Health, readiness, metrics, the published schema, the CLI, and no torch in the API."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import httpx
import psycopg
from jsonschema import Draft202012Validator

from ledger.core.envelope import envelope_json_schema
from scripts.gen_schemas import OUT, render
from tests.helpers import REPO, ApiServer, run_server, signed, statement


def test_published_schema_file_is_current_and_validates_an_envelope() -> None:
    for name, text in render().items():
        assert (OUT / name).read_text() == text, f"run scripts/gen_schemas.py ({name})"
    Draft202012Validator.check_schema(envelope_json_schema())
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    Draft202012Validator(envelope_json_schema()).validate(statement())
    del Ed25519PrivateKey


def test_health_ready_metrics_openapi(api: ApiServer) -> None:
    with api.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["revision"]
        schema_id = c.get("/v1/schemas/envelope").json()["$id"]
        assert schema_id == "urn:inference-ledger:envelope:v1:schema"
        assert c.get("/openapi.json").json()["info"]["title"] == "inference-ledger"
    with api.client("ingester") as c:
        c.post("/v1/envelopes", json=signed(statement(), api.producer))  # type: ignore[attr-defined]
        c.post("/v1/envelopes", content=b"{broken", headers={"Content-Type": "application/json"})
    assert httpx.get(api.base_url + "/metrics").status_code == 404  # not on the API port
    text = _metrics(api.metrics_url)  # type: ignore[attr-defined]
    assert 'ledger_envelopes_ingested_total{outcome="created"}' in text
    assert 'ledger_ingest_rejections_total{reason="malformed_json"}' in text
    assert "ledger_http_request_duration_seconds_bucket" in text


def _metrics(url: str) -> str:
    """The metrics listener starts with the server; give it a moment to bind."""
    import time

    for _ in range(50):
        try:
            return httpx.get(url).text
        except httpx.HTTPError:
            time.sleep(0.1)
    return httpx.get(url).text


def test_readyz_is_503_when_migrations_are_pending(db_url: str, tmp_path) -> None:
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'older'")
    with run_server(db_url, log_dir=tmp_path) as server:
        r = httpx.get(server.base_url + "/readyz")
    assert r.status_code == 503 and r.json()["code"] == "migrations_pending"
    assert r.headers["retry-after"]


def test_readyz_is_503_without_database(tmp_path) -> None:
    with run_server("postgresql+psycopg://postgres@127.0.0.1:1/none", log_dir=tmp_path) as server:
        r = httpx.get(server.base_url + "/readyz", timeout=30)
        assert r.status_code == 503 and r.json()["code"] == "database_unreachable"
        with httpx.Client(base_url=server.base_url) as c:
            down = c.get("/v1/keys", headers={"Authorization": "Bearer lk_x"})
        assert down.status_code == 503 and down.headers["retry-after"]


def _ledger(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=120)


def test_cli_keys_generate_register_and_apikey_create(db_url: str, tmp_path) -> None:
    env = {"LEDGER_DATABASE_URL": db_url}
    key_path = tmp_path / "keys" / "gateway.pem"
    gen = _ledger("keys", "generate", "--out", str(key_path))
    assert gen.returncode == 0, gen.stderr
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert "PRIVATE" not in gen.stdout and "PRIVATE" not in gen.stderr
    info = json.loads(gen.stdout)
    again = _ledger("keys", "generate", "--out", str(key_path))
    assert again.returncode == 2 and "--force" in again.stderr  # never overwrites silently
    reg = _ledger("keys", "register", str(key_path) + ".pub", "--purpose", "producer",
                  "--name", "gw-1", env=env)
    assert reg.returncode == 0, reg.stderr
    assert json.loads(reg.stdout)["keyid"] == info["keyid"]
    # from the private key file too: same key, so "created" is false (idempotent)
    reg2 = _ledger("keys", "register", str(key_path), "--purpose", "producer", "--name", "gw-1",
                   env=env)
    assert reg2.returncode == 0 and json.loads(reg2.stdout)["created"] is False
    made = _ledger("apikey", "create", "--role", "reviewer", "--name", "alice", env=env)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    assert key.startswith("lk_")
    bad = _ledger("apikey", "create", "--role", "root", "--name", "x", env=env)
    assert bad.returncode == 2
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        stored = conn.execute("SELECT key_hash FROM api_keys WHERE name = 'alice'").fetchone()
        actions = [r[0] for r in conn.execute("SELECT action FROM audit_events ORDER BY id")]
    assert stored is not None and key.encode() not in bytes(stored[0])
    assert actions == ["key.register", "api_key.create"]


def test_api_process_never_imports_torch() -> None:
    code = ("import sys; import ledger.api.main, ledger.cli.main, ledger.services.ingest; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "LEDGER_DATABASE_URL":
                              "postgresql+psycopg://x@127.0.0.1:1/x"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_held_sha256_is_sha256_at_every_piece_boundary() -> None:
    """ingest's digest of the stored bytes, fed to hashlib in pieces under its GIL
    threshold, is the SHA-256 of the whole, at and around each piece's edge."""
    import hashlib
    import os

    from ledger.services.ingest import _HELD_CHUNK, _sha256_held

    for n in (0, 1, _HELD_CHUNK - 1, _HELD_CHUNK, _HELD_CHUNK + 1, 2 * _HELD_CHUNK,
              2 * _HELD_CHUNK + 1, 18_152, 1 << 20):
        data = os.urandom(n)
        assert _sha256_held(data) == hashlib.sha256(data).digest(), n
