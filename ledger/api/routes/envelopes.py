"""/v1/envelopes: ingest (one, batch), get, search, JSON Schema."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session

from ledger import metrics
from ledger.api.auth import require
from ledger.api.deps import get_session, get_settings_dep
from ledger.api.schemas import (
    COMMON_RESPONSES,
    BatchIn,
    BatchOut,
    DsseEnvelopeIn,
    EnvelopeOut,
    EnvelopePage,
    IngestResult,
)
from ledger.core import jsonstrict
from ledger.core.envelope import envelope_json_schema
from ledger.core.errors import FormatError, ValidationFailed
from ledger.errors import Conflict
from ledger.log import proofs
from ledger.log.integrator import integrate_once
from ledger.problems import MEDIA_TYPE, problem, problem_for
from ledger.replay import views
from ledger.services import envelopes as envelope_service
from ledger.services import ingest as ingest_service
from ledger.services.apikeys import Principal
from ledger.settings import Settings

router = APIRouter(prefix="/v1", tags=["envelopes"], responses=COMMON_RESPONSES)
log = logging.getLogger("ledger.api")

def _result_dict(r: ingest_service.ItemResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "position": r.position, "status": r.status, "outcome": r.outcome,
        "request_id": r.request_id, "log_index": r.log_index, "dsse_sha256": r.dsse_sha256,
        "fingerprint_id": r.fingerprint_id,
    }
    if r.existing_dsse_sha256:
        out["existing_dsse_sha256"] = r.existing_dsse_sha256
    if r.error is not None:
        out["problem"] = problem_for(r.error)
    elif r.status == 409:
        out["problem"] = problem(409, "request_id_conflict",
                                 f"request_id {r.request_id!r} is stored with different bytes",
                                 existing_dsse_sha256=r.existing_dsse_sha256,
                                 submitted_dsse_sha256=r.dsse_sha256)
    elif r.status == 424:
        out["problem"] = problem(424, "batch_aborted",
                                 "not stored: another item of this atomic batch failed")
    return out


def _count(results: list[ingest_service.ItemResult]) -> None:
    for r in results:
        if r.status in (200, 201):
            metrics.INGESTED.labels(r.outcome).inc()
        elif r.error is not None:
            metrics.REJECTED.labels(r.error.code).inc()
        elif r.status == 409:
            metrics.REJECTED.labels("request_id_conflict").inc()


def _ingest_sync(session: Session, items: list[Any], settings: Settings,
                 atomic: bool) -> ingest_service.IngestReport:
    """The service decides; this boundary commits what it stored or rolls back a
    rejected atomic batch (the service wrote nothing then)."""
    report = ingest_service.ingest_batch(session, items, settings, atomic=atomic)
    if report.outcome is ingest_service.BatchOutcome.REJECTED:
        session.rollback()
    else:
        session.commit()
    return report


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
    _: Principal = Depends(require("envelopes:write")),
    session: Session = Depends(get_session),
    settings: Settings = Depends(get_settings_dep),
) -> Response:
    body = await _read_capped(request, settings.max_envelope_bytes)
    metrics.BATCH_SIZE.observe(1)
    report = await run_in_threadpool(_ingest_sync, session, [body], settings, False)
    _count(report.results)
    r = report.results[0]
    if r.error is not None:
        raise r.error
    if r.status == 409:
        raise Conflict(
            f"request_id {r.request_id!r} is already stored with different bytes",
            code="request_id_conflict", request_id=r.request_id,
            existing_dsse_sha256=r.existing_dsse_sha256, submitted_dsse_sha256=r.dsse_sha256,
            log_index=r.log_index)
    body = _result_dict(r)
    if wait and r.log_index is not None:
        receipts = await _receipts(request, session, [r.log_index], timeout)
        body["receipt"] = receipts[0] if receipts else None
    return JSONResponse(body, status_code=r.status)


async def _receipts(request: Request, session: Session, indices: list[int],
                    timeout: float) -> list[dict[str, Any]] | None:
    """Inclusion proofs of ``indices`` against one checkpoint, once it covers them all;
    None if that did not happen within ``timeout`` seconds (the entries stay stored)."""
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
            first = await run_in_threadpool(proofs.inclusion, session, needed)
            size = first.tree_size
            out = [await run_in_threadpool(proofs.inclusion, session, i, size) for i in indices]
            session.commit()
            return [o.to_json() for o in out]
        except proofs.NotYetIntegrated:
            session.rollback()
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.02)


@router.post(
    "/envelopes/batch",
    response_model=BatchOut,
    summary="Ingest many envelopes; a result per item",
    description=(
        "Each item is verified and validated on its own. By default the valid items are "
        "stored together in one transaction and invalid ones are reported per item "
        "(`status` 4xx with a `problem`). Every item is held to the single-envelope limits "
        "(an item over `max_envelope_bytes` is `status` 413). Repeats of stored envelopes "
        "(same bytes) are `existing`; other bytes under a stored request_id are `conflict` "
        "(409). With `atomic=true` any failed item, a conflict included, rejects the whole "
        "batch and nothing is written: a `batch_rejected` problem (409, 413 or 422) names "
        "the failed positions and carries the per-item results."),
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
    _: Principal = Depends(require("envelopes:write")),
    session: Session = Depends(get_session),
    settings: Settings = Depends(get_settings_dep),
) -> Response:
    body = await request.body()
    doc = jsonstrict.loads(body, what="batch body", max_depth=6)
    if not isinstance(doc, dict) or set(doc) != {"envelopes"} or not isinstance(
            doc["envelopes"], list):
        raise FormatError('batch body must be {"envelopes": [<DSSE envelope>, ...]}',
                          code="malformed_batch")
    items = doc["envelopes"]
    if not items:
        raise FormatError("batch holds no envelopes", code="empty_batch")
    if len(items) > settings.max_batch_items:
        raise ValidationFailed(f"batch holds {len(items)} envelopes; the limit is "
                               f"{settings.max_batch_items}", code="too_many_items")
    metrics.BATCH_SIZE.observe(len(items))
    report = await run_in_threadpool(_ingest_sync, session, items, settings, atomic)
    results = report.results
    _count(results)
    dicts = [_result_dict(r) for r in results]
    if report.outcome is ingest_service.BatchOutcome.REJECTED:
        return _rejected_batch(report, dicts)
    stored = [(d, r.log_index) for d, r in zip(dicts, results, strict=True)
              if r.status in (200, 201) and r.log_index is not None]
    if wait and stored:
        receipts = await _receipts(request, session, [i for _, i in stored], timeout)
        for (d, _), receipt in zip(stored, receipts or [None] * len(stored), strict=True):
            d["receipt"] = receipt
    summary = {
        "created": sum(r.status == 201 for r in results),
        "existing": sum(r.status == 200 for r in results),
        "conflicts": sum(r.status == 409 for r in results),
        "rejected": sum(r.status >= 400 and r.status != 409 for r in results),
        "results": dicts,
    }
    return Response(orjson.dumps(summary), media_type="application/json")


def _rejected_batch(report: ingest_service.IngestReport,
                    dicts: list[dict[str, Any]]) -> Response:
    """An atomic batch that stored nothing: one problem naming every failed item. Its
    status is the failed items' own when they agree (409 for conflicts only, 413 for
    oversized items only), 422 otherwise."""
    failed = report.failed
    statuses = {f.status for f in failed}
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
    request_id: Annotated[str, Path(max_length=200, pattern=r"^[A-Za-z0-9._:@+=-]+$")],
    _: Principal = Depends(require("envelopes:read")),
    session: Session = Depends(get_session),
) -> Response:
    dsse_bytes, fields = envelope_service.get_envelope(session, request_id)
    index = orjson.dumps(fields)
    # Index columns that disagree with the signed payload are flagged, never served silently.
    try:
        integrity = views.integrity(fields, views.envelope_index(dsse_bytes),
                                    views.ENVELOPE_INDEX_FIELDS)
    except views.SignedRecordError as exc:
        integrity = views.unreadable(exc)
    # The DSSE member is spliced in byte for byte: what was stored is what is served.
    return Response(b'{"dsse":' + dsse_bytes + b',"index":' + index + b',"integrity":'
                    + orjson.dumps(integrity) + b"}", media_type="application/json")


@router.get("/envelopes", response_model=EnvelopePage, summary="Search envelopes")
def search_envelopes(
    model_sha256: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$")] = None,
    model_name: Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")] = None,
    fingerprint_id: Annotated[str | None, Query(pattern=r"^fp-[0-9a-f]{16}$")] = None,
    channel: Literal["deterministic", "performance"] | None = None,
    recorded_after: datetime | None = Query(None, description="inclusive, RFC 3339"),
    recorded_before: datetime | None = Query(None, description="exclusive, RFC 3339"),
    order: Literal["asc", "desc"] = "asc",
    limit: int = Query(100, ge=1, le=1000),
    cursor: Annotated[str | None, Query(max_length=200, pattern=r"^[A-Za-z0-9_-]*$")] = None,
    _: Principal = Depends(require("envelopes:read")),
    session: Session = Depends(get_session),
) -> Response:
    for name, value in (("recorded_after", recorded_after), ("recorded_before", recorded_before)):
        if value is not None and value.tzinfo is None:
            raise ValidationFailed(f"{name} needs a UTC offset (RFC 3339)", code="naive_time")
    filters = envelope_service.SearchFilters(model_sha256, model_name, fingerprint_id, channel,
                                             recorded_after, recorded_before, order)
    items, next_cursor = envelope_service.search(session, filters, limit=limit, cursor=cursor)
    return Response(orjson.dumps({"items": items, "next_cursor": next_cursor}),
                    media_type="application/json")


@router.get("/schemas/envelope", summary="JSON Schema of the envelope statement (v1)",
            tags=["schemas"])
def envelope_schema() -> dict[str, Any]:
    return envelope_json_schema()


__all__ = ["BatchIn", "DsseEnvelopeIn", "router"]
