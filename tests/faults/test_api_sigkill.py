"""SIGKILL the API in the middle of 10,000 envelopes sent by retrying clients, restart it:
every envelope is stored exactly once, the log is gap-free, `ledger audit` is clean and no
checkpoint disagrees with storage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg

from ledger.core.keys import generate_private_key, private_pem
from tests.conftest import provision
from tests.faults.clients import ClientPool, Tally
from tests.helpers import REPO, component_env, free_port, signed, statement

N = int(os.environ.get("LEDGER_FAULT_SCALE", "1")) * 10_000  # benchmarks/faults.py scales it
BATCH = 50


def start_api(db_url: str, port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ledger.cli.main", "serve", "--port", str(port)],
        env={**os.environ, **component_env(["serve"], {**env, "LEDGER_DATABASE_URL": db_url})},
        cwd=REPO,
        stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(log.read_text()[-2000:])


def test_sigkill_api_mid_ingest_loses_and_duplicates_nothing(db_url: str, tmp_path: Path) -> None:
    keys, producer = provision(db_url)
    key_file = tmp_path / "log.pem"
    key_file.write_bytes(private_pem(generate_private_key()))
    env = {"LEDGER_LOG_KEY_FILE": str(key_file), "LEDGER_LOG_NAME": "ledger.test/faults",
           "LEDGER_INTEGRATE_INTERVAL_MS": "50"}
    envelopes = [signed(statement(prompt_len=8, output_len=4), producer) for _ in range(N)]
    batches = [envelopes[i:i + BATCH] for i in range(0, N, BATCH)]
    port = free_port()
    log = tmp_path / "api.log"
    api = start_api(db_url, port, env, log)
    tally = Tally()
    clients = ClientPool(f"http://127.0.0.1:{port}", keys["ingester"], batches, 4, tally)
    while len(tally.acknowledged) < N // 3:
        time.sleep(0.01)
    api.send_signal(signal.SIGKILL)  # mid-ingest: requests in flight die with it
    api.wait()
    killed_at = len(tally.acknowledged)
    time.sleep(1)
    api = start_api(db_url, port, env, log)
    try:
        clients.join()
        assert killed_at < N and tally.connection_errors > 0  # the kill hit live traffic
        assert len(tally.acknowledged) == N
        pg = db_url.replace("+psycopg", "")
        with psycopg.connect(pg) as conn:
            count, distinct, lo, hi = conn.execute(
                "SELECT count(*), count(DISTINCT request_id), min(log_index), max(log_index) "
                "FROM envelopes").fetchone()
            stored = dict(conn.execute("SELECT request_id, log_index FROM envelopes").fetchall())
        assert (count, distinct, lo, hi) == (N, N, 0, N - 1)
        assert stored == tally.acknowledged
        deadline = time.monotonic() + 60
        while True:
            with psycopg.connect(pg) as conn:
                size = conn.execute("SELECT size FROM log_tree").fetchone()[0]
            if size == N or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert size == N
    finally:
        api.terminate()
        api.wait(20)
    audit = subprocess.run([sys.executable, "-m", "ledger.cli.main", "audit"], cwd=REPO,
                           env={**os.environ, **env, "LEDGER_DATABASE_URL": db_url,
                                "COLUMNS": "200"}, capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "OK" in audit.stdout
