"""The background shipper: delivers spooled envelopes to the ledger's batch ingest.

Answers and what they do (``POST /v1/envelopes/batch``, one result per item):

- item 201 or 200: delivered, the row is deleted (200: already stored, a retry);
- item 409: a permanent conflict (other bytes under that request_id): quarantined;
- item, another 4xx: permanently refused (bad signature, unknown key, invalid):
  quarantined with the ledger's problem document;
- whole request 5xx, 429, 408, a connection error or a timeout: retried, the whole spool
  backing off exponentially (with jitter, honouring ``Retry-After``);
- whole request 401, 403 or 404: a configuration problem (API key, URL): retried with
  backoff and logged as an error; nothing is quarantined;
- whole request 413 or another 4xx: the batch is halved; a single envelope refused this
  way is quarantined;
- an item with an unexpected status: that envelope alone is retried later, with its own
  backoff.

Only one process ships a spool at a time (a ``flock`` on ``ship.lock``); others keep
writing and take over when it goes away.
"""

from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from ledger.capture.spool import Spool, SpooledEnvelope, shipping_lock

log = logging.getLogger("ledger.capture")

BATCH_PATH = "/v1/envelopes/batch"


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header (delay-seconds or HTTP-date) as seconds from now."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Shipper:
    """Delivers a spool's envelopes on a daemon thread until :meth:`stop`."""

    def __init__(self, spool: Spool, ledger_url: str, api_key: str | None, *,
                 batch_size: int = 100, batch_bytes: int = 8 << 20,
                 min_backoff: float = 0.25, max_backoff: float = 30.0,
                 timeout: float = 30.0, linger: float = 0.05) -> None:
        self.spool = spool
        self.ledger_url = ledger_url.rstrip("/")
        self.api_key = api_key
        self.batch_size = self._batch_limit = max(1, batch_size)
        self.batch_bytes = batch_bytes
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.timeout = timeout
        self.linger = linger
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._failures = 0
        self._backoff_until = 0.0
        self.last_error: str | None = None
        self.holds_lock = False
        self._thread = threading.Thread(target=self._run, name="ledger-capture-shipper",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ loop
    def _sleep(self, seconds: float) -> None:
        self.wake.wait(max(0.0, seconds))
        self.wake.clear()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with shipping_lock(self.spool.directory) as held:
                    self.holds_lock = held
                    if held:
                        self._ship_while_held()
                        return
                self._sleep(1.0)                # another process ships; check back later
        finally:
            self.spool.close_thread_connection()

    def _ship_while_held(self) -> None:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        with httpx.Client(base_url=self.ledger_url, headers=headers,
                          timeout=self.timeout) as client:
            lingered = False
            while not self._stop.is_set():
                now = time.time()
                if now < self._backoff_until:
                    self._sleep(self._backoff_until - now)
                    continue
                batch = self.spool.due(self.batch_size, self.batch_bytes)
                if not batch:
                    nxt = self.spool.next_due_at()
                    self._sleep(1.0 if nxt is None else min(1.0, nxt - time.time()))
                    continue
                if len(batch) < self.batch_size and self.linger > 0 and not lingered:
                    # a partial batch waits a moment for company: one request per few
                    # envelopes instead of one per envelope (the ledger's CPU is shared)
                    lingered = True
                    self._stop.wait(self.linger)
                    continue
                lingered = False
                self._send(client, batch)

    # ------------------------------------------------------------------ one request
    def _backoff(self, reason: str, retry_after: float | None = None) -> None:
        self._failures += 1
        delay = min(self.max_backoff, self.min_backoff * 2 ** min(self._failures - 1, 20))
        delay *= random.uniform(0.5, 1.0)       # noqa: S311 - jitter, not crypto
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff))
        self._backoff_until = time.time() + delay
        if reason != self.last_error:
            log.warning("ledger delivery failed (%s); retrying in %.2fs", reason, delay)
        self.last_error = reason

    def _ok(self) -> None:
        self._failures = 0
        self.last_error = None
        self.batch_size = self._batch_limit

    def _send(self, client: httpx.Client, batch: Sequence[SpooledEnvelope]) -> None:
        body = b'{"envelopes":[' + b",".join(e.body for e in batch) + b"]}"
        try:
            response = client.post(BATCH_PATH, content=body)
        except httpx.HTTPError as exc:
            self._backoff(f"{type(exc).__name__}: {exc}")
            return
        status = response.status_code
        if status == 200:
            self._ok()
            self._settle(batch, response)
            return
        retry_after = retry_after_seconds(response.headers.get("retry-after"))
        if status >= 500 or status in (401, 403, 404, 408, 429):
            if status in (401, 403, 404):
                log.error("the ledger answered %s to batch ingest: check the API key "
                          "(ingester role) and the ledger URL", status)
            self._backoff(f"HTTP {status}", retry_after)
            return
        # another 4xx about the batch as a whole: find the envelope it is about
        if len(batch) > 1:
            self.batch_size = max(1, len(batch) // 2)
            return
        self.spool.quarantine(batch[0].seq, status, _problem(response))
        log.error("envelope %s refused by the ledger (HTTP %s): quarantined",
                  batch[0].request_id, status)

    def _settle(self, batch: Sequence[SpooledEnvelope], response: httpx.Response) -> None:
        try:
            results = response.json()["results"]
            assert isinstance(results, list) and len(results) == len(batch)
        except (ValueError, KeyError, TypeError, AssertionError):
            self._backoff("the ledger's batch answer is not understood")
            return
        delivered: list[int] = []
        existing = 0
        later: list[int] = []
        for envelope, result in zip(batch, results, strict=True):
            status = result.get("status") if isinstance(result, dict) else None
            if status in (200, 201):
                delivered.append(envelope.seq)
                existing += status == 200
            elif isinstance(status, int) and 400 <= status < 500 and status not in (408, 424,
                                                                                   429):
                problem = result.get("problem") or {"status": status}
                self.spool.quarantine(envelope.seq, status, problem)
                log.error("envelope %s refused by the ledger (%s %s): quarantined",
                          envelope.request_id, status, problem.get("code"))
            else:
                later.append(envelope.seq)
        self.spool.delivered(delivered, existing=existing)
        if later:
            attempts = max(e.attempts for e in batch if e.seq in later) + 1
            delay = min(self.max_backoff, self.min_backoff * 2 ** min(attempts, 20))
            self.spool.retry_later(later, time.time() + delay,
                                   "unexpected per-item status from the ledger")


def _problem(response: httpx.Response) -> dict[str, Any]:
    try:
        doc = response.json()
        if isinstance(doc, dict):
            return doc
    except ValueError:
        pass
    return {"status": response.status_code, "detail": response.text[:2000]}
