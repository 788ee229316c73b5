"""Retrying ingest clients, the way a gateway's shipper behaves: the same batch is sent
again after a connection error or a 503/429 (honouring Retry-After) until it is answered.
Idempotency by request_id makes every retry safe."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Tally:
    acknowledged: dict[str, int] = field(default_factory=dict)   # request_id -> log index
    statuses: Counter[int] = field(default_factory=Counter)
    retry_after_missing: int = 0
    connection_errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def send_batches(base_url: str, api_key: str, batches: list[list[dict[str, Any]]],
                 tally: Tally, *, deadline: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as http:
        for batch in batches:
            body = json.dumps({"envelopes": batch}).encode()
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError("a batch was never acknowledged")
                try:
                    r = http.post("/v1/envelopes/batch", content=body)
                except httpx.HTTPError:
                    with tally.lock:
                        tally.connection_errors += 1
                    time.sleep(0.2)
                    continue
                with tally.lock:
                    tally.statuses[r.status_code] += 1
                if r.status_code in (429, 503):
                    if "retry-after" not in r.headers:
                        with tally.lock:
                            tally.retry_after_missing += 1
                    time.sleep(min(float(r.headers.get("retry-after", "1")), 2.0) / 4)
                    continue
                assert r.status_code == 200, (r.status_code, r.text[:300])
                results = r.json()["results"]
                assert all(x["status"] in (200, 201) for x in results), results[:3]
                with tally.lock:
                    for x in results:
                        prior = tally.acknowledged.setdefault(x["request_id"], x["log_index"])
                        assert prior == x["log_index"], "one request_id, two log indices"
                break


class ClientPool:
    """``n_clients`` threads sending their share of ``batches`` until acknowledged."""

    def __init__(self, base_url: str, api_key: str, batches: list[list[dict[str, Any]]],
                 n_clients: int, tally: Tally, timeout: float = 240) -> None:
        self.errors: list[BaseException] = []
        deadline = time.monotonic() + timeout

        def target(part: list[list[dict[str, Any]]]) -> None:
            try:
                send_batches(base_url, api_key, part, tally, deadline=deadline)
            except BaseException as exc:  # noqa: BLE001 - surfaced by join()
                self.errors.append(exc)

        self.threads = [threading.Thread(target=target, args=(batches[i::n_clients],),
                                         daemon=True) for i in range(n_clients)]
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join()
        if self.errors:
            raise self.errors[0]
