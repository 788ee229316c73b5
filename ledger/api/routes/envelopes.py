"""/v1/envelopes: ingest (one, batch), get, search, JSON Schema."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from types import SimpleNamespace
from typing import Annotated, Any, Literal, TypeVar

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from sqlalchemy.orm import Session

from ledger import metrics
from ledger.api.auth import (
    PERMISSIONS,
    Credentials,
    authorize_reads_with_keys,
    bearer_key,
    presented,
    require,
)
from ledger.api.deps import get_session, get_settings_dep
from ledger.api.fast import error_response
from ledger.api.params import (
    AfterQuery,
    BeforeQuery,
    Cursor,
    FingerprintQuery,
    Limit,
    RequestIdPath,
    Sha256Query,
)
from ledger.api.schemas import (
    COMMON_RESPONSES,
    SAFE_TEXT,
    BatchIn,
    BatchOut,
    DsseEnvelopeIn,
    EnvelopeOut,
    EnvelopePage,
    IngestResult,
)
from ledger.core import dsse, jsonstrict
from ledger.core.envelope import envelope_json_schema
from ledger.core.errors import FormatError, LedgerError, ValidationFailed
from ledger.db.session import AutocommitReads
from ledger.errors import Conflict
from ledger.log import proofs
from ledger.log.integrator import integrate_once
from ledger.privacy.keys import kek_from_settings
from ledger.problems import MEDIA_TYPE, problem, problem_for, status_for
from ledger.services import envelopes as envelope_service
from ledger.services import ingest as ingest_service
from ledger.services.apikeys import Principal
from ledger.services.credentials import StaleCredentials, keys_for
from ledger.services.keys import KeyRing, ReadKeys, load_keyring_reads
from ledger.settings import Settings

T = TypeVar("T")
router = APIRouter(prefix="/v1", tags=["envelopes"], responses=COMMON_RESPONSES)
log = logging.getLogger("ledger.api")

Outcome = ingest_service.ItemOutcome
_STATUS = {Outcome.CREATED: 201, Outcome.EXISTING: 200, Outcome.CONFLICT: 409,
           Outcome.ABORTED: 424}


def http_status(r: ingest_service.ItemResult) -> int:
    """The HTTP status an item's outcome is served with (a rejection: its error's)."""
    if r.error is not None:
        return status_for(r.error)
    return _STATUS[r.outcome]


def _result_dict(r: ingest_service.ItemResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "position": r.position, "status": http_status(r), "outcome": r.outcome,
        "request_id": r.request_id, "log_index": r.log_index, "dsse_sha256": r.dsse_sha256,
        "fingerprint_id": r.fingerprint_id,
    }
    if r.existing_dsse_sha256:
        out["existing_dsse_sha256"] = r.existing_dsse_sha256
    if r.error is not None:
        out["problem"] = problem_for(r.error)
    elif r.outcome is Outcome.CONFLICT:
        out["problem"] = problem(409, "request_id_conflict",
                                 f"request_id {r.request_id!r} is stored with different bytes",
                                 existing_dsse_sha256=r.existing_dsse_sha256,
                                 submitted_dsse_sha256=r.dsse_sha256)
    elif r.outcome is Outcome.ABORTED:
        out["problem"] = problem(424, "batch_aborted",
                                 "not stored: another item of this atomic batch failed")
    return out


def _count(results: list[ingest_service.ItemResult]) -> None:
    for r in results:
        if r.stored:
            metrics.labelled(metrics.INGESTED, r.outcome).inc()
        elif r.error is not None:
            metrics.labelled(metrics.REJECTED, r.error.code).inc()
        elif r.outcome is Outcome.CONFLICT:
            metrics.labelled(metrics.REJECTED, "request_id_conflict").inc()


async def _ingested(app: Any, credentials: Credentials | None, body: bytes | LedgerError,
                    settings: Settings, *, atomic: bool, batch: bool
                    ) -> ingest_service.IngestReport:
    """:func:`_ingest_sync` in the ingest threads, then its items' storing awaited here
    (the group commit's leader completes it; a thread that led has done so already).

    A single envelope whose API key and producer keys this process remembers goes by
    :func:`_ingest_remembered` first, on the event loop (it reads nothing and waits for
    nothing: the verification is CPU under the GIL wherever it runs, and a thread hop
    costs 40-70 us on the 2-core VM); when that declines, or the storing statement finds
    the keys changed, the request is taken again from the start in the ingest threads
    (:mod:`ledger.services.credentials`). A body over :data:`ON_LOOP_BYTES` is verified in
    the ingest threads all the same (the loop is not held for a large one)."""
    if credentials is not None and not batch and isinstance(body, bytes):
        admitted = _ingest_remembered(app, credentials, body, settings) \
            if len(body) <= ON_LOOP_BYTES else \
            await in_ingest_thread(app, _ingest_remembered, app, credentials, body, settings)
        if admitted is not None:
            try:
                return await _report(admitted)
            except StaleCredentials:
                assert admitted.group.remembered is not None
                app.state.credentials.forget(admitted.group.remembered)
    return await _report(await in_ingest_thread(app, _ingest_sync, app, credentials, body,
                                                settings, atomic=atomic, batch=batch))


#: The largest single-envelope body verified on the event loop (an 18 KB envelope takes
#: ~0.3 ms there; the limit for one is ``max_envelope_bytes``, 4 MiB by default).
ON_LOOP_BYTES = 64 * 1024


async def _report(submitted: ingest_service.Submitted) -> ingest_service.IngestReport:
    if submitted.stored is not None and not submitted.stored.done():
        await asyncio.wrap_future(submitted.stored)
    return submitted.report()


def _ingest_remembered(app: Any, credentials: Credentials, body: bytes, settings: Settings
                       ) -> ingest_service.Submitted | None:
    """One envelope admitted with the keys remembered from earlier requests (checked
    again before it is stored), verified and handed to the group commit; None when they
    are not all remembered or anything fails (every refusal comes from fresh reads)."""
    pepper = settings.api_key_pepper.get_secret_value()
    cache = app.state.credentials
    admitted = cache.admit(credentials.api_key, pepper, PERMISSIONS[credentials.permission],
                           dsse.keyids_named(body))
    if admitted is None:
        return None
    remembered, keys = admitted
    submitted = ingest_service.submit_admitted(keys_for(keys), body, settings,
                                               remembered=remembered,
                                               group_commit=app.state.group_commit)
    if submitted is not None:
        metrics.BATCH_SIZE.observe(1)
    return submitted


def _ingest_sync(app: Any, credentials: Credentials | None, body: bytes | LedgerError,
                 settings: Settings, *, atomic: bool, batch: bool
                 ) -> ingest_service.Submitted:
    """All of an ingest request that is not I/O-bound, in one thread-pool hop: check the
    API key and its role (first: nothing of an unauthorised request is parsed; None: the
    route's dependency checked them before the body was read), read the body's
    envelopes, verify and validate them, then hand them to the process's group commit
    (stored and committed once the result's future is done: :func:`_ingested`).

    The key and the producer keys are read on an autocommit connection without a pre-ping
    (:class:`~ledger.db.session.AutocommitReads`), from the rows as they are now, so a
    revoked API key or signing key is refused from the next request on, as with a
    session (and remembered for the next requests: :func:`_ingest_remembered`). A single
    envelope's producer keys are read in the API key's own statement (one round trip for
    both): the key IDs to read are those the body's bytes name, found
    by a byte search (:func:`~ledger.core.dsse.keyids_named`) before the key check, which
    parses nothing and decides nothing: the answer still waits for the key and role, and
    the envelope is then parsed and verified as before, against exactly the keys its
    signatures name (one it did not find is read then, in a round trip of its own)."""
    with AutocommitReads(app.state.ingest_reads) as reads:
        read_ahead: ReadKeys | None = None
        if credentials is not None:
            named = dsse.keyids_named(body) if isinstance(body, bytes) and not batch else []
            principal, read_ahead = authorize_reads_with_keys(
                reads, settings, credentials.api_key, credentials.permission, named)
            reads.release()  # not held while the body is read and verified
            if named:  # for the next requests with this key (ledger.services.credentials)
                app.state.credentials.remember(
                    credentials.api_key, settings.api_key_pepper.get_secret_value(),
                    principal, read_ahead)
        if isinstance(body, LedgerError):
            raise body
        items = _batch_items(body, settings) if batch else [body]
        metrics.BATCH_SIZE.observe(len(items))
        return ingest_service.submit_batch(_producer_keys(reads, read_ahead), items,
                                           settings, atomic=atomic,
                                           group_commit=app.state.group_commit)


def _producer_keys(reads: AutocommitReads, read_ahead: ReadKeys | None
                   ) -> ingest_service.KeyLoader:
    """The producer keys of the key IDs asked for: from ``read_ahead`` (read in the API
    key's statement) where it has them all, else read now."""
    def producer_keys(keyids: Iterable[str]) -> KeyRing:
        ids = set(keyids)
        ring = read_ahead.keyring(ids, purpose="producer") if read_ahead else None
        if ring is not None:
            return ring
        try:
            return load_keyring_reads(reads, ids, purpose="producer")
        finally:
            reads.release()  # not held while the items are verified and stored
    return producer_keys


async def in_ingest_thread(app: Any, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the app's ingest threads (``app.state.ingest_threads``),
    awaited: an asyncio executor hop, which costs about half the CPU of Starlette's
    ``run_in_threadpool`` (anyio's capacity limiter, cancel scope and backend lookups:
    80-125 us a hop against 38-72 on the 2-core VM, 1 and 8 at once). Unlike anyio's, a
    cancelled caller does not wait for the thread: work a thread has started runs to its
    end (what it stores is committed) and only its answer is dropped; work still queued
    is cancelled and never runs (nothing of it is stored)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(app.state.ingest_threads,
                                      partial(fn, *args, **kwargs))


async def _read_capped(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to pass ``limit`` bytes: from its
    Content-Length before reading, or while reading a chunked upload that has none, so an
    oversized envelope is never buffered whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ValidationFailed(f"envelope is {int(declared)} bytes; the limit is {limit}",
                               code="too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ValidationFailed(f"envelope exceeds the limit of {limit} bytes",
                                   code="too_large")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post(
    "/envelopes",
    status_code=201,
    response_model=IngestResult,
    summary="Ingest one signed execution envelope",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/DsseEnvelopeIn"}}}}},
    responses={200: {"model": IngestResult, "description": "Already stored with these bytes"},
               409: {"description": "request_id stored with other bytes; both digests given",
                     "content": COMMON_RESPONSES[400]["content"]}},
)
async def ingest_one(
    request: Request,
    wait: bool = Query(False, description="Wait until the entry is integrated and return a "
                       "receipt (inclusion proof + signed checkpoint)"),
    timeout: float = Query(5.0, gt=0, le=60, description="Seconds to wait for the receipt"),
    credentials: Credentials = Depends(presented("envelopes:write")),
    settings: Settings = Depends(get_settings_dep),
) -> Response:
    return await _ingest_one(request, credentials, settings, wait=wait, timeout=timeout)


async def _ingest_one(request: Request, credentials: Credentials, settings: Settings, *,
                      wait: bool = False, timeout: float = 5.0) -> Response:
    """``POST /v1/envelopes``: the route's steps, shared with :class:`IngestFastPath`."""
    raw: bytes | LedgerError
    try:
        raw = await _read_capped(request, settings.max_envelope_bytes)
    except ValidationFailed as exc:  # refused after the key is checked: 401/403 come first
        raw = exc
    report = await _ingested(request.app, credentials, raw, settings, atomic=False,
                             batch=False)
    _count(report.results)
    r = _refuse_failure(report.results[0])
    body = _result_dict(r)
    if wait and r.log_index is not None:
        receipts = await _receipts(request, [r.log_index], timeout)
        body["receipt"] = receipts[0] if receipts else None
    # orjson: the bytes JSONResponse gives (compact, UTF-8), at a tenth of its cost
    return Response(orjson.dumps(body), status_code=http_status(r),
                    media_type="application/json")


class IngestFastPath:
    """Pure ASGI: ``POST /v1/envelopes`` without a query string goes straight to the
    route's own steps (:func:`_ingest_one`: the same key and role check, body cap,
    verification, group commit and response), past FastAPI's routing and dependency
    solving, which cost a quarter of the server's CPU per envelope on the 2-core VM
    (``benchmarks/ingest_cpu.py``). Its errors take the app's own handlers, found as
    Starlette finds them (by the exception's classes in order), so a request gets the
    same answer either way (``tests/api/test_ingest_fast_path.py``). Anything else,
    ``?wait=true`` included, goes to FastAPI, whose route stays the one the OpenAPI
    document shows."""

    PATH = "/v1/envelopes"

    def __init__(self, app: Any) -> None:
        self.app = app
        self._route = SimpleNamespace(path=self.PATH)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                scope["path"] != self.PATH or scope.get("query_string"):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        app = request.app
        scope["route"] = self._route               # the latency metric's label
        try:
            credentials = Credentials(await bearer_key(request), "envelopes:write")
            response = await _ingest_one(request, credentials, app.state.settings)
        except Exception as exc:  # noqa: BLE001 - answered as the app answers it
            response = await error_response(request, exc)
        await response(scope, receive, send)


def _refuse_failure(r: ingest_service.ItemResult) -> ingest_service.ItemResult:
    """The one item of a single-envelope POST, or its error raised (409 for a conflict)."""
    if r.error is not None:
        raise r.error
    if r.outcome is Outcome.CONFLICT:
        raise Conflict(
            f"request_id {r.request_id!r} is already stored with different bytes",
            code="request_id_conflict", request_id=r.request_id,
            existing_dsse_sha256=r.existing_dsse_sha256, submitted_dsse_sha256=r.dsse_sha256,
            log_index=r.log_index)
    return r


async def _receipts(request: Request, indices: list[int],
                    timeout: float) -> list[dict[str, Any]] | None:
    """Inclusion proofs of ``indices`` against one checkpoint, once it covers them all;
    None if that did not happen within ``timeout`` seconds (the entries stay stored)."""
    session: Session = request.app.state.sessionmaker()
    try:
        return await _receipts_in(request, session, indices, timeout)
    finally:
        await run_in_threadpool(_close, session)


def _close(session: Session) -> None:
    session.rollback()
    session.close()


async def _receipts_in(request: Request, session: Session, indices: list[int],
                       timeout: float) -> list[dict[str, Any]] | None:
    deadline = time.monotonic() + timeout
    integrator = getattr(request.app.state, "integrator", None)
    needed = max(indices)
    while True:
        if integrator is not None:
            try:
                await run_in_threadpool(integrate_once, request.app.state.engine,
                                        integrator.signer, max_entries=integrator.max_entries,
                                        sink=integrator.sink)
            except Exception as exc:  # noqa: BLE001 - the entries are stored; say so, no 500
                log.error("integration for a receipt failed: %s", exc)
        try:
            # with the API's log keys, as every proof route: a note they did not sign is
            # refused, never served as a receipt
            keys = request.app.state.log_keys
            first = await run_in_threadpool(partial(proofs.inclusion, log_keys=keys),
                                            session, needed)
            size = first.tree_size
            out = [first if i == needed else await run_in_threadpool(
                partial(proofs.inclusion, log_keys=keys), session, i, size) for i in indices]
            session.commit()
            return [o.to_json() for o in out]
        except proofs.NotYetIntegrated:
            session.rollback()
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.02)


BATCH_DESCRIPTION = (
    "Each item is verified and validated on its own. By default the valid items are "
    "stored together in one transaction and invalid ones are reported per item "
    "(`status` 4xx with a `problem`). Every item is held to the single-envelope limits "
    "(an item over `max_envelope_bytes` is `status` 413). Repeats of stored envelopes "
    "(same bytes) are `existing`; other bytes under a stored request_id are `conflict` "
    "(409). With `atomic=true` any failed item, a conflict included, rejects the whole "
    "batch and nothing is written: a `batch_rejected` problem (409, 413 or 422) names "
    "the failed positions and carries the per-item results.")


@router.post(
    "/envelopes/batch",
    response_model=BatchOut,
    summary="Ingest many envelopes; a result per item",
    description=BATCH_DESCRIPTION,
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/BatchIn"}}}}},
    responses={409: {"description": "Atomic batch rejected: request_id conflicts only",
                     "content": COMMON_RESPONSES[400]["content"]},
               413: {"description": "Too many items, or an atomic batch rejected for "
                                    "oversized items only",
                     "content": COMMON_RESPONSES[400]["content"]}},
)
async def ingest_batch(
    request: Request,
    atomic: bool = Query(False, description="All or nothing"),
    wait: bool = Query(False, description="Wait for integration; add a receipt per item"),
    timeout: float = Query(5.0, gt=0, le=60, description="Seconds to wait for receipts"),
    # the key before the body: a batch may be up to max_request_bytes, which a caller
    # without a valid key must not get buffered (the single POST's 4 MiB cap keeps its
    # check in the one hop)
    _: Principal = Depends(require("envelopes:write")),
    settings: Settings = Depends(get_settings_dep),
) -> Response:
    report = await _ingested(request.app, None, await request.body(), settings,
                             atomic=atomic, batch=True)
    _count(report.results)
    dicts = [_result_dict(r) for r in report.results]
    if report.outcome is ingest_service.BatchOutcome.REJECTED:
        return _rejected_batch(report, dicts)
    stored = [(d, r.log_index) for d, r in zip(dicts, report.results, strict=True)
              if r.stored and r.log_index is not None]
    if wait and stored:
        got = await _receipts(request, [i for _d, i in stored], timeout)
        receipts: list[dict[str, Any] | None] = list(got) if got else [None] * len(stored)
        for (d, _i), receipt in zip(stored, receipts, strict=True):
            d["receipt"] = receipt
    return Response(orjson.dumps(_batch_summary(report.results, dicts)),
                    media_type="application/json")


def _batch_items(body: bytes, settings: Settings) -> list[Any]:
    """The envelopes of a batch body, held to the batch limits."""
    doc = jsonstrict.loads(body, what="batch body", max_depth=6)
    if not isinstance(doc, dict) or set(doc) != {"envelopes"} or not isinstance(
            doc["envelopes"], list):
        raise FormatError('batch body must be {"envelopes": [<DSSE envelope>, ...]}',
                          code="malformed_batch")
    items: list[Any] = doc["envelopes"]
    if not items:
        raise FormatError("batch holds no envelopes", code="empty_batch")
    if len(items) > settings.max_batch_items:
        raise ValidationFailed(f"batch holds {len(items)} envelopes; the limit is "
                               f"{settings.max_batch_items}", code="too_many_items")
    return items


def _batch_summary(results: list[ingest_service.ItemResult],
                   dicts: list[dict[str, Any]]) -> dict[str, Any]:
    outcomes = [r.outcome for r in results]
    return {"created": outcomes.count(Outcome.CREATED),
            "existing": outcomes.count(Outcome.EXISTING),
            "conflicts": outcomes.count(Outcome.CONFLICT),
            "rejected": sum(r.error is not None or r.outcome is Outcome.ABORTED
                            for r in results),
            "results": dicts}


def _rejected_batch(report: ingest_service.IngestReport,
                    dicts: list[dict[str, Any]]) -> Response:
    """An atomic batch that stored nothing: one problem naming every failed item. Its
    status is the failed items' own when they agree (409 for conflicts only, 413 for
    oversized items only), 422 otherwise."""
    failed = report.failed
    statuses = {http_status(f) for f in failed}
    status = statuses.pop() if len(statuses) == 1 else 422
    named = ", ".join(f"#{f.position}" + (f" ({f.request_id})" if f.request_id else "") +
                      f": {f.error.code if f.error else f.outcome}" for f in failed[:20])
    body_out = problem(status, "batch_rejected",
                       f"{len(failed)} of {len(report.results)} envelopes failed ({named}); "
                       "nothing was stored (atomic batch)",
                       failed_positions=[f.position for f in failed], results=dicts)
    return Response(orjson.dumps(body_out), status_code=status, media_type=MEDIA_TYPE)


@router.get("/envelopes/{request_id}", response_model=EnvelopeOut,
            summary="One envelope: the stored DSSE bytes verbatim, plus index fields")
def get_envelope(
    request_id: RequestIdPath,
    _: Principal = Depends(require("envelopes:read")),
    session: Session = Depends(get_session),
    settings: Settings = Depends(get_settings_dep),
) -> Response:
    view = envelope_service.envelope_view(session, request_id, kek_from_settings(settings))
    # The DSSE member is spliced in byte for byte: what was stored is what is served.
    # Index columns that disagree with the signed payload are flagged in "integrity".
    return Response(b'{"dsse":' + view.dsse + b',"index":' + orjson.dumps(view.index)
                    + b',"integrity":' + orjson.dumps(view.integrity) + b"}",
                    media_type="application/json")


@router.get("/envelopes", response_model=EnvelopePage, summary="Search envelopes")
def search_envelopes(
    model_sha256: Sha256Query = None,
    model_name: Annotated[str | None, Query(max_length=200, pattern=SAFE_TEXT)] = None,
    fingerprint_id: FingerprintQuery = None,
    channel: Literal["deterministic", "performance"] | None = None,
    recorded_after: AfterQuery = None,
    recorded_before: BeforeQuery = None,
    order: Literal["asc", "desc"] = "asc",
    limit: Limit = 100,
    cursor: Cursor = None,
    _: Principal = Depends(require("envelopes:read")),
    session: Session = Depends(get_session),
) -> Response:
    filters = envelope_service.SearchFilters(model_sha256, model_name, fingerprint_id, channel,
                                             recorded_after, recorded_before, order)
    found = envelope_service.search(session, filters, limit=limit, cursor=cursor)
    return Response(orjson.dumps({"items": found.items, "next_cursor": found.next_cursor}),
                    media_type="application/json")


@router.get("/schemas/envelope", summary="JSON Schema of the envelope statement (v1)",
            tags=["schemas"])
def envelope_schema() -> dict[str, Any]:
    return envelope_json_schema()


__all__ = ["BatchIn", "DsseEnvelopeIn", "router"]
