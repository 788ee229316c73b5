"""/v1/matrix-runs: request a replay matrix run on a worker, read its signed report."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request, Response
from sqlalchemy.orm import Session

from ledger.api.auth import require
from ledger.api.deps import get_session, get_settings_dep
from ledger.api.params import Cursor, Limit, UuidPath
from ledger.api.routes.replay import IdempotencyKey, commit_and_publish
from ledger.api.routing import StrictJsonRoute
from ledger.api.schemas import COMMON_RESPONSES, MatrixRunIn, MatrixRunOut, MatrixRunPage
from ledger.replay import matrix_runs
from ledger.services import audit
from ledger.services.apikeys import Principal
from ledger.services.disputes import actor_of
from ledger.settings import Settings

router = APIRouter(prefix="/v1", responses=COMMON_RESPONSES, route_class=StrictJsonRoute)


def _out(session: Session, settings: Settings, job_id: uuid.UUID | str) -> MatrixRunOut:
    state = matrix_runs.matrix_run_state(session, job_id, matrix_runs.checker_for(settings))
    links = {"self": f"/v1/matrix-runs/{state['id']}",
             "page": f"/console/matrix-runs/{state['id']}"}
    return MatrixRunOut.model_validate({**state, "links": links})


@router.post("/matrix-runs", status_code=202, tags=["matrix"], response_model=MatrixRunOut,
             summary="Request a replay matrix run: a worker replays a sample under each cell",
             responses={200: {"description": "This Idempotency-Key was used: the first run"},
                        409: {"description": "This Idempotency-Key was used for another "
                                             "request"}})
def create_matrix_run(
    body: MatrixRunIn, request: Request, response: Response,
    idempotency_key: IdempotencyKey = None,
    principal: Principal = Depends(require("matrix:write")),
    session: Session = Depends(get_session),
    settings: Settings = Depends(get_settings_dep),
) -> MatrixRunOut:
    requested = matrix_runs.request_matrix_run(
        session, settings, actor=actor_of(principal), model_sha256=body.model_sha256,
        fingerprint_id=body.fingerprint_id, records_fingerprint_id=body.records_fingerprint_id,
        sample=body.sample, seed=body.seed, cells=body.cells, idempotency_key=idempotency_key,
        fingerprints=body.fingerprints, signer=request.app.state.service_signer)
    job = requested.job
    if requested.created:
        audit.record(session, principal, "matrix_run.requested", str(job.id),
                     **{k: v for k, v in (job.params or {}).items()
                        if k not in ("requested_by", "request_sha256")})
    else:
        response.status_code = 200
    job_id = job.id
    commit_and_publish(request, session,
                       [(str(p.id), p.fingerprint_id) for p in requested.parts])
    return _out(session, settings, job_id)


@router.get("/matrix-runs", tags=["matrix"], response_model=MatrixRunPage,
            summary="Matrix runs, newest first, each checked against its signed request")
def list_matrix_runs(limit: Limit = 100, cursor: Cursor = None,
                     _: Principal = Depends(require("matrix:read")),
                     session: Session = Depends(get_session),
                     settings: Settings = Depends(get_settings_dep)) -> MatrixRunPage:
    found = matrix_runs.list_matrix_runs(session, matrix_runs.checker_for(settings),
                                         limit=limit, cursor=cursor)
    return MatrixRunPage.model_validate({
        "items": [{**r, "links": {"self": f"/v1/matrix-runs/{r['id']}",
                                  "page": f"/console/matrix-runs/{r['id']}"}}
                  for r in found.items],
        "next_cursor": found.next_cursor})


@router.get("/matrix-runs/{run_id}", tags=["matrix"], response_model=MatrixRunOut,
            summary="A matrix run's state and signed report (checked against its leaf)")
def get_matrix_run(run_id: UuidPath, _: Principal = Depends(require("matrix:read")),
                   session: Session = Depends(get_session),
                   settings: Settings = Depends(get_settings_dep)) -> MatrixRunOut:
    return _out(session, settings, run_id)
