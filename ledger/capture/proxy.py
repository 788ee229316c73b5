"""``ledger proxy``: an OpenAI-compatible reverse proxy that records what passes through.

Every request is forwarded to the upstream (vLLM, or ``ledger engine serve``) and every
answer comes back to the client byte for byte, streams included, with one exception:
on ``POST /v1/completions`` and ``/v1/chat/completions`` the proxy asks the upstream for
token IDs, logprobs and a seed when the client did not (see
:mod:`ledger.capture.exchange`), and sets the members it asked for back to ``null`` in the
answer, which is how the upstream writes them when nobody asks. The exchange goes through
the SDK's :class:`~ledger.capture.transport.AsyncRecordingTransport`, so the proxy and the
SDK record identical envelopes.

Answers of the proxy itself (never the upstream's):

- ``503`` with ``Retry-After`` when the spool is full and the policy is ``fail``;
- ``400`` for a request no envelope can describe, only with ``strict=True`` (otherwise
  it is forwarded and counted as unrecordable);
- ``502`` when the upstream cannot be reached;
- ``GET /ledger/capture/status``: the recorder's counters and spool state (JSON).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from ledger.capture.recorder import Recorder
from ledger.capture.spool import SpoolFull
from ledger.capture.transport import AsyncRecordingTransport, UnrecordableRequest

log = logging.getLogger("ledger.capture")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

STATUS_PATH = "/ledger/capture/status"
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length", "host"})


def _error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


class CaptureProxy:
    """The ASGI application. ``recorder=None`` forwards without recording."""

    def __init__(self, upstream: str, recorder: Recorder | None, *, strict: bool = False,
                 timeout: float | None = 600.0, max_connections: int = 1000) -> None:
        self.upstream = upstream.rstrip("/")
        self.recorder = recorder
        self.strict = strict
        self.timeout = timeout
        self.max_connections = max_connections
        self._client: httpx.AsyncClient | None = None

    def _make_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.max_connections,
                              max_keepalive_connections=self.max_connections)
        inner = httpx.AsyncHTTPTransport(limits=limits)
        transport: httpx.AsyncBaseTransport = inner
        if self.recorder is not None:
            transport = AsyncRecordingTransport(self.recorder, inner, strict=self.strict)
        return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(self.timeout),
                                 follow_redirects=False)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client  # noqa: B018 - create the pooled client up front
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    async def _read_body(receive: Receive) -> bytes:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(chunks)

    @staticmethod
    async def _reply(send: Send, status: int, body: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), *(headers or [])]})
        await send({"type": "http.response.body", "body": body})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path == STATUS_PATH and scope["method"] == "GET":
            stats = self.recorder.stats() if self.recorder else {"recording": False}
            await self._reply(send, 200, json.dumps(stats).encode())
            return
        body = await self._read_body(receive)
        raw_path = scope.get("raw_path") or path.encode()
        query = scope.get("query_string", b"")
        url = self.upstream + raw_path.decode("latin-1") + (
            "?" + query.decode("latin-1") if query else "")
        headers = [(k, v) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        request = self.client.build_request(scope["method"], url, headers=headers,
                                            content=body)
        try:
            response = await self.client.send(request, stream=True)
        except SpoolFull as exc:
            await self._reply(send, 503, _error_body(503, str(exc), "ServiceUnavailableError"),
                              [(b"retry-after", b"5")])
            return
        except UnrecordableRequest as exc:
            await self._reply(send, 400, _error_body(
                400, f"the recording proxy refuses requests it cannot record: {exc}",
                "BadRequestError"))
            return
        except httpx.HTTPError as exc:
            log.warning("upstream %s unreachable: %s", self.upstream, exc)
            await self._reply(send, 502, _error_body(
                502, f"upstream unavailable: {type(exc).__name__}", "BadGatewayError"))
            return
        try:
            out_headers = [(k.encode("latin-1"), v.encode("latin-1"))
                           for k, v in response.headers.multi_items()
                           if k.lower() not in ("transfer-encoding", "connection",
                                                "keep-alive")]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": out_headers})
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                async for chunk in response.aiter_raw():        # each event as it comes
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            else:                                               # one write, not three
                body = b"".join([chunk async for chunk in response.aiter_raw()])
                await send({"type": "http.response.body", "body": body})
        finally:
            await response.aclose()
