"""/v1/disputes, /v1/verdicts, /v1/workers, /v1/fingerprints,
/v1/reverification-policies, /v1/reverification-runs, /v1/semantic/pass-rates.

Each handler parses, makes one service call (:mod:`ledger.services.disputes`,
:mod:`ledger.services.policies`, :mod:`ledger.replay.queries`) and returns a typed response
model; service outcomes become HTTP statuses here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from sqlalchemy.orm import Session

from ledger.api.auth import require
from ledger.api.deps import get_session, get_settings_dep
from ledger.api.params import AfterQuery, BeforeQuery, Cursor, FingerprintQuery, Limit, RecordIdPath
from ledger.api.params import RequestIdQuery as RequestIdFilter
from ledger.api.params import UuidPath as IdPath
from ledger.api.routing import StrictJsonRoute
from ledger.api.schemas import (
    COMMON_RESPONSES,
    CommentIn,
    CommentOut,
    DisputeDetailOut,
    DisputeIn,
    DisputeOut,
    DisputePage,
    FingerprintPage,
    PolicyIn,
    PolicyOut,
    PolicyPage,
    PolicyPatch,
    ResolveIn,
    RunPage,
    RunReportOut,
    SemanticPassRatesOut,
    VerdictWithProofOut,
    WorkerOut,
)
from ledger.core.states import DisputeState, Priority
from ledger.replay import jobs as job_service
from ledger.replay import queries
from ledger.replay.records import Signer, require_signer
from ledger.services import disputes as dispute_service
from ledger.services import policies as policy_service
from ledger.services.apikeys import Principal
from ledger.settings import Settings

router = APIRouter(prefix="/v1", responses=COMMON_RESPONSES, route_class=StrictJsonRoute)

IdempotencyKey = Annotated[str | None, Header(max_length=200, pattern=r"^[\x21-\x7e]+$")]


def dispute_signer(request: Request) -> Signer:
    """Dispute events are signed by the service key: without it they are refused (503)."""
    return require_signer(request.app.state.service_signer, "a dispute action")


def policy_signer(request: Request) -> Signer:
    """Policy changes are signed registry leaves: refused (503) without the service key."""
    return require_signer(request.app.state.service_signer, "a re-verification policy change")


def commit_and_publish(request: Request, session: Session, jobs: list[tuple[str, str]]) -> None:
    """Commit, then publish these jobs (job ID, fingerprint ID) and only these, with the
    publisher's short broker timeout. One that does not get through stays unpublished in
    the outbox, and ``ledger beat``'s sweeper delivers it: the request never waits on the
    broker, nor on other requests' jobs."""
    session.commit()
    publisher = request.app.state.publisher
    if publisher is not None and jobs:
        job_service.publish(request.app.state.engine, publisher, jobs)


@router.post("/disputes", status_code=201, tags=["disputes"], response_model=DisputeOut,
             summary="Open a dispute on a recorded request: a matching worker replays it",
             responses={200: {"description": "An unresolved dispute on this record exists, "
                                             "or this Idempotency-Key was used: returned as is"}})
def open_dispute(
    body: DisputeIn, request: Request, response: Response,
    idempotency_key: IdempotencyKey = None,
    principal: Principal = Depends(require("disputes:write")),
    session: Session = Depends(get_session),
    settings: Settings = Depends(get_settings_dep),
    signer: Signer = Depends(dispute_signer),
) -> DisputeOut:
    opened = dispute_service.open_dispute(
        session, principal, signer, settings, request_id=body.request_id, reason=body.reason,
        priority=body.priority, idempotency_key=idempotency_key, assertions=body.assertions)
    commit_and_publish(request, session, opened.to_publish)
    if opened.outcome is dispute_service.OpenOutcome.EXISTING:
        response.status_code = 200
    else:
        session.refresh(opened.dispute)
    return DisputeOut.model_validate(queries.dispute_summary(session, opened.dispute))


@router.get("/disputes", tags=["disputes"], response_model=DisputePage,
            summary="Disputes, newest first, with filters")
