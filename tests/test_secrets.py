"""Secrets: private keys are never logged or returned by the API; key files are 0600;
API keys are stored as HMAC, never in clear."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import psycopg
from cryptography.hazmat.primitives import serialization

from ledger.core.keys import load_private_pem
from tests.conftest import provision
from tests.helpers import REPO, free_port, run_server, shared_broker_url, signed, statement


def _private_forms(pem: bytes) -> list[bytes]:
    key = load_private_pem(pem)
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    return [raw.hex().encode(), base64.b64encode(raw), b"PRIVATE KEY",
            pem.split(b"\n")[1][:40]]


def test_private_keys_never_logged_or_served(db_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "LEDGER_DATABASE_URL": db_url, "COLUMNS": "200"}
    keys_dir = tmp_path / "keys"
    for name in ("log", "service", "gateway"):
        out = subprocess.run([sys.executable, "-m", "ledger.cli.main", "keys", "generate",
                              "--out", str(keys_dir / f"{name}.pem")], cwd=REPO, env=env,
                             capture_output=True, timeout=60)
        assert out.returncode == 0
        mode = stat.S_IMODE((keys_dir / f"{name}.pem").stat().st_mode)
        assert mode == 0o600, oct(mode)
        for secret in _private_forms((keys_dir / f"{name}.pem").read_bytes()):
            assert secret not in out.stdout and secret not in out.stderr
    api_keys, producer = provision(db_url)
    extra = {"LEDGER_LOG_KEY_FILE": str(keys_dir / "log.pem"),
             "LEDGER_SERVICE_KEY_FILE": str(keys_dir / "service.pem"),
             "LEDGER_BROKER_URL": shared_broker_url(),
             "LEDGER_METRICS_PORT": str(metrics_port := free_port())}
    with run_server(db_url, extra_env={**extra}, log_dir=tmp_path) as server:
        headers = {"Authorization": f"Bearer {api_keys['admin']}"}
        bodies = []
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as c:
            env_ = signed(statement(), producer)
            ingest = c.post("/v1/envelopes", json=env_,  # with a receipt (integrator ran)
                            headers={"Authorization": f"Bearer {api_keys['ingester']}"},
                            params={"wait": True})
            assert ingest.status_code == 201 and ingest.json()["receipt"]
            bodies.append(ingest.content)
            for path in ("/v1/keys", "/v1/log/checkpoint", "/v1/api-keys", "/v1/audit-events",
                         "/v1/export", "/openapi.json",
                         f"http://127.0.0.1:{metrics_port}/metrics"):
                r = c.get(path)
                assert r.status_code == 200, (path, r.text[:200])
                bodies.append(r.content)
        log_text = Path(server.log_path).read_bytes() if server.log_path else b""
    for name in ("log", "service"):
        for secret in _private_forms((keys_dir / f"{name}.pem").read_bytes()):
            for body in bodies:
                assert secret not in body, (name, secret[:10])
            assert secret not in log_text
    # API keys: only an HMAC is stored
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        stored = [bytes(r[0]) for r in conn.execute("SELECT key_hash FROM api_keys")]
        dumped = b"".join(bytes(str(r), "utf-8") for r in conn.execute("SELECT * FROM api_keys"))
    assert all(len(h) == 32 for h in stored)
    for key in api_keys.values():
        assert key.encode() not in dumped
