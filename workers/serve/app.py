"""``ledger engine serve``: the reference engine behind an OpenAI-compatible HTTP API.

Routes (as vLLM's server): ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream``), ``GET /v1/models``, ``GET /health``, ``GET /version``; plus
``GET /ledger/fingerprint`` (``{"fingerprint_id", "runtime"}``, exactly what
``ledger fingerprint`` prints for this engine, ready for a capture proxy's config).

Requests go through :class:`EngineBatcher`: continuous batching, admission by arrival
(a request joins the running batch at the next engine step and leaves at the step it
finishes). A streamed response sends each token's chunk (vLLM's shapes) as soon as the
engine step that sampled it ends; it starts with the first token, so a request the engine
refuses still gets the whole answer's error body. A client that goes away mid-stream
aborts its request: it leaves the running batch at its next token, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ledger.core.collector import collecting_less
from workers.engine.api import Engine, GenerationResult, TokenListener
from workers.serve import openai_api as oa
from workers.serve.batcher import EngineBatcher
from workers.serve.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

#: The interpreter's thread switch interval while the server runs (Python's default is 5
#: ms). The event loop (HTTP, one chunk per token and stream) and the batcher's thread share
#: the GIL; when a step's device sync returns, the batcher thread may wait for the GIL
#: until the loop thread gives it up, at the latest after this interval.
#: On the H200 at 64 streams/s, 0.2 ms gave 3,997 and 4,156 new tokens/s against 3,833 and
#: 3,913 at 5 ms (alternated, one hold: benchmarks/RESULTS.md); a small, noisy gain.
SWITCH_INTERVAL_S = 0.0002


def _closing(batcher: EngineBatcher, switch_interval_s: float | None,
             collect_less: bool) -> Any:
    """The app's lifespan: the switch interval and (``collect_less``) the collector tuned
    while it serves (``ledger.core.collector``: the model, the framework and the CUDA
    graphs' objects frozen, so that an old-generation collection, which walked all of them,
    no longer pauses a step); close the batcher on shutdown (``on_shutdown`` is gone from
    Starlette 1.x; a lifespan works on 0.x and 1.x)."""

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        before = sys.getswitchinterval()
        if switch_interval_s is not None:
            sys.setswitchinterval(switch_interval_s)
        try:
            with collecting_less() if collect_less else contextlib.nullcontext():
                yield
        finally:
            sys.setswitchinterval(before)
            batcher.close()

    return lifespan


SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


def _failure(exc: BaseException) -> oa.RequestError:
    """What a client is told when the engine refuses (``ValueError``: 400) or fails (500,
    as vLLM answers)."""
    if isinstance(exc, ValueError):
        return oa.RequestError(str(exc))
    return oa.RequestError(f"engine failure: {type(exc).__name__}: {exc}", status=500,
                           kind="InternalServerError")


class _Outbox:
    """Events from the batcher's thread to queues on the event loop, one loop wake-up for
    all that a step told (not one per token: each wake-up is a write to the loop's pipe
    and a callback, 64 per step at 64 streams)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[tuple[Any, ...]], tuple[Any, ...]]] = []

    def put(self, queue: asyncio.Queue[tuple[Any, ...]], event: tuple[Any, ...]) -> None:
        with self._lock:
            self._items.append((queue, event))
            if len(self._items) > 1:             # a wake-up is on its way
                return
        with contextlib.suppress(RuntimeError):    # a closed loop: nobody is listening
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, event in items:
            queue.put_nowait(event)


class _Tokens:
    """The tokens of one request's choices as the engine makes them, handed from the
    batcher's thread to the event loop: ``("token", i, token_id, logprob, top, finish)``
    for each, then ``("done", i, future)`` once choice ``i`` finished (or failed)."""

    def __init__(self, outbox: _Outbox) -> None:
        self.outbox = outbox
        self.queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    def _put(self, event: tuple[Any, ...]) -> None:
        self.outbox.put(self.queue, event)

    def drain(self) -> list[tuple[Any, ...]]:
        """Every event already queued (none: an empty list; never waits)."""
        events = []
        while not self.queue.empty():
            events.append(self.queue.get_nowait())
        return events

    def listener(self, i: int) -> TokenListener:
        return lambda *token: self._put(("token", i, *token))

    def watch(self, i: int, future: Future[GenerationResult]) -> None:
        future.add_done_callback(lambda f: self._put(("done", i, f)))


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return oa.dumps(content).encode("utf-8")


def _error(exc: oa.RequestError) -> Response:
    return _JSON(exc.body(), status_code=exc.status)


