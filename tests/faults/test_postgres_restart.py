"""PostgreSQL restarted in the middle of ingest: clients see 503 with Retry-After, never a
500; after retrying nothing is lost; the integrator resumes by itself."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psycopg

from ledger.core.keys import generate_private_key, private_pem
from ledger.db.session import upgrade
from tests.conftest import provision
from tests.faults.clients import ClientPool, Tally
from tests.faults.pg import PrivatePostgres
from tests.faults.test_api_sigkill import start_api
from tests.helpers import free_port, signed, statement

N = int(os.environ.get("LEDGER_FAULT_SCALE", "1")) * 4_000


def test_postgres_restart_mid_ingest(tmp_path: Path) -> None:
    pg = PrivatePostgres()
    try:
        db_url = pg.create_database("ledger")
        upgrade(db_url)
        keys, producer = provision(db_url)
        key_file = tmp_path / "log.pem"
        key_file.write_bytes(private_pem(generate_private_key()))
        env = {"LEDGER_LOG_KEY_FILE": str(key_file), "LEDGER_INTEGRATE_INTERVAL_MS": "50"}
        envelopes = [signed(statement(prompt_len=8, output_len=4), producer) for _ in range(N)]
        batches = [envelopes[i:i + 20] for i in range(0, N, 20)]
        port = free_port()
        api = start_api(db_url, port, env, tmp_path / "api.log")
        tally = Tally()
        try:
            clients = ClientPool(f"http://127.0.0.1:{port}", keys["ingester"], batches, 3,
                                 tally)
            while len(tally.acknowledged) < N // 4:
                time.sleep(0.01)
            pg.stop()
            time.sleep(2.0)  # clients keep sending into the outage
            during = dict(tally.statuses)
            pg.start()
            clients.join()
            # the integrator in the API that lived through the outage resumes by itself
            plain = db_url.replace("+psycopg", "")
            deadline = time.monotonic() + 60
            size = -1
            while time.monotonic() < deadline:
                with psycopg.connect(plain) as conn:
                    size = conn.execute("SELECT size FROM log_tree").fetchone()[0]
                if size == N:
                    break
                time.sleep(0.2)
        finally:
            api.terminate()
            api.wait(20)
        assert size == N
        assert tally.statuses[503] > 0, f"the outage was never seen: {during}"
        assert 500 not in tally.statuses, tally.statuses
        assert tally.retry_after_missing == 0
        assert len(tally.acknowledged) == N
        with psycopg.connect(plain) as conn:
            count, distinct = conn.execute(
                "SELECT count(*), count(DISTINCT request_id) FROM envelopes").fetchone()
            checkpoints = conn.execute("SELECT count(*) FROM checkpoints").fetchone()[0]
        assert (count, distinct) == (N, N) and checkpoints > 1
    finally:
        pg.close()