def list_disputes(
    state: DisputeState | None = None,
    request_id: RequestIdFilter = None,
    priority: Priority | None = None,
    fingerprint_id: FingerprintQuery = None,
    limit: Limit = 100,
    cursor: Cursor = None,
    before: BeforeQuery = None,
    _: Principal = Depends(require("disputes:read")),
    session: Session = Depends(get_session),
) -> DisputePage:
    filters = queries.DisputeFilters(state, request_id, priority, fingerprint_id, before)
    found = queries.list_disputes(session, filters, limit=limit, cursor=cursor)
    full = len(found.items) == limit
    return DisputePage.model_validate({
        "items": found.items, "next_cursor": found.next_cursor,
        "next_before": found.items[-1]["opened_at"] if full else None})


@router.get("/disputes/{dispute_id}", tags=["disputes"], response_model=DisputeDetailOut,
            summary="A dispute with every event, attempt, the verdict and inclusion proofs")
def get_dispute(dispute_id: IdPath, _: Principal = Depends(require("disputes:read")),
                session: Session = Depends(get_session)) -> DisputeDetailOut:
    dispute = queries.find_dispute(session, dispute_id)
    return DisputeDetailOut.model_validate(queries.dispute_detail(session, dispute))


@router.post("/disputes/{dispute_id}/comments", status_code=201, tags=["disputes"],
             response_model=CommentOut,
             summary="Comment on a dispute (a signed event in the log)")
def comment_dispute(dispute_id: IdPath, body: CommentIn,
                    principal: Principal = Depends(require("disputes:write")),
                    session: Session = Depends(get_session),
                    signer: Signer = Depends(dispute_signer)) -> CommentOut:
    event = dispute_service.comment(session, principal, signer, dispute_id, text=body.text)
    session.commit()
    return CommentOut(seq=event.seq, event_id=event.event_id, log_index=event.log_index)


@router.post("/disputes/{dispute_id}/resolve", tags=["disputes"], response_model=DisputeOut,
             summary="Resolve a dispute that has a verdict: upheld or rejected, with a note")
def resolve_dispute(dispute_id: IdPath, body: ResolveIn,
                    principal: Principal = Depends(require("disputes:write")),
                    session: Session = Depends(get_session),
                    signer: Signer = Depends(dispute_signer)) -> DisputeOut:
    dispute = dispute_service.resolve(session, principal, signer, dispute_id,
                                      resolution=body.resolution, note=body.note)
    session.commit()
    return DisputeOut.model_validate(queries.dispute_summary(session, dispute))


@router.get("/verdicts/{verdict_id}", tags=["disputes"], response_model=VerdictWithProofOut,
            summary="One signed verdict")
def get_verdict(verdict_id: RecordIdPath, _: Principal = Depends(require("disputes:read")),
                session: Session = Depends(get_session)) -> VerdictWithProofOut:
    return VerdictWithProofOut.model_validate(queries.get_verdict(session, verdict_id))


@router.get("/workers", tags=["workers"], response_model=list[WorkerOut],
            summary="Replay workers and whether they are live (a list of at most 1,000)")
def list_workers(_: Principal = Depends(require("workers:read")),
                 session: Session = Depends(get_session),
                 settings: Settings = Depends(get_settings_dep)) -> list[WorkerOut]:
    return [WorkerOut.model_validate(w) for w in queries.list_workers(session, settings)]


@router.get("/fingerprints", tags=["workers"], response_model=FingerprintPage,
            summary="Recorded fingerprints, their envelopes, and which have no live worker")
def list_fingerprints(_: Principal = Depends(require("workers:read")),
                      session: Session = Depends(get_session),
                      settings: Settings = Depends(get_settings_dep)) -> FingerprintPage:
    found = queries.list_fingerprints(session, settings)
    return FingerprintPage.model_validate({
        "items": found, "next_cursor": None,
        "without_live_worker": [f["fingerprint_id"] for f in found
                                if not f["has_live_worker"]]})


@router.post("/reverification-policies", status_code=201, tags=["re-verification"],
             response_model=PolicyOut,
             summary="Create a scheduled re-verification policy (admin)",
             responses={200: {"description": "The same policy exists (no change)"}})
