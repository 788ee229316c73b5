"""The engine and its batcher in a process of their own, behind :class:`EngineBatcher`'s
interface (``submit``, ``abort``, ``close``), for ``ledger engine serve``.

Why a process: the HTTP server's event loop writes one chunk per token and stream; in one
process it shares the GIL with the batcher's thread, which waits for it after every
step's device sync while the GPU idles (on the H200, 19% of the tokens per second at 64
streams; benchmarks/RESULTS.md). vLLM separates its API server from its engine core the
same way. Here the child loads the engine itself (``loader``, a picklable callable: the
``spawn`` start method, which CUDA needs) and runs an :class:`EngineBatcher`; requests
go to it over a pipe, and what comes back is batched: every token and result told since
the last send, in one message, so a step of 64 streams costs the parent one wake-up.
Tokens, logprobs, digests and finish reasons are the child's results, unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing as mp
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from workers.engine.api import Engine, GenerationRequest, GenerationResult, TokenListener

__all__ = ["EngineError", "EngineProcess", "load_reference"]


class EngineError(RuntimeError):
    """The engine failed (or its process went away); the message names what it raised."""


def load_reference(model: str, device: str, dtype: str, batch_invariant: bool,
                   threads: int | None, prefix_cache_blocks: int) -> Engine:
    """``ledger engine serve``'s engine: the reference engine (and its prefix cache)."""
    from workers.engine import load_engine

    engine = load_engine(model, device=device, dtype=dtype, batch_invariant=batch_invariant,
                         threads=threads)
    if prefix_cache_blocks:
        from workers.engine.prefix_cache import PrefixCache

        engine.prefix_cache = PrefixCache(pages=prefix_cache_blocks)
    return engine


class _Sender:
    """Messages from the child's threads to the parent, sent by one thread in batches."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._ready = threading.Condition()
        self._items: list[tuple[Any, ...]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-sender", daemon=True)
        self._thread.start()

    def put(self, item: tuple[Any, ...]) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._items and not self._closed:
                    self._ready.wait()
                items, self._items = self._items, []
                closed = self._closed
            if items:
                try:
                    self.conn.send(items)
                except (BrokenPipeError, OSError):
                    return                           # the parent is gone
            if closed:
                return

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(30)


def _outcome(future: Future[GenerationResult]) -> tuple[str, Any]:
    if future.cancelled():
        return "cancelled", None
    exc = future.exception()
    if exc is None:
        return "ok", future.result()
    kind = "refused" if isinstance(exc, ValueError) else "failed"
    return kind, str(exc) if kind == "refused" else f"{type(exc).__name__}: {exc}"


def _listener(sender: _Sender, key: int) -> TokenListener:
    def told(token: int, logprob: float, top: list[tuple[int, float]] | None,
             finish: str | None) -> None:
        sender.put(("token", key, token, logprob, top, finish))
    return told


def _child(conn: Connection, loader: Callable[[], Engine], options: dict[str, Any]) -> None:
    from workers.serve.batcher import EngineBatcher

    try:
        engine = loader()
    except BaseException as exc:  # noqa: BLE001 - told to the parent, which reports it
        conn.send([("failed", f"{type(exc).__name__}: {exc}")])
        return
    config = getattr(engine, "config", None)
    conn.send([("ready", engine.runtime(), {
        "vocab_size": getattr(config, "vocab_size", None),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None)})])
    batcher = EngineBatcher(engine, **options)
    sender = _Sender(conn)
    futures: dict[int, Future[GenerationResult]] = {}

    def done(key: int, future: Future[GenerationResult]) -> None:
        futures.pop(key, None)
        sender.put(("done", key, *_outcome(future)))

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break                                 # the parent is gone
            if message[0] == "submit":
                _, key, request, stream = message
                future = futures[key] = batcher.submit(
                    request, on_token=_listener(sender, key) if stream else None)
                future.add_done_callback(functools.partial(done, key))
            elif message[0] == "abort":
                if (running := futures.get(message[1])) is not None:
                    batcher.abort(running)
            else:                                     # "close"
                break
    finally:
        batcher.close()
        sender.close()


@dataclass
class _Waiter:
    future: Future[GenerationResult]
    on_token: TokenListener | None


class EngineProcess:
    """:class:`EngineBatcher`'s interface over an engine in a child process (see the
    module doc). ``runtime()`` and ``config`` (``vocab_size``, ``max_position_embeddings``)
    are the child engine's. Loading fails with :class:`EngineError`."""

    continuous = True

    def __init__(self, loader: Callable[[], Engine], *, max_batch: int = 8,
                 batch_wait_s: float = 0.0, prefill_chunk: int | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_child, name="ledger-engine", daemon=True,
            args=(child, loader, {"max_batch": max_batch, "batch_wait_s": batch_wait_s,
                                  "prefill_chunk": prefill_chunk}))
        self._process.start()
        child.close()
        try:
            (hello,) = self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise EngineError(f"the engine process exited ({self._process.exitcode}) "
                              "before it was ready") from None
        if hello[0] == "failed":
            self._process.join(10)
            raise EngineError(hello[1])
        self._runtime, config = hello[1], hello[2]
        self.config = SimpleNamespace(**config)
        self.requests = 0             # finished (an aborted request too)
        self.aborts = 0               # stopped by abort() before their end
        self._keys = itertools.count()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiter] = {}
        self._dead = False
        self._by_future: dict[int, int] = {}        # id(future) -> key
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def runtime(self) -> dict[str, Any]:
        return dict(self._runtime)

    def submit(self, request: GenerationRequest, on_token: TokenListener | None = None
               ) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        key = next(self._keys)
        with self._lock:
            if self._dead:
                future.set_exception(EngineError("the engine process exited"))
                return future
            self._waiting[key] = _Waiter(future, on_token)
            self._by_future[id(future)] = key
        self._send(("submit", key, request, on_token is not None))
        return future

    def abort(self, future: Future[GenerationResult]) -> None:
        with self._lock:
            key = self._by_future.get(id(future))
        if key is not None and not future.done():
            self._send(("abort", key))

    def close(self, timeout: float = 30.0) -> None:
        self._send(("close",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        self._reader.join(10)

    def _send(self, message: tuple[Any, ...]) -> None:
        # a child that is gone cannot take it: the reader fails the waiters
        with self._send_lock, contextlib.suppress(BrokenPipeError, OSError):
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            for item in batch:
                self._deliver(item)
        with self._lock:                    # the child exited: nobody will answer these
            self._dead = True
            waiting, self._waiting = self._waiting, {}
            self._by_future.clear()
        for waiter in waiting.values():
            if not waiter.future.done():
                waiter.future.set_exception(EngineError("the engine process exited"))

    def _deliver(self, item: tuple[Any, ...]) -> None:
        if item[0] == "token":
            waiter = self._waiting.get(item[1])
            if waiter is not None and waiter.on_token is not None:
                waiter.on_token(*item[2:])
            return
        _, key, kind, value = item
        with self._lock:
            waiter = self._waiting.pop(key, None)
            if waiter is not None:
                self._by_future.pop(id(waiter.future), None)
        if waiter is None:
            return
        self.requests += 1
        if kind == "ok":
            self.aborts += value.finish_reason == "abort"
            waiter.future.set_result(value)
        elif kind == "cancelled":
            self.aborts += 1
            waiter.future.cancel()
        else:
            waiter.future.set_exception(ValueError(value) if kind == "refused"
                                        else EngineError(value))
