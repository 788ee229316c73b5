"""/healthz (process up), /readyz (every `ledger check serve` check: database reachable,
migrations at head, login, pepper, log key, log name).

Prometheus metrics are not served here: ``ledger.api.app.MetricsListener`` serves them on
their own port (``LEDGER_METRICS_PORT``, loopback by default)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ledger.db.session import current_revision
from ledger.problems import MEDIA_TYPE, problem
from ledger.services.checks import readiness

router = APIRouter(tags=["service"])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Every `ledger check serve` check passes",
            responses={503: {"description": "Not ready: every failing check, by setting"}})
async def readyz(request: Request) -> Any:
    engine = request.app.state.engine
    settings = request.app.state.settings
    report = await run_in_threadpool(readiness, settings, engine)
    if report.failing:
        detail = "; ".join(p.line() for p in report.failing)
        body = problem(503, report.code or "misconfigured", detail,
                       checks=report.as_json(report.failing))
        return JSONResponse(body, status_code=503, media_type=MEDIA_TYPE,
                            headers={"Retry-After": "2" if report.code ==
                                     "database_unreachable" else "5"})
    revision = await run_in_threadpool(current_revision, engine)
    return {"status": "ready", "revision": revision,
            "warnings": report.as_json(report.warnings)}
