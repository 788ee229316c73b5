"""The recorder: turns captured sequences into signed envelopes, spools and ships them.

``record()`` only puts the capture on an in-memory queue and returns: the caller's
latency never includes signing, the disk or the ledger. A writer thread builds each
statement, validates it with the ledger's own envelope model, signs it, and appends a
batch to the spool in one fsync'd transaction (group commit: one fsync per batch, not per
request). A shipper thread delivers the spool to the ledger (see
:mod:`ledger.capture.shipper`).

Durability: once a batch is committed to the spool, no crash, restart or ledger outage
loses it. Between ``record()`` and that commit (normally a few milliseconds) the capture
lives only in memory; ``flush()`` waits for the commit, and ``close()`` commits everything
queued. A ``kill -9`` of the gateway inside that window loses what was queued.

When the spool is full (``max_bytes`` of pending plus quarantined envelopes):

- ``when_full="fail"`` (default): :meth:`admit` raises :class:`SpoolFull`. The SDK calls
  it *before* sending a request upstream and the proxy answers 503 (with Retry-After),
  so no inference is served that could not be recorded. Requests already in flight are
  still recorded (the quota is a soft limit by those few envelopes).
- ``when_full="drop"``: requests are served and their envelopes are dropped, counted
  (``dropped_full``) and logged as errors.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.capture.config import CaptureConfig, load_key
from ledger.capture.exchange import Captured
from ledger.capture.shipper import Shipper
from ledger.capture.spool import Spool, SpoolFull
from ledger.capture.vendor import DEFAULT_PINNED_HEADERS, VendorCaptured, VendorConfig
from ledger.core.canonical import canonical_json
from ledger.core.envelope import validate_statement
from ledger.core.errors import ValidationFailed
from ledger.core.vendor import build_vendor_statement, validate_vendor_statement
from ledger.producer import build_statement, envelope_to_json, sign_statement

log = logging.getLogger("ledger.capture")

WHEN_FULL = ("fail", "drop")


@dataclass
class _Item:
    captured: Captured | VendorCaptured
    recorded_at: datetime


class Recorder:
    """Sign, spool and ship envelopes for captured inferences (thread-safe)."""

    def __init__(
        self, config: CaptureConfig | VendorConfig, key: Ed25519PrivateKey, *,
        spool_dir: str | Path,
        ledger_url: str | None, api_key: str | None = None, max_bytes: int = 1 << 30,
        when_full: str = "fail", ship: bool = True, batch_size: int = 100,
        min_backoff: float = 0.25, max_backoff: float = 30.0, http_timeout: float = 30.0,
        data_subject: Callable[[Captured], str | None] | None = None,
    ) -> None:
        """``data_subject``: a callback naming the pseudonymous data subject of a capture
        (used where the request carried no ``X-Ledger-Data-Subject`` header); the ledger
        encrypts the envelope under that subject's keys (docs/privacy.md)."""
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}")
        self.config = config
        self.key = key
        self.data_subject = data_subject
        self.when_full = when_full
        self.spool = Spool(spool_dir, max_bytes=max_bytes)
        self._channel, self._tier = config.effective_channel, config.effective_tier
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._cond = threading.Condition()
        self._enqueued = 0
        self._written = 0
        self._counts: dict[str, int] = {
            "recorded": 0, "spooled": 0, "invalid": 0, "dropped_full": 0,
            "unrecordable": 0, "not_captured": 0}
        self._unrecordable_reasons: dict[str, int] = {}
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="ledger-capture-writer",
                                        daemon=True)
        self._writer.start()
        self.shipper: Shipper | None = None
        if ship:
            if not ledger_url:
                raise ValueError("ledger_url is needed to ship envelopes (or ship=False)")
            self.shipper = Shipper(self.spool, ledger_url, api_key, batch_size=batch_size,
                                   min_backoff=min_backoff, max_backoff=max_backoff,
                                   timeout=http_timeout)
            self.shipper.start()

    @classmethod
    def from_files(cls, *, key: str | Path, artifacts: str | Path, fingerprint: str | Path,
                   sampling_defaults: str | Path | None = None, channel: str | None = None,
                   tier: str | None = None, **kw: Any) -> Recorder:
        """A recorder configured from ``ledger keys generate`` / ``ledger artifact hash`` /
        ``ledger fingerprint`` output files."""
        config = CaptureConfig.from_files(artifacts=artifacts, fingerprint=fingerprint,
                                          sampling_defaults=sampling_defaults,
                                          channel=channel, tier=tier)
        return cls(config, load_key(key), **kw)

    @classmethod
    def for_vendor(cls, *, key: str | Path | Ed25519PrivateKey, name: str, base_url: str,
                   assertions: dict[str, Any] | None = None,
                   pinned_headers: tuple[str, ...] | None = None, **kw: Any) -> Recorder:
        """A recorder of a hosted vendor API's calls (the vendor channel, tier semantic:
        :mod:`ledger.capture.vendor`)."""
        config = VendorConfig(name=name, base_url=base_url, assertions=assertions,
                              pinned_headers=pinned_headers or DEFAULT_PINNED_HEADERS)
        private = key if isinstance(key, Ed25519PrivateKey) else load_key(key)
        return cls(config, private, **kw)

    # ------------------------------------------------------------------ caller side
    def admit(self) -> None:
        """Raise :class:`SpoolFull` if a new request must not be served (policy "fail")."""
        if self.when_full == "fail" and not self.spool.has_room():
            raise SpoolFull(f"the capture spool holds {self.spool.used_bytes} bytes "
                            f"(limit {self.spool.max_bytes}); refusing new requests until "
                            "the ledger takes them")

    def record(self, captured: Captured | VendorCaptured, *,
               recorded_at: datetime | None = None) -> None:
        """Queue one captured sequence for signing, spooling and shipping; returns at once."""
        if self._closed:
            raise RuntimeError("the recorder is closed")
        with self._cond:
            self._enqueued += 1
            self._counts["recorded"] += 1
        self._queue.put(_Item(captured, recorded_at or datetime.now(UTC)))

    def note_unrecordable(self, reason: str) -> None:
        """Count a request that was served but cannot be described by an envelope."""
        with self._cond:
            self._counts["unrecordable"] += 1
            self._unrecordable_reasons[reason] = self._unrecordable_reasons.get(reason, 0) + 1
        log.warning("request not recorded: %s", reason)

    def note_not_captured(self, reason: str) -> None:
        """Count a response that yielded no envelope (upstream error, incomplete stream...)."""
        with self._cond:
            self._counts["not_captured"] += 1
        log.warning("response not recorded: %s", reason)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything recorded so far is committed to the spool."""
        with self._cond:
            target = self._enqueued
            return self._cond.wait_for(lambda: self._written >= target, timeout)

    def wait_delivered(self, timeout: float) -> bool:
        """Wait until the spool is empty (everything delivered or quarantined)."""
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            return False
        while time.monotonic() < deadline:
            if self.spool.pending_count() == 0:
                return True
            if self.shipper is not None:
                self.shipper.wake.set()
            time.sleep(0.05)
        return self.spool.pending_count() == 0

    def stats(self) -> dict[str, Any]:
        with self._cond:
            counts = dict(self._counts)
            reasons = dict(self._unrecordable_reasons)
        return {"channel": self._channel, "tier": self._tier,
                "fingerprint_id": self.config.fingerprint_id, **counts,
                "queued": counts["recorded"] - self._written,
                "unrecordable_reasons": reasons, "spool": self.spool.stats(),
                "shipper": None if self.shipper is None else {
                    "holds_lock": self.shipper.holds_lock,
                    "last_error": self.shipper.last_error}}

    def close(self, timeout: float = 30.0) -> None:
        """Commit everything queued to the spool, then stop the threads. Undelivered
        envelopes stay in the spool for the next recorder on the same directory."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout)
        if self.shipper is not None:
            self.shipper.stop(timeout)
        self.spool.close_thread_connection()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writer thread
    def _statement(self, item: _Item) -> dict[str, Any]:
        c = item.captured
        if isinstance(c, VendorCaptured):
            assert isinstance(self.config, VendorConfig)
            return build_vendor_statement(
                request_id=c.request_id, recorded_at=item.recorded_at.isoformat(),
                name=self.config.name, base_url=self.config.base_url, endpoint=c.endpoint,
                request=c.request, response=c.response, response_body=c.response_body,
                headers=c.headers, assertions=self.config.assertions)
        assert isinstance(self.config, CaptureConfig)
        subject = c.data_subject
        if subject is None and self.data_subject is not None:
            subject = self.data_subject(c)
        return build_statement(
            request_id=c.request_id, artifacts=self.config.artifacts,
            prompt_token_ids=c.prompt_token_ids, sampling=c.sampling,
            runtime=self.config.runtime, output=c.output(), channel=self._channel,
            tier=self._tier, recorded_at=item.recorded_at, data_subject=subject)

    def _envelope(self, item: _Item) -> tuple[str, bytes] | None:
        c = item.captured
        statement = self._statement(item)
        try:
            if isinstance(c, VendorCaptured):
                validate_vendor_statement(statement)
            else:
                validate_statement(statement)
        except ValidationFailed as exc:
            self._counts["invalid"] += 1
            log.error("envelope %s is invalid, quarantined locally: %s", c.request_id, exc)
            self.spool.quarantine_new(c.request_id, canonical_json(statement), {
                "code": "invalid_envelope", "detail": str(exc),
                "errors": exc.errors})
            return None
        body = canonical_json(envelope_to_json(sign_statement(statement, self.key)))
        if self.when_full == "drop" and not self.spool.has_room(len(body)):
            self._counts["dropped_full"] += 1
            log.error("capture spool full: envelope %s dropped", c.request_id)
            return None
        return c.request_id, body

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            items: list[_Item] = []
            if first is None:
                stop = True
            else:
                items.append(first)
            while len(items) < 512:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    continue
                items.append(nxt)
            rows: list[tuple[str, bytes]] = []
            for item in items:
                try:
                    row = self._envelope(item)
                except Exception:
                    log.exception("could not build the envelope of %s",
                                  item.captured.request_id)
                    row = None
                if row is not None:
                    rows.append(row)
            try:
                self.spool.append(rows)
            except Exception:
                log.exception("could not write %d envelopes to the spool", len(rows))
            else:
                self._counts["spooled"] += len(rows)
            with self._cond:
                self._written += len(items)
                self._cond.notify_all()
            if rows and self.shipper is not None:
                self.shipper.wake.set()
        self.spool.close_thread_connection()
