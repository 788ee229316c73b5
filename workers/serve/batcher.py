"""A request queue feeding the engine's ``generate`` in small batches, on one thread.

The engine runs static batches (prefill, then decode until every member finishes), so
there is no continuous batching here: requests that arrive while a batch runs wait for the
next one. Because the reference engine is batch invariant, which requests share a batch
never changes anyone's tokens or logprobs; batching only buys throughput.

A batch that fails validation (``ValueError``: a prompt too long for the context, a bad
sampling value) is retried one request at a time, so one bad request fails alone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from workers.engine.api import Engine, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


@dataclass
class _Item:
    request: GenerationRequest
    future: Future[GenerationResult]


class EngineBatcher:
    """Owns the engine; ``submit`` from any thread, results come back as futures."""

    def __init__(self, engine: Engine, *, max_batch: int = 8, batch_wait_s: float = 0.0) -> None:
        assert max_batch >= 1, "max_batch must be >= 1"
        self.engine = engine
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.batches = 0
        self.requests = 0
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        self._queue.put(_Item(request, future))
        return future

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread
    def _take_batch(self) -> list[_Item] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch:
            timeout = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=timeout) if timeout > 0 else \
                    self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:                   # stop after this batch
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            live = [item for item in batch if item.future.set_running_or_notify_cancel()]
            if live:
                self._generate(live)

    def _generate(self, items: Sequence[_Item]) -> None:
        try:
            results = self.engine.generate([i.request for i in items], max_batch=len(items))
        except ValueError as exc:
            if len(items) == 1:
                items[0].future.set_exception(exc)
                return
            for item in items:             # isolate the bad request(s)
                self._generate([item])
            return
        except BaseException as exc:       # engine failure: every waiter learns of it
            log.exception("engine failure")
            for item in items:
                item.future.set_exception(exc)
            return
        self.batches += 1
        self.requests += len(items)
        for item, result in zip(items, results, strict=True):
            item.future.set_result(result)