def create_policy(body: PolicyIn, response: Response,
                  principal: Principal = Depends(require("policies:write")),
                  session: Session = Depends(get_session),
                  signer: Signer = Depends(policy_signer)) -> PolicyOut:
    policy, outcome = policy_service.create_policy(
        session, principal, signer, body.model_dump(exclude={"first_window_start"}),
        body.first_window_start)
    session.commit()
    if outcome is policy_service.CreateOutcome.EXISTING:
        response.status_code = 200
    return PolicyOut.model_validate(queries.policy_summary(policy))


@router.get("/reverification-policies", tags=["re-verification"], response_model=PolicyPage,
            summary="Re-verification policies, oldest first, with their run counts")
def list_policies(limit: Limit = 100, cursor: Cursor = None,
                  _: Principal = Depends(require("policies:read")),
                  session: Session = Depends(get_session)) -> PolicyPage:
    found = queries.list_policies(session, limit=limit, cursor=cursor)
    return PolicyPage.model_validate({"items": found.items, "next_cursor": found.next_cursor})


@router.patch("/reverification-policies/{policy_id}", tags=["re-verification"],
              response_model=PolicyOut,
              summary="Pause or resume a policy (admin; recorded as an admin action)")
def patch_policy(policy_id: IdPath, body: PolicyPatch,
                 principal: Principal = Depends(require("policies:write")),
                 session: Session = Depends(get_session),
                 signer: Signer = Depends(policy_signer)) -> PolicyOut:
    policy = policy_service.set_enabled(session, principal, signer, policy_id, body.enabled)
    session.commit()
    return PolicyOut.model_validate(queries.policy_summary(policy))


@router.delete("/reverification-policies/{policy_id}", status_code=204,
               tags=["re-verification"], response_class=Response,
               summary="Delete a policy; its runs and reports stay (admin; recorded)")
def delete_policy(policy_id: IdPath, principal: Principal = Depends(require("policies:write")),
                  session: Session = Depends(get_session),
                  signer: Signer = Depends(policy_signer)) -> Response:
    policy_service.delete(session, principal, signer, policy_id)
    session.commit()
    return Response(status_code=204)


@router.get("/reverification-runs", tags=["re-verification"], response_model=RunPage,
            summary="Runs (policy windows and fingerprint gates), newest first")
def list_runs(kind: Literal["policy", "gate"] | None = None, limit: Limit = 100,
              cursor: Cursor = None, _: Principal = Depends(require("policies:read")),
              session: Session = Depends(get_session)) -> RunPage:
    found = queries.list_runs(session, kind=kind, limit=limit, cursor=cursor)
    return RunPage.model_validate({"items": found.items, "next_cursor": found.next_cursor})


@router.get("/reverification-runs/{run_id}", tags=["re-verification"],
            response_model=RunReportOut,
            summary="A run's report: counts per outcome, drift per fingerprint and model, "
                    "the diverged requests")
def get_run(run_id: IdPath, _: Principal = Depends(require("policies:read")),
            session: Session = Depends(get_session)) -> RunReportOut:
    return RunReportOut.model_validate(queries.run_report(session, run_id))


@router.get("/semantic/pass-rates", tags=["re-verification"],
            response_model=SemanticPassRatesOut,
            summary="Semantic verdicts' pass rates over time per (vendor, model alias)")
def semantic_pass_rates(
        vendor: Annotated[str | None, Query(max_length=100, pattern=r"^[a-z0-9][a-z0-9._-]*$",
                                            description="the vendor's routing name")] = None,
        model_alias: Annotated[str | None, Query(max_length=200)] = None,
        bucket: Literal["day", "hour"] = "day",
        since: AfterQuery = None,
        _: Principal = Depends(require("disputes:read")),
        session: Session = Depends(get_session)) -> SemanticPassRatesOut:
    return SemanticPassRatesOut(items=queries.semantic_pass_rates(
        session, vendor=vendor, model_alias=model_alias, bucket=bucket, since=since))
