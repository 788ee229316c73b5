"""The request queue in front of the engine, on one thread: continuous batching.

For an engine with a continuous batcher (the reference engine's ``batcher()``), requests
are admitted **by arrival**: between two engine steps the thread takes everything that
arrived and adds it to the running batch, which admits it as soon as a slot is free
(``max_batch`` running at most); a request leaves the batch at the step it finishes, and
its future is resolved then. A request submitted with ``on_token`` (a stream) hears each
of its tokens at the step that sampled it, before that. Prompts are prefilled in chunks
of ``prefill_chunk`` tokens (None: whole) next to the running decodes, and the engine's
prefix cache (if any) serves shared prompt prefixes. Because the reference engine is
batch invariant in all of these respects, neither arrival times nor co-tenants change
anyone's tokens, logprobs or digests; batching only buys throughput.

An engine without one (the vLLM adapter) gets static batches through ``generate``:
requests that arrive while a batch runs wait for the next one (``batch_wait_s`` gathers
co-tenants), and a stream hears its tokens when its batch is done. A request that fails
validation (``ValueError``: a prompt too long for the context, a bad sampling value)
fails alone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from workers.engine.api import Engine, GenerationRequest, GenerationResult, TokenListener

log = logging.getLogger(__name__)


@dataclass
class _Abort:
    future: Future[GenerationResult]


@dataclass
class _Item:
    request: GenerationRequest
    future: Future[GenerationResult]
    on_token: TokenListener | None = None


class EngineBatcher:
    """Owns the engine; ``submit`` from any thread, results come back as futures."""

    def __init__(self, engine: Engine, *, max_batch: int = 8, batch_wait_s: float = 0.0,
                 prefill_chunk: int | None = None) -> None:
        assert max_batch >= 1, "max_batch must be >= 1"
        self.engine = engine
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.prefill_chunk = prefill_chunk
        self.continuous = callable(getattr(engine, "batcher", None))
        self.batches = 0              # static batches, or engine steps when continuous
        self.requests = 0
        self.max_running = 0          # most requests that ran in one step (continuous)
        self.aborts = 0               # requests stopped by abort() before their end
        self._count = threading.Lock()  # (aborts is counted on two threads)
        self._queue: queue.Queue[_Item | _Abort | None] = queue.Queue()
        target = self._run_continuous if self.continuous else self._run
        self._thread = threading.Thread(target=target, name="engine-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, on_token: TokenListener | None = None
               ) -> Future[GenerationResult]:
        """Queue ``request``; its result comes back as the future's. ``on_token`` (called on
        the batcher's thread, before the future resolves) hears each token as it is made."""
        future: Future[GenerationResult] = Future()
        self._queue.put(_Item(request, future, on_token))
        return future

    def abort(self, future: Future[GenerationResult]) -> None:
        """Stop the request behind ``future`` (its client went away): one not started yet
        never runs (the future is cancelled); a running one leaves the continuous batch at
        its next token, its result's finish reason "abort". A static batch runs to its
        end. Nothing happens to a finished request."""
        if future.cancel():
            with self._count:
                self.aborts += 1
        elif not future.done() and self.continuous:
            self._queue.put(_Abort(future))

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread
    def _arrivals(self, block: bool) -> tuple[list[_Item | _Abort], bool]:
        """Everything queued now (waiting for the first one if ``block``); and whether
        close() was called."""
        items: list[_Item | _Abort] = []
        stop = False
        try:
            item = self._queue.get() if block else self._queue.get_nowait()
            while True:
                if item is None:
                    stop = True
                else:
                    items.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        return items, stop

    def _run_continuous(self) -> None:
        batcher: Any = self.engine.batcher(  # type: ignore[attr-defined]
            max_batch=self.max_batch, prefill_chunk=self.prefill_chunk)
        waiting: dict[int, Future[GenerationResult]] = {}
        stopping = False
        try:
            while True:
                items, stop = self._arrivals(block=batcher.idle and not stopping)
                stopping = stopping or stop
                for item in items:              # admission by arrival
                    if isinstance(item, _Abort):
                        for ticket in [t for t, f in waiting.items() if f is item.future]:
                            if batcher.abort(ticket):
                                with self._count:
                                    self.aborts += 1
                        continue
                    if not item.future.set_running_or_notify_cancel():
                        continue
                    try:
                        waiting[batcher.add(item.request, item.on_token)] = item.future
                    except ValueError as exc:
                        item.future.set_exception(exc)
                if stopping and batcher.idle:
                    return
                if batcher.waiting or batcher.running:
                    try:
                        batcher.step()
                    except BaseException as exc:  # engine failure: every waiter learns of it
                        log.exception("engine failure")
                        for future in waiting.values():
                            future.set_exception(exc)
                        waiting.clear()
                        batcher.close()
                        batcher = self.engine.batcher(  # type: ignore[attr-defined]
                            max_batch=self.max_batch, prefill_chunk=self.prefill_chunk)
                        continue
                    self.batches += 1
                    self.max_running = max(self.max_running, batcher.running)
                for finished in batcher.take_finished():
                    if finished.ticket in waiting:
                        self.requests += 1
                        waiting.pop(finished.ticket).set_result(finished.result)
        finally:
            batcher.close()

    def _take_batch(self) -> list[_Item] | None:
        first = self._queue.get()
        assert not isinstance(first, _Abort), "abort() queues none for static batches"
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
            assert not isinstance(item, _Abort), "abort() queues none for static batches"
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
            if item.on_token is not None:
                _replay(item.on_token, result)
            item.future.set_result(result)


def _replay(on_token: TokenListener, result: GenerationResult) -> None:
    """A finished result's tokens to a listener, as a continuous batcher would have told
    them (an engine that generates whole batches cannot tell them earlier)."""
    n = len(result.token_ids)
    for j, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        on_token(token, logprob,
                 result.top_logprobs[j] if result.top_logprobs is not None else None,
                 result.finish_reason if j == n - 1 else None)
