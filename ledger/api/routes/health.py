"""/healthz (process up), /readyz (database reachable, migrations at head).

Prometheus metrics are not served here: ``ledger.api.app.MetricsListener`` serves them on
their own port (``LEDGER_METRICS_PORT``, loopback by default)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

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