def create_app(engine: Engine, *, served_model_name: str, tokenizer: ByteTokenizer | None,
               max_batch: int = 8, batch_wait_s: float = 0.002,
               prefill_chunk: int | None = None,
               switch_interval_s: float | None = SWITCH_INTERVAL_S,
               warm_up_len: int = 0, collect_less: bool = True) -> Starlette:
    """The ASGI app serving ``engine`` (which it owns from now on); while it serves, the
    interpreter's switch interval is ``switch_interval_s`` (None: left as it is). With
    ``warm_up_len``, an engine that can (``warm_up``: the reference engine) sizes its KV
    cache for ``max_batch`` requests of that many positions and captures its CUDA graphs
    before the app exists, so that no early request waits for a capture. ``collect_less``:
    the garbage collector tuned while it serves (see ``_closing``)."""
    from ledger.core.fingerprint import FINGERPRINT_PREFIX, fingerprint_id

    warm_up = getattr(engine, "warm_up", None)
    if warm_up_len and callable(warm_up):
        began = time.perf_counter()
        graphs = warm_up(max_batch=max_batch, max_len=warm_up_len)
        log.info("warm-up: KV cache for %d x %d positions, %d CUDA graphs, %.1f s",
                 max_batch, warm_up_len, graphs, time.perf_counter() - began)

    config = getattr(engine, "config", None)
    vocab_size = int(getattr(config, "vocab_size", tokenizer.vocab_size if tokenizer else 0))
    max_model_len = int(getattr(config, "max_position_embeddings", 4096))
    runtime = engine.runtime()
    fp_id = fingerprint_id(runtime)
    fingerprint = {"fingerprint_id": fp_id, "runtime": runtime}
    # vLLM 0.25 answers ``vllm-<version>-<hash8 of its config>`` by default
    # (entrypoints/serve/utils/fingerprint.py); ours names the engine and its runtime
    system_fingerprint = "ledger-{}-{}".format(
        runtime.get("engine_version"),
        fp_id.removeprefix(FINGERPRINT_PREFIX)[:8])
    batcher = EngineBatcher(engine, max_batch=max_batch, batch_wait_s=batch_wait_s,
                            prefill_chunk=prefill_chunk)
    outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}    # the serving loop's

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise oa.RequestError(f"the request body is not valid JSON: {exc}") from None

    async def generate(parsed: oa.Parsed) -> list[oa.ChoiceText]:
        futures = [asyncio.wrap_future(batcher.submit(r)) for r in parsed.engine_requests()]
        try:
            results = await asyncio.gather(*futures)
        except Exception as exc:
            raise _failure(exc) from exc
        return [oa.finish_text(result, sampling, parsed, tokenizer)
                for result, sampling in zip(results, parsed.sampling, strict=True)]

    async def stream(parsed: oa.Parsed) -> Response:
        """Chunks as the tokens come; the response begins with the first token (or is the
        error body, if the engine refused or failed before it)."""
        loop = asyncio.get_running_loop()
        if outboxes.get(loop) is None:
            outboxes.clear()
            outboxes[loop] = _Outbox(loop)
        tokens = _Tokens(outboxes[loop])
        futures = [batcher.submit(request, on_token=tokens.listener(i))
                   for i, request in enumerate(parsed.engine_requests())]
        for i, future in enumerate(futures):
            tokens.watch(i, future)

        def abort() -> None:                  # the client is gone, or the answer failed
            for future in futures:
                batcher.abort(future)
        try:
            first = await tokens.queue.get()
        except BaseException:
            abort()
            raise
        if first[0] == "done" and first[2].exception() is not None:
            abort()
            return _error(_failure(first[2].exception()))
        chunks = oa.StreamChunks(parsed, tokenizer, oa.now(),
                                 system_fingerprint=system_fingerprint)

        async def events() -> AsyncIterator[bytes]:
            out, pending, running = chunks.start(), [first, *tokens.drain()], \
                len(parsed.sampling)
            told_last: set[int] = set()          # choices the engine finished or was told to
            try:
                while True:
                    for event in pending:            # all that came since the last write
                        if event[0] == "token":
                            out += chunks.token(*event[1:])
                            i = event[1]
                            if event[5] is not None:
                                told_last.add(i)
                            elif chunks.builders[i].done and i not in told_last:
                                told_last.add(i)     # a stop string ended its text: as
                                batcher.abort(futures[i])    # vLLM, stop generating
                        elif (exc := event[2].exception()) is not None:
                            out, running = out + chunks.error(_failure(exc)), 0
                            break
                        else:
                            running -= 1
                            out += [] if running else chunks.end()
                    if out:
                        yield "".join(out).encode("utf-8")
                    if not running:
                        return
                    out, pending = [], [await tokens.queue.get(), *tokens.drain()]
            finally:
                abort()
        return StreamingResponse(events(), media_type=SSE_MEDIA_TYPE)

    async def completions(request: Request) -> Response:
        try:
            parsed = oa.parse_completion(
                await body_of(request), served_model=served_model_name, tokenizer=tokenizer,
                vocab_size=vocab_size, max_model_len=max_model_len,
                request_id_header=request.headers.get("x-request-id"))
            if parsed.stream:
                return await stream(parsed)
            choices = await generate(parsed)
        except oa.RequestError as exc:
            return _error(exc)
        return _JSON(oa.completion_response(parsed, choices, tokenizer, oa.now(),
                                            system_fingerprint=system_fingerprint))

    async def chat(request: Request) -> Response:
        try:
            parsed = oa.parse_chat(
                await body_of(request), served_model=served_model_name, tokenizer=tokenizer,
                vocab_size=vocab_size, max_model_len=max_model_len,
                request_id_header=request.headers.get("x-request-id"))
            if parsed.stream:
                return await stream(parsed)
            (choice,) = await generate(parsed)
        except oa.RequestError as exc:
            return _error(exc)
        return _JSON(oa.chat_response(parsed, choice, tokenizer, oa.now(),
                                      system_fingerprint=system_fingerprint))

    async def models(_: Request) -> Response:
        return _JSON({"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": oa.now(),
            "owned_by": "inference-ledger", "root": served_model_name, "parent": None,
            "max_model_len": max_model_len, "permission": []}]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def version(_: Request) -> Response:
        return JSONResponse({"version": runtime.get("engine_version"),
                             "engine": runtime.get("engine")})

    async def fingerprint_route(_: Request) -> Response:
        return _JSON(fingerprint)

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/ledger/fingerprint", fingerprint_route, methods=["GET"]),
    ], lifespan=_closing(batcher, switch_interval_s, collect_less))
    app.state.batcher = batcher
    app.state.fingerprint = fingerprint
    return app
