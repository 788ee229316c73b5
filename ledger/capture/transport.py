"""The capture SDK: httpx transports that record what the official ``openai`` client does.

Wrapping at the HTTP layer keeps the ``openai`` client's own request building, retries,
streaming and response parsing untouched: the transport rewrites the request body
(:func:`ledger.capture.exchange.prepare`), and hands the client the upstream's bytes with
the fields it asked for set back to ``null`` — so ``client.completions.create(...)``
returns what it would return without capture. Envelopes go to the recorder's queue as the
response (or the stream's last chunk) is read.

    recorder = Recorder.from_files(key=..., artifacts=..., fingerprint=...,
                                   spool_dir=..., ledger_url=..., api_key=...)
    client = wrap_openai(openai.OpenAI(base_url="http://vllm:8000/v1", api_key="-"),
                         recorder)
    client.chat.completions.create(model=..., messages=[...])   # recorded

Only successful (200) ``POST .../completions`` and ``.../chat/completions`` calls are
recorded; everything else passes through unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from ledger.capture.exchange import (
    Captured,
    Plan,
    SamplingDefaults,
    StreamEditor,
    edit_response,
    prepare,
)
from ledger.capture.recorder import Recorder
from ledger.capture.vendor import VendorConfig, capture_vendor, plan_vendor

#: The request header naming the data subject (a pseudonym, docs/privacy.md): recorded
#: in the envelope, never sent upstream.
DATA_SUBJECT_HEADER = "x-ledger-data-subject"
_DROP_REQUEST_HEADERS = ("content-length", "transfer-encoding", DATA_SUBJECT_HEADER)


class UnrecordableRequest(ValueError):
    """A request no envelope can describe, refused before it is sent (``strict=True``)."""


def capture_kind(method: str, path: str) -> str | None:
    """"completion" or "chat" for the OpenAI endpoints that are recorded, else None."""
    if method != "POST":
        return None
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completion"
    return None


class _Capture:
    """The transport-independent part: plan a request, then finish its response."""

    def __init__(self, recorder: Recorder, defaults: SamplingDefaults | None,
                 strict: bool) -> None:
        self.recorder = recorder
        self.defaults = defaults or recorder.config.sampling_defaults
        self.strict = strict
        self.vendor = recorder.config if isinstance(recorder.config, VendorConfig) else None

    # the vendor channel: the request and the answer pass unchanged (ledger.capture.vendor)
    def vendor_plan(self, request: httpx.Request, body: bytes
                    ) -> tuple[httpx.Request, tuple[str, dict[str, Any]] | None]:
        """The request to send (the same body; only ``accept-encoding: identity``, so the
        answer can be read) and the call to record, if any."""
        planned = plan_vendor(request.method, request.url.path, body)
        if planned is None:
            return request, None
        if isinstance(planned, str):
            if self.strict:
                raise UnrecordableRequest(planned)
            self.recorder.note_unrecordable(planned)
            return request, None
        self.recorder.admit()
        headers = [(k, v) for k, v in request.headers.multi_items()
                   if k.lower() not in _DROP_REQUEST_HEADERS and k.lower() != "accept-encoding"]
        headers.append(("accept-encoding", "identity"))
        return httpx.Request(request.method, request.url, headers=headers, content=body,
                             extensions=request.extensions), planned

    def vendor_finish(self, planned: tuple[str, dict[str, Any]], response: httpx.Response,
                      body: bytes) -> None:
        assert self.vendor is not None
        captured = capture_vendor(self.vendor, planned[0], planned[1], response, body)
        if isinstance(captured, str):
            self.recorder.note_not_captured(captured)
        else:
            self.recorder.record(captured)

    def plan(self, request: httpx.Request, body: bytes) -> tuple[httpx.Request, Plan] | None:
        kind = capture_kind(request.method, request.url.path)
        if kind is None:
            return None
        new_body, plan = prepare(kind, body, self.defaults)
        if not plan.recordable:
            reason = plan.unrecordable or "unrecordable"
            if self.strict:
                raise UnrecordableRequest(reason)
            self.recorder.note_unrecordable(reason)
            return None
        self.recorder.admit()
        plan.data_subject = request.headers.get(DATA_SUBJECT_HEADER) or None
        headers = [(k, v) for k, v in request.headers.multi_items()
                   if k.lower() not in _DROP_REQUEST_HEADERS and k.lower() != "accept-encoding"]
        headers.append(("accept-encoding", "identity"))
        rebuilt = httpx.Request(request.method, request.url, headers=headers, content=new_body,
                                extensions=request.extensions)
        return rebuilt, plan

    def record(self, captured: list[Captured]) -> None:
        for c in captured:
            self.recorder.record(c)

    def finish_body(self, plan: Plan, response: httpx.Response, body: bytes) -> bytes:
        if response.headers.get("content-encoding", "identity") != "identity":
            self.recorder.note_not_captured("the upstream compressed its answer")
            return body
        edited, captured = edit_response(plan, body)
        if not captured:
            self.recorder.note_not_captured("no token IDs in the upstream's answer")
        self.record(captured)
        return edited

    def finish_stream(self, editor: StreamEditor) -> None:
        captured = editor.captured() if editor.done else []
        if not captured:
            self.recorder.note_not_captured(editor.broken or "the stream did not complete")
        self.record(captured)


def _response_headers(response: httpx.Response, length: int | None) -> list[tuple[str, str]]:
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-length", "transfer-encoding")]
    if length is not None:
        headers.append(("content-length", str(length)))
    return headers


class _StreamEdits:
    """What the sync and async streams share: pieces through the editor, the capture
    finished at the end, or noted as not captured when the client closes early."""

    def __init__(self, response: httpx.Response, editor: StreamEditor,
                 capture: _Capture) -> None:
        self._response, self._editor, self._capture = response, editor, capture
        self._finished = False

    def _done(self) -> None:
        self._finished = True
        self._capture.finish_stream(self._editor)

    def _closing(self) -> None:
        if not self._finished:
            self._finished = True
            self._capture.recorder.note_not_captured("the client closed the stream early")


class _EditedStream(_StreamEdits, httpx.SyncByteStream):
    def __iter__(self) -> Iterator[bytes]:
        for piece in self._response.stream:  # type: ignore[union-attr]
            if out := self._editor.feed(piece):
                yield out
        if rest := self._editor.finish():
            yield rest
        self._done()

    def close(self) -> None:
        self._closing()
        self._response.close()


class _AsyncEditedStream(_StreamEdits, httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self._response.stream:  # type: ignore[union-attr]
            if out := self._editor.feed(piece):
                yield out
        if rest := self._editor.finish():
            yield rest
        self._done()

    async def aclose(self) -> None:
        self._closing()
        await self._response.aclose()


def _streams_edited(plan: Plan, response: httpx.Response) -> bool:
    """A streamed answer is edited as it streams (when it is not compressed)."""
    return plan.stream and response.headers.get("content-encoding", "identity") == "identity"


def _replaced(response: httpx.Response,
              content: bytes | httpx.SyncByteStream | httpx.AsyncByteStream) -> httpx.Response:
    """The upstream's response with its body replaced by the edited one."""
    if isinstance(content, bytes):
        return httpx.Response(response.status_code,
                              headers=_response_headers(response, len(content)),
                              stream=httpx.ByteStream(content), extensions=response.extensions)
    return httpx.Response(response.status_code, headers=_response_headers(response, None),
                          stream=content, extensions=response.extensions)


