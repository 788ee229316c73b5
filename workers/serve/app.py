"""``ledger engine serve``: the reference engine behind an OpenAI-compatible HTTP API.

Routes (as vLLM's server): ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream``), ``GET /v1/models``, ``GET /health``, ``GET /version``; plus
``GET /ledger/fingerprint`` (``{"fingerprint_id", "runtime"}``, exactly what
``ledger fingerprint`` prints for this engine, ready for a capture proxy's config).

Requests go through :class:`EngineBatcher`: continuous batching, admission by arrival
(a request joins the running batch at the next engine step and leaves at the step it
finishes). A streamed response is produced after its request finished generating, then
sent one chunk per token in vLLM's shapes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine.api import Engine
from workers.serve import openai_api as oa
from workers.serve.batcher import EngineBatcher
from workers.serve.tokenizer import ByteTokenizer


def _closing(batcher: EngineBatcher) -> Any:
    """The app's lifespan: close the batcher on shutdown (``on_shutdown`` is gone from
    Starlette 1.x; a lifespan works on 0.x and 1.x)."""

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            batcher.close()

    return lifespan


SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return oa.dumps(content).encode("utf-8")


def _error(exc: oa.RequestError) -> Response:
    return _JSON(exc.body(), status_code=exc.status)


def create_app(engine: Engine, *, served_model_name: str, tokenizer: ByteTokenizer | None,
               max_batch: int = 8, batch_wait_s: float = 0.002,
               prefill_chunk: int | None = None) -> Starlette:
    """The ASGI app serving ``engine`` (which it owns from now on)."""
    from ledger.core.fingerprint import FINGERPRINT_PREFIX, fingerprint_id

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
        except ValueError as exc:
            raise oa.RequestError(str(exc)) from None
        except Exception as exc:             # the engine failed: vLLM answers 500 too
            raise oa.RequestError(f"engine failure: {type(exc).__name__}: {exc}", status=500,
                                  kind="InternalServerError") from exc
        return [oa.finish_text(result, sampling, parsed, tokenizer)
                for result, sampling in zip(results, parsed.sampling, strict=True)]

    def stream(events: Iterator[str]) -> StreamingResponse:
        async def encoded() -> AsyncIterator[bytes]:
            for event in events:
                yield event.encode("utf-8")
        return StreamingResponse(encoded(), media_type=SSE_MEDIA_TYPE)

    async def completions(request: Request) -> Response:
        try:
            parsed = oa.parse_completion(
                await body_of(request), served_model=served_model_name, tokenizer=tokenizer,
                vocab_size=vocab_size, max_model_len=max_model_len,
                request_id_header=request.headers.get("x-request-id"))
            choices = await generate(parsed)
        except oa.RequestError as exc:
            return _error(exc)
        created = oa.now()
        if parsed.stream:
            return stream(oa.completion_chunks(parsed, choices, tokenizer, created,
                                               system_fingerprint=system_fingerprint))
        return _JSON(oa.completion_response(parsed, choices, tokenizer, created,
                                            system_fingerprint=system_fingerprint))

    async def chat(request: Request) -> Response:
        try:
            parsed = oa.parse_chat(
                await body_of(request), served_model=served_model_name, tokenizer=tokenizer,
                vocab_size=vocab_size, max_model_len=max_model_len,
                request_id_header=request.headers.get("x-request-id"))
            (choice,) = await generate(parsed)
        except oa.RequestError as exc:
            return _error(exc)
        created = oa.now()
        if parsed.stream:
            return stream(oa.chat_chunks(parsed, choice, tokenizer, created,
                                         system_fingerprint=system_fingerprint))
        return _JSON(oa.chat_response(parsed, choice, tokenizer, created,
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
    ], lifespan=_closing(batcher))
    app.state.batcher = batcher
    app.state.fingerprint = fingerprint
    return app
