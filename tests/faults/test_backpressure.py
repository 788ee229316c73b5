"""A burst of ten times the measured ingest capacity: the API sheds load with 503 and
Retry-After instead of collapsing, its memory stays bounded, and every envelope the
retrying clients send ends up stored exactly once."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import psycopg

from tests.conftest import provision
from tests.faults.clients import ClientPool, Tally
from tests.faults.test_api_sigkill import start_api
from tests.helpers import free_port, signed, statement


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_burst_of_ten_times_capacity_is_shed_not_collapsed(db_url: str, tmp_path: Path) -> None:
    keys, producer = provision(db_url)
    port = free_port()
    metrics_port = free_port()
    env = {"LEDGER_MAX_INFLIGHT_REQUESTS": "4", "LEDGER_METRICS_PORT": str(metrics_port)}
    api = start_api(db_url, port, env, tmp_path / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        # measured capacity: one client, back to back, for ~2 s
        warm = [signed(statement(prompt_len=64, output_len=16), producer) for _ in range(400)]
        headers = {"Authorization": f"Bearer {keys['ingester']}",
                   "Content-Type": "application/json"}
        sent, started = 0, time.perf_counter()
        with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
            for i in range(0, len(warm), 20):
                r = http.post("/v1/envelopes/batch",
                              content=json.dumps({"envelopes": warm[i:i + 20]}).encode())
                assert r.status_code == 200
                sent += 20
                if time.perf_counter() - started > 2:
                    break
        capacity = sent / (time.perf_counter() - started)  # envelopes per second
        burst_n = int(capacity * 10)
        burst = [signed(statement(prompt_len=64, output_len=16), producer)
                 for _ in range(burst_n)]
        batches = [burst[i:i + 20] for i in range(0, burst_n, 20)]
        rss_before = rss_kib(api.pid)
        peak = [rss_before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_kib(api.pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        tally = Tally()
        ClientPool(base, keys["ingester"], batches, 40, tally, timeout=300).join()
        stop.set()
        sampler.join()
        assert tally.statuses[503] > 0, "nothing was shed: the burst did not exceed capacity"
        assert 500 not in tally.statuses and tally.retry_after_missing == 0, tally.statuses
        assert len(tally.acknowledged) == burst_n
        with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
            count = conn.execute("SELECT count(*) FROM envelopes").fetchone()[0]
        assert count == sent + burst_n
        # bounded memory: 4 requests in flight at most, whatever the burst
        assert peak[0] - rss_before < 150 * 1024, (rss_before, peak[0])
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert "ledger_requests_shed_total" in metrics
    finally:
        api.terminate()
        api.wait(20)
