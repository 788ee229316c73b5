"""/healthz (process up), /readyz (database reachable, migrations at head), /metrics."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import multiprocess as prom_multiprocess

from ledger.db.session import current_revision, head_revision
from ledger.problems import MEDIA_TYPE, problem

router = APIRouter(tags=["service"])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Database reachable and migrations at head",
            responses={503: {"description": "Not ready"}})
async def readyz(request: Request) -> Any:
    engine = request.app.state.engine

    def check() -> tuple[str | None, str | None]:
        return current_revision(engine), head_revision(str(engine.url))

    try:
        current, head = await run_in_threadpool(check)
    except Exception as exc:  # noqa: BLE001 - any failure here means "not ready"
        body = problem(503, "database_unreachable", f"database check failed: {type(exc).__name__}")
        return JSONResponse(body, status_code=503, media_type=MEDIA_TYPE,
                            headers={"Retry-After": "2"})
    if current != head:
        body = problem(503, "migrations_pending",
                       f"database at revision {current}, code expects {head}: run "
                       "`ledger db upgrade`")
        return JSONResponse(body, status_code=503, media_type=MEDIA_TYPE,
                            headers={"Retry-After": "5"})
    return {"status": "ready", "revision": current}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics_endpoint() -> Response:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # set by `ledger serve --workers N`
        registry = CollectorRegistry()
        prom_multiprocess.MultiProcessCollector(registry)
        data = generate_latest(registry)
    else:
        data = generate_latest()
    return Response(data, media_type=CONTENT_TYPE_LATEST)
