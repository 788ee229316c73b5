"""Fixtures for the capture tests: real servers on free ports, real ledger, real engine.

- ``engine_server``: ``ledger engine serve --model tiny-demo`` (a subprocess, one per
  session), with the fingerprint it writes;
- ``api`` (tests/conftest.py): a real ``ledger serve`` on a fresh PostgreSQL database with
  API keys for every role and a registered producer key;
- ``capture_files``: the producer key PEM, artifacts JSON and fingerprint JSON that
  ``ledger proxy`` and ``Recorder.from_files`` read;
- ``proxy_server``: ``ledger proxy`` in front of ``engine_server``, recording to ``api``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger import artifacts
from ledger.core.keys import private_pem
from tests.helpers import REPO, ApiServer, free_port, run_ledger

TINY_DEMO_DIR = REPO / "workers" / "engine" / "tiny_demo"


@dataclass
class Process:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@contextmanager
def run_process(args: list[str], *, health_path: str, port: int, log_path: Path,
                env: dict[str, str] | None = None, timeout: float = 60.0) -> Iterator[Process]:
    """Start ``python -m ledger.cli.main ARGS`` and wait for ``GET health_path`` to answer."""
    with run_ledger(args, port=port, health_path=health_path, log_path=log_path, env=env,
                    timeout=timeout) as (base, proc):
        yield Process(base, proc, log_path)


@pytest.fixture(scope="session")
def engine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """``ledger engine serve`` for tiny-demo; its fingerprint file is ``fingerprint.json``."""
    d = tmp_path_factory.mktemp("engine")
    port = free_port()
    with run_process(["engine", "serve", "--model", "tiny-demo", "--port", str(port),
                      "--max-batch", "8", "--warm-up-len", "256",
                      "--write-fingerprint", str(d / "fingerprint.json")],
                     health_path="/health", port=port, log_path=d / "engine.log") as p:
        yield p


@pytest.fixture(scope="session")
def engine_runtime(engine_server: Process) -> dict[str, Any]:
    runtime: dict[str, Any] = httpx.get(engine_server.base_url + "/ledger/fingerprint").json()[
        "runtime"]
    return runtime


@dataclass
class CaptureFiles:
    key: Path
    artifacts: Path
    fingerprint: Path
    artifacts_doc: dict[str, Any]


@pytest.fixture(scope="module")
def capture_files(api: ApiServer, engine_runtime: dict[str, Any],
                  tmp_path_factory: pytest.TempPathFactory) -> CaptureFiles:
    """Key (the registered producer of ``api``), artifacts and fingerprint files."""
    from ledger.core.fingerprint import fingerprint_id

    d = tmp_path_factory.mktemp("capture")
    key = d / "producer.pem"
    key.write_bytes(private_pem(api.producer))  # type: ignore[attr-defined]
    doc = artifacts.artifact_hashes(TINY_DEMO_DIR, model_name="tiny-demo")
    (d / "artifacts.json").write_text(json.dumps(doc))
    (d / "fingerprint.json").write_text(json.dumps(
        {"fingerprint_id": fingerprint_id(engine_runtime), "runtime": engine_runtime}))
    return CaptureFiles(key, d / "artifacts.json", d / "fingerprint.json", doc)


def proxy_args(files: CaptureFiles, upstream: str, port: int, spool: Path,
               *extra: str) -> list[str]:
    return ["proxy", "--upstream", upstream, "--port", str(port), "--key", str(files.key),
            "--artifacts", str(files.artifacts), "--fingerprint", str(files.fingerprint),
            "--spool", str(spool), "--max-backoff", "1", *extra]


def ledger_env(api: ApiServer) -> dict[str, str]:
    return {"LEDGER_API_URL": api.base_url, "LEDGER_API_KEY": api.keys["ingester"]}


@pytest.fixture(scope="module")
def proxy_server(api: ApiServer, engine_server: Process, capture_files: CaptureFiles,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    d = tmp_path_factory.mktemp("proxy")
    port = free_port()
    with run_process(proxy_args(capture_files, engine_server.base_url, port, d / "spool"),
                     health_path="/ledger/capture/status", port=port,
                     log_path=d / "proxy.log", env=ledger_env(api)) as p:
        yield p


def wait_for_envelope(api: ApiServer, request_id: str, timeout: float = 20.0) -> dict[str, Any]:
    """The statement stored under ``request_id``, once the ledger has it."""
    import base64

    deadline = time.monotonic() + timeout
    with api.client("reviewer") as c:
        while True:
            r = c.get(f"/v1/envelopes/{request_id}")
            if r.status_code == 200:
                statement: dict[str, Any] = json.loads(
                    base64.b64decode(r.json()["dsse"]["payload"]))
                return statement
            assert r.status_code == 404, r.text
            if time.monotonic() > deadline:
                raise AssertionError(f"envelope {request_id} did not arrive")
            time.sleep(0.05)


def envelope_count(api: ApiServer) -> int:
    import psycopg

    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM envelopes").fetchone()
    assert row is not None
    return int(row[0])