class RecordingTransport(httpx.BaseTransport):
    """Sync transport for ``openai.OpenAI``: records completions and chat completions."""

    def __init__(self, recorder: Recorder, inner: httpx.BaseTransport | None = None, *,
                 defaults: SamplingDefaults | None = None, strict: bool = False) -> None:
        self.inner = inner or httpx.HTTPTransport()
        self.capture = _Capture(recorder, defaults, strict)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.capture.vendor is not None:
            return self._vendor_request(request)
        planned = self.capture.plan(request, request.read())
        if planned is None:
            return self.inner.handle_request(request)
        upstream_request, plan = planned
        response = self.inner.handle_request(upstream_request)
        if response.status_code != 200:
            return response
        if _streams_edited(plan, response):
            return _replaced(response, _EditedStream(response, StreamEditor(plan), self.capture))
        body = response.read()
        response.close()
        return _replaced(response, self.capture.finish_body(plan, response, body))

    def _vendor_request(self, request: httpx.Request) -> httpx.Response:
        request, vendor_call = self.capture.vendor_plan(request, request.read())
        response = self.inner.handle_request(request)
        if vendor_call is None or response.status_code != 200:
            return response
        body = response.read()
        response.close()
        self.capture.vendor_finish(vendor_call, response, body)
        return _replaced(response, body)

    def close(self) -> None:
        self.inner.close()


class AsyncRecordingTransport(httpx.AsyncBaseTransport):
    """Async transport for ``openai.AsyncOpenAI`` (and the recording proxy)."""

    def __init__(self, recorder: Recorder, inner: httpx.AsyncBaseTransport | None = None, *,
                 defaults: SamplingDefaults | None = None, strict: bool = False) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.capture = _Capture(recorder, defaults, strict)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.capture.vendor is not None:
            return await self._vendor_request(request)
        planned = self.capture.plan(request, await request.aread())
        if planned is None:
            return await self.inner.handle_async_request(request)
        upstream_request, plan = planned
        response = await self.inner.handle_async_request(upstream_request)
        if response.status_code != 200:
            return response
        if _streams_edited(plan, response):
            stream = _AsyncEditedStream(response, StreamEditor(plan), self.capture)
            return _replaced(response, stream)
        body = await response.aread()
        await response.aclose()
        return _replaced(response, self.capture.finish_body(plan, response, body))

    async def _vendor_request(self, request: httpx.Request) -> httpx.Response:
        request, vendor_call = self.capture.vendor_plan(request, await request.aread())
        response = await self.inner.handle_async_request(request)
        if vendor_call is None or response.status_code != 200:
            return response
        body = await response.aread()
        await response.aclose()
        self.capture.vendor_finish(vendor_call, response, body)
        return _replaced(response, body)

    async def aclose(self) -> None:
        await self.inner.aclose()


def wrap_openai(client: Any, recorder: Recorder, *, strict: bool = False,
                defaults: SamplingDefaults | None = None, **transport_kw: Any) -> Any:
    """A copy of an ``openai.OpenAI`` / ``openai.AsyncOpenAI`` client whose completions and
    chat completions are recorded by ``recorder``. ``strict=True`` raises
    :class:`UnrecordableRequest` instead of sending a request no envelope can describe.
    """
    is_async = type(client).__name__.startswith("Async")
    timeout = client.timeout
    if hasattr(timeout, "as_dict"):      # an httpx2.Timeout (newer openai releases)
        timeout = httpx.Timeout(**timeout.as_dict())
    http_client: httpx.Client | httpx.AsyncClient
    if is_async:
        http_client = httpx.AsyncClient(
            transport=AsyncRecordingTransport(recorder, defaults=defaults, strict=strict,
                                              **transport_kw),
            timeout=timeout)
    else:
        http_client = httpx.Client(
            transport=RecordingTransport(recorder, defaults=defaults, strict=strict,
                                         **transport_kw),
            timeout=timeout)
    return client.with_options(http_client=http_client)
