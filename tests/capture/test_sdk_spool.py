"""Acceptance 3: 1,000 requests flow through the SDK while the ledger is down; the gateway
restarts too; the ledger comes back (and is killed once more mid-delivery): every
envelope arrives exactly once."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import psycopg

from ledger import artifacts
from ledger.capture import Recorder, wrap_openai
from ledger.core.fingerprint import fingerprint_id
from ledger.core.keys import private_pem
from tests.capture.conftest import TINY_DEMO_DIR, Process, run_process
from tests.conftest import provision
from tests.helpers import free_port

TOTAL, BEFORE_OUTAGE = 1000, 100


def _db_rows(db_url: str) -> tuple[list[str], int]:
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        ids = [r[0] for r in conn.execute("SELECT request_id FROM envelopes")]
        row = conn.execute("SELECT count(*) FROM log_entries").fetchone()
    assert row is not None
    return ids, int(row[0])


def test_thousand_requests_through_a_ledger_outage_arrive_exactly_once(
    db_url: str, engine_server: Process, engine_runtime: dict[str, Any], tmp_path: Path,
) -> None:
    keys, producer = provision(db_url)
    (tmp_path / "key.pem").write_bytes(private_pem(producer))
    (tmp_path / "artifacts.json").write_text(json.dumps(
        artifacts.artifact_hashes(TINY_DEMO_DIR, model_name="tiny-demo")))
    (tmp_path / "fingerprint.json").write_text(json.dumps(
        {"fingerprint_id": fingerprint_id(engine_runtime), "runtime": engine_runtime}))
    port = free_port()
    starts = iter(range(10))

    @contextmanager
    def ledger() -> Iterator[Process]:
        with run_process(["serve", "--port", str(port)], health_path="/healthz", port=port,
                         env={"LEDGER_DATABASE_URL": db_url},
                         log_path=tmp_path / f"ledger-{next(starts)}.log") as p:
            yield p

    def recorder() -> Recorder:
        return Recorder.from_files(
            key=tmp_path / "key.pem", artifacts=tmp_path / "artifacts.json",
            fingerprint=tmp_path / "fingerprint.json", spool_dir=tmp_path / "spool",
            ledger_url=f"http://127.0.0.1:{port}", api_key=keys["ingester"],
            max_backoff=0.5)

    def send_all(rec: Recorder, indices: range) -> list[float]:
        client = wrap_openai(openai.OpenAI(base_url=engine_server.base_url + "/v1",
                                           api_key="unused", max_retries=0), rec)

        def one(i: int) -> float:
            started = time.perf_counter()
            completion = client.completions.create(
                model="tiny-demo", prompt=f"request {i}", max_tokens=2, temperature=0,
                extra_headers={"X-Request-Id": f"spool-{i}"})
            assert completion.id == f"cmpl-spool-{i}"
            assert completion.choices[0].logprobs is None      # not asked, not shown
            return time.perf_counter() - started

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, indices))

    # 1. the ledger is up: the first 100 are delivered as they come
    first = recorder()
    with ledger():
        send_all(first, range(BEFORE_OUTAGE))
        assert first.wait_delivered(30)
    assert len(_db_rows(db_url)[0]) == BEFORE_OUTAGE

    # 2. the ledger is down: 900 more requests are served and spooled
    latencies = send_all(first, range(BEFORE_OUTAGE, TOTAL))
    assert first.flush(30)
    assert first.spool.pending_count() == TOTAL - BEFORE_OUTAGE
    assert first.stats()["shipper"]["last_error"] is not None     # it did try
    first.close()                       # the gateway restarts too: only the spool remains
    assert sorted(latencies)[len(latencies) // 2] < 1.0

    # 3. a new recorder on the same spool; the ledger comes back, is killed mid-delivery,
    #    and comes back again
    second = recorder()
    with ledger() as server:
        deadline = time.monotonic() + 30
        while second.spool.pending_count() > TOTAL - BEFORE_OUTAGE - 150:
            assert time.monotonic() < deadline, "delivery did not start"
            time.sleep(0.005)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    with ledger():
        assert second.wait_delivered(60), second.stats()
    stats = second.stats()
    second.close()

    ids, log_entries = _db_rows(db_url)
    assert sorted(ids) == sorted(f"cmpl-spool-{i}" for i in range(TOTAL))   # all, once each
    assert log_entries == TOTAL
    assert stats["spool"]["pending"] == 0 and stats["spool"]["quarantined"] == 0
    assert stats["invalid"] == 0 and stats["not_captured"] == 0
