"""/v1/disputes, /v1/verdicts, /v1/workers, /v1/fingerprints,
/v1/reverification-policies, /v1/reverification-runs."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ledger.api.auth import require
from ledger.api.deps import get_session, get_settings_dep
from ledger.api.routing import StrictJsonRoute
from ledger.api.schemas import COMMON_RESPONSES, SAFE_TEXT
from ledger.core.errors import ValidationFailed
from ledger.db.models import (
    Dispute,
    DisputeEvent,
    Envelope,
    Fingerprint,
    JobAttempt,
    ReplayJob,
    ReverificationPolicy,
    ReverificationRun,
    Verdict,
    Worker,
)
from ledger.errors import Conflict, NotFound
from ledger.log import proofs
from ledger.replay import disputes as dispute_service
from ledger.replay import jobs as job_service
from ledger.replay import reverification, views
from ledger.replay.records import require_signer
from ledger.services import audit
from ledger.services.apikeys import Principal
from ledger.settings import Settings

router = APIRouter(prefix="/v1", responses=COMMON_RESPONSES, route_class=StrictJsonRoute)

DisputeIdPath = Annotated[str, Path(max_length=64, pattern=r"^[0-9a-fA-F-]{1,64}$")]
RequestIdStr = Annotated[str, Field(min_length=1, max_length=200,
                                    pattern=r"^[A-Za-z0-9._:@+=-]+$")]


class DisputeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: RequestIdStr
    reason: str = Field(min_length=1, max_length=4000, pattern=SAFE_TEXT)
    priority: Literal["low", "normal", "high"] = "normal"


class CommentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=10_000, pattern=SAFE_TEXT)


class ResolveIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resolution: Literal["upheld", "rejected"]
    note: str = Field(min_length=1, max_length=10_000, pattern=SAFE_TEXT)


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200, pattern=SAFE_TEXT)
    interval_seconds: int = Field(ge=1, le=366 * 86400)
    sample_size: int | None = Field(default=None, ge=1, le=100_000)
    sample_rate: float | None = Field(default=None, gt=0.0, le=1.0)
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    fingerprint_id: str | None = Field(default=None, pattern=r"^fp-[0-9a-f]{16}$")
    channel: Literal["deterministic", "performance"] | None = None
    min_age_seconds: int = Field(default=0, ge=0, le=10 * 366 * 86400)
    max_age_seconds: int | None = Field(default=None, ge=1, le=10 * 366 * 86400)
    first_window_start: datetime | None = Field(
        default=None, description="default: now (only future windows are sampled)")
    enabled: bool = True
    drift_alert_threshold: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Alert (LEDGER_WEBHOOK_URL) when a run's "
        "drift rate for a (fingerprint, model) exceeds this.")

    @model_validator(mode="after")
    def _one_sampling_rule(self) -> PolicyIn:
        if (self.sample_size is None) == (self.sample_rate is None):
            raise ValueError("give exactly one of sample_size and sample_rate")
        if self.first_window_start is not None and self.first_window_start.tzinfo is None:
            raise ValueError("first_window_start needs a UTC offset")
        return self


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _publish(request: Request, jobs: list[tuple[str, str]]) -> None:
    """After commit: publish these jobs (job ID, fingerprint ID) and only these, with the
    publisher's short broker timeout. One that does not get through stays unpublished in
    the outbox, and ``ledger beat``'s sweeper delivers it: the request never waits on the
    broker, nor on other requests' jobs."""
    publisher = request.app.state.publisher
    if publisher is None or not jobs:
        return
    job_service.publish(request.app.state.engine, publisher, jobs)


def _proof_or_none(session: Session, index: int | None) -> dict[str, Any] | None:
    if index is None:
        return None
    try:
        return proofs.inclusion(session, index).to_json()
    except proofs.NotYetIntegrated:
        session.rollback()
        return None


def dispute_out(session: Session, d: Dispute, *, full: bool = False) -> dict[str, Any]:
    # state, resolution, note, resolver and verdict are folded from the signed events
    # (ledger.replay.views); the disputes row is a cache, flagged in "integrity" if it differs
    stored = session.scalars(select(DisputeEvent).where(DisputeEvent.dispute_id == d.id)
                             .order_by(DisputeEvent.seq)).all()
    signed_events = views.served_events(
        (bytes(e.dsse), {"event_id": e.event_id, "dispute_id": e.dispute_id, "seq": e.seq,
                         "kind": e.kind, "actor": e.actor, "body": e.body, "at": e.at})
        for e in stored)
    derived = views.served_dispute(signed_events, {
        "id": d.id, "request_id": d.request_id, "state": d.state,
        "state_reason": d.state_reason, "resolution": d.resolution,
        "resolution_note": d.resolution_note, "resolved_by": d.resolved_by,
        "resolved_at": d.resolved_at, "verdict_id": d.verdict_id})
    out: dict[str, Any] = {
        "id": str(d.id), "request_id": d.request_id, "envelope_log_index": d.envelope_index,
        "fingerprint_id": d.fingerprint_id, "reason": d.reason, "priority": d.priority,
        "state": derived["state"], "state_reason": derived["state_reason"],
        "opened_by": d.opened_by, "opened_at": d.opened_at, "updated_at": d.updated_at,
        "job_id": str(d.job_id) if d.job_id else None, "verdict_id": derived["verdict_id"],
        "resolution": derived["resolution"], "resolution_note": derived["resolution_note"],
        "resolved_by": derived["resolved_by"], "resolved_at": derived["resolved_at"],
        "integrity": derived["integrity"],
    }
    if not full:
        return out
    events = stored
    out["events"] = [{"seq": s["seq"], "event_id": s["event_id"], "kind": s["kind"],
                      "actor": s["actor"], "at": s["at"], "body": s["body"],
                      "log_index": e.log_index, "integrity": s["integrity"]}
                     for e, s in zip(stored, signed_events, strict=True)]
    attempts = session.scalars(select(JobAttempt).where(JobAttempt.job_id == d.job_id)
                               .order_by(JobAttempt.id)).all() if d.job_id else []
    out["attempts"] = [{"attempt": a.attempt, "worker_id": a.worker_id,
                        "fingerprint_id": a.fingerprint_id, "started_at": a.started_at,
                        "finished_at": a.finished_at, "outcome": a.outcome, "detail": a.detail}
                       for a in attempts]
    verdict_id = derived["verdict_id"]
    verdict = session.scalar(select(Verdict).where(Verdict.verdict_id == verdict_id)) \
        if verdict_id else None
    out["verdict"] = verdict_out(verdict) if verdict else None
    out["proofs"] = {
        "envelope": _proof_or_none(session, d.envelope_index),
        "verdict": _proof_or_none(session, verdict.log_index if verdict else None),
        "events": {str(e.seq): _proof_or_none(session, e.log_index) for e in events},
    }
    return out


def verdict_out(v: Verdict) -> dict[str, Any]:
    # outcome, tier, details and subject as the worker signed them (ledger.replay.views)
    signed = views.served_verdict(bytes(v.dsse), {
        "verdict_id": v.verdict_id, "request_id": v.request_id,
        "envelope_index": v.envelope_index, "outcome": v.outcome, "tier": v.tier,
        "worker_id": v.worker_id, "fingerprint_id": v.fingerprint_id, "details": v.details})
    return {"verdict_id": signed["verdict_id"], "log_index": v.log_index,
            "job_id": str(v.job_id), "request_id": signed["request_id"],
            "envelope_log_index": signed["envelope_index"], "outcome": signed["outcome"],
            "tier": signed["tier"], "worker_id": signed["worker_id"],
            "fingerprint_id": signed["fingerprint_id"], "details": signed["details"],
            "created_at": v.created_at, "dsse": json.loads(bytes(v.dsse)),
            "integrity": signed["integrity"]}


@router.post("/disputes", status_code=201, tags=["disputes"],
             summary="Open a dispute on a recorded request: a matching worker replays it",
             responses={200: {"description": "An unresolved dispute on this record exists, "
                                             "or this Idempotency-Key was used: returned as is"}})
def open_dispute(
    body: DisputeIn, request: Request,
    idempotency_key: Annotated[str | None,
                               Header(max_length=200, pattern=r"^[\x21-\x7e]+$")] = None,
    principal: Principal = Depends(require("disputes:write")),
    session: Session = Depends(get_session),
    settings: Settings = Depends(get_settings_dep),
) -> Any:
    signer = require_signer(request.app.state.service_signer, "opening a dispute")
    actor = f"{principal.name} ({principal.role})"
    dispute, created = dispute_service.open_dispute(
        session, request_id=body.request_id, reason=body.reason, priority=body.priority,
        actor=actor, signer=signer, idempotency_key=idempotency_key)
    job = None
    if created:
        job = job_service.create_job(
            session, fingerprint_id=dispute.fingerprint_id, kind="dispute",
            items=[(dispute.envelope_index, dispute.request_id, dispute.id)], settings=settings,
            priority=dispute_service.PRIORITY_RANK[body.priority])
        dispute.job_id = job.id
        dispute_service.emit(session, dispute, job.state, "ledger", signer,
                             {"job_id": str(job.id)}, state=job.state,
                             state_reason=job.state_reason)
        audit.record(session, principal, "dispute.open", str(dispute.id),
                     request_id=body.request_id)
    # a job waiting for a worker is routed by the sweeper once one is live
    to_publish = [(str(job.id), job.fingerprint_id)] if job is not None and \
        job.state == "queued" else []
    session.commit()
    if job is not None:
        _publish(request, to_publish)
        session.refresh(dispute)
    return JSONResponse(_json(dispute_out(session, dispute)), status_code=201 if created else 200)


def _json(d: dict[str, Any]) -> Any:
    from fastapi.encoders import jsonable_encoder

    return jsonable_encoder(d)


@router.get("/disputes", tags=["disputes"], summary="Disputes, newest first, with filters")
def list_disputes(
    state: Literal["opened", "queued", "awaiting_worker", "replaying", "verdict",
                   "resolved"] | None = None,
    request_id: Annotated[str | None, Query(max_length=200,
                                            pattern=r"^[A-Za-z0-9._:@+=-]+$")] = None,
    priority: Literal["low", "normal", "high"] | None = None,
    fingerprint_id: Annotated[str | None, Query(pattern=r"^fp-[0-9a-f]{16}$")] = None,
    limit: int = Query(100, ge=1, le=1000),
    before: datetime | None = Query(None, description="opened before this time (cursor)"),
    _: Principal = Depends(require("disputes:read")),
    session: Session = Depends(get_session),
) -> Any:
    stmt = select(Dispute).order_by(Dispute.opened_at.desc(), Dispute.id).limit(limit)
    for col, value in ((Dispute.state, state), (Dispute.request_id, request_id),
                       (Dispute.priority, priority), (Dispute.fingerprint_id, fingerprint_id)):
        if value is not None:
            stmt = stmt.where(col == value)
    if before is not None:
        if before.tzinfo is None:
            raise ValidationFailed("before needs a UTC offset", code="naive_time")
        stmt = stmt.where(Dispute.opened_at < before)
    rows = session.scalars(stmt).all()
    items = [dispute_out(session, d) for d in rows]
    return _json({"items": items,
                  "next_before": items[-1]["opened_at"] if len(items) == limit else None})


@router.get("/disputes/{dispute_id}", tags=["disputes"],
            summary="A dispute with every event, attempt, the verdict and inclusion proofs")
def get_dispute(dispute_id: DisputeIdPath,
                _: Principal = Depends(require("disputes:read")),
                session: Session = Depends(get_session)) -> Any:
    try:
        d = session.get(Dispute, uuid.UUID(dispute_id))
    except ValueError:
        d = None
    if d is None:
        raise NotFound(f"no dispute {dispute_id}")
    return _json(dispute_out(session, d, full=True))


@router.post("/disputes/{dispute_id}/comments", status_code=201, tags=["disputes"],
             summary="Comment on a dispute (a signed event in the log)")
def comment_dispute(dispute_id: DisputeIdPath, body: CommentIn, request: Request,
                    principal: Principal = Depends(require("disputes:write")),
                    session: Session = Depends(get_session)) -> Any:
    signer = require_signer(request.app.state.service_signer, "commenting")
    event = dispute_service.comment(session, dispute_id, text=body.text,
                                    actor=f"{principal.name} ({principal.role})", signer=signer)
    audit.record(session, principal, "dispute.comment", dispute_id)
    session.commit()
    return _json({"seq": event.seq, "event_id": event.event_id, "log_index": event.log_index})


@router.post("/disputes/{dispute_id}/resolve", tags=["disputes"],
             summary="Resolve a dispute that has a verdict: upheld or rejected, with a note")
def resolve_dispute(dispute_id: DisputeIdPath, body: ResolveIn, request: Request,
                    principal: Principal = Depends(require("disputes:write")),
                    session: Session = Depends(get_session)) -> Any:
    signer = require_signer(request.app.state.service_signer, "resolving")
    dispute, changed = dispute_service.resolve(
        session, dispute_id, resolution=body.resolution, note=body.note,
        actor=f"{principal.name} ({principal.role})", signer=signer)
    if changed:
        audit.record(session, principal, "dispute.resolve", dispute_id,
                     resolution=body.resolution)
    session.commit()
    return _json(dispute_out(session, dispute))


@router.get("/verdicts/{verdict_id}", tags=["disputes"], summary="One signed verdict")
def get_verdict(verdict_id: Annotated[str, Path(max_length=200,
                                                pattern=r"^[A-Za-z0-9._:@+=-]+$")],
                _: Principal = Depends(require("disputes:read")),
                session: Session = Depends(get_session)) -> Any:
    v = session.scalar(select(Verdict).where(Verdict.verdict_id == verdict_id))
    if v is None:
        raise NotFound(f"no verdict {verdict_id}")
    out = verdict_out(v)
    out["proof"] = _proof_or_none(session, v.log_index)
    return _json(out)


@router.get("/workers", tags=["workers"], summary="Replay workers and whether they are live")
def list_workers(_: Principal = Depends(require("workers:read")),
                 session: Session = Depends(get_session),
                 settings: Settings = Depends(get_settings_dep)) -> Any:
    cutoff = datetime.now(UTC) - timedelta(seconds=settings.worker_dead_after_s)
    rows = session.scalars(select(Worker).order_by(Worker.started_at.desc()).limit(1000)).all()
    return _json([{"worker_id": w.worker_id, "fingerprint_id": w.fingerprint_id,
                   "engine": w.engine, "version": w.version, "models": w.models,
                   "hostname": w.hostname, "started_at": w.started_at,
                   "last_heartbeat": w.last_heartbeat, "stopped_at": w.stopped_at,
                   "live": w.stopped_at is None and w.last_heartbeat >= cutoff,
                   "runtime": w.runtime} for w in rows])


@router.get("/fingerprints", tags=["workers"],
            summary="Recorded fingerprints, their envelopes, and which have no live worker")
def list_fingerprints(_: Principal = Depends(require("workers:read")),
                      session: Session = Depends(get_session),
                      settings: Settings = Depends(get_settings_dep)) -> Any:
    live = job_service.live_fingerprints(session, settings)
    counts = dict(session.execute(select(Envelope.fingerprint_id, func.count())
                                  .group_by(Envelope.fingerprint_id)).all())
    waiting = dict(session.execute(
        select(ReplayJob.fingerprint_id, func.count()).where(
            ReplayJob.state == "awaiting_worker").group_by(ReplayJob.fingerprint_id)).all())
    rows = session.scalars(select(Fingerprint).order_by(Fingerprint.first_seen_at)).all()
    out = [{"fingerprint_id": f.fingerprint_id, "runtime": f.runtime,
            "first_seen_at": f.first_seen_at, "envelopes": counts.get(f.fingerprint_id, 0),
            "live_workers": live.get(f.fingerprint_id, []),
            "has_live_worker": f.fingerprint_id in live,
            "jobs_awaiting_worker": waiting.get(f.fingerprint_id, 0)} for f in rows]
    return _json({"items": out,
                  "without_live_worker": [o["fingerprint_id"] for o in out
                                          if not o["has_live_worker"]]})


def policy_out(p: ReverificationPolicy) -> dict[str, Any]:
    return {"id": str(p.id), "name": p.name, "interval_seconds": p.interval_seconds,
            "sample_size": p.sample_size, "sample_rate": p.sample_rate,
            "model_sha256": p.model_sha256, "fingerprint_id": p.fingerprint_id,
            "channel": p.channel, "min_age_seconds": p.min_age_seconds,
            "max_age_seconds": p.max_age_seconds, "enabled": p.enabled,
            "drift_alert_threshold": p.drift_alert_threshold,
            "created_by": p.created_by, "created_at": p.created_at,
            "first_window_start": p.first_window_start}


@router.post("/reverification-policies", status_code=201, tags=["re-verification"],
             summary="Create a scheduled re-verification policy (admin)",
             responses={200: {"description": "The same policy exists (no change)"}})
def create_policy(body: PolicyIn, principal: Principal = Depends(require("policies:write")),
                  session: Session = Depends(get_session)) -> Any:
    existing = session.scalar(select(ReverificationPolicy).where(
        ReverificationPolicy.name == body.name))
    fields = body.model_dump(exclude={"first_window_start"})
    if existing is not None:
        if all(getattr(existing, k) == v for k, v in fields.items()):
            return JSONResponse(_json(policy_out(existing)), status_code=200)
        raise Conflict(f"a policy named {body.name!r} exists with other settings",
                       code="policy_exists")
    policy = ReverificationPolicy(id=uuid.uuid4(), created_by=principal.name,
                                  first_window_start=body.first_window_start
                                  or datetime.now(UTC), **fields)
    session.add(policy)
    try:
        session.flush()
    except IntegrityError as exc:
        raise Conflict(f"a policy named {body.name!r} exists", code="policy_exists") from exc
    audit.record(session, principal, "policy.create", str(policy.id), name=body.name)
    session.commit()
    return _json(policy_out(policy))


@router.get("/reverification-policies", tags=["re-verification"])
def list_policies(_: Principal = Depends(require("policies:read")),
                  session: Session = Depends(get_session)) -> Any:
    rows = session.scalars(select(ReverificationPolicy).order_by(
        ReverificationPolicy.created_at)).all()
    return _json([{**policy_out(p), "runs": reverification.count_runs(session, p.id)}
                  for p in rows])


class PolicyPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(description="false pauses the policy, true resumes it")


@router.patch("/reverification-policies/{policy_id}", tags=["re-verification"],
              summary="Pause or resume a policy (admin; recorded as an admin action)")
def patch_policy(policy_id: DisputeIdPath, body: PolicyPatch,
                 principal: Principal = Depends(require("policies:write")),
                 session: Session = Depends(get_session)) -> Any:
    policy = reverification.set_policy_enabled(session, policy_id, body.enabled)
    audit.record(session, principal, "policy.resume" if body.enabled else "policy.pause",
                 policy_id, name=policy.name)
    session.commit()
    return _json(policy_out(policy))


@router.delete("/reverification-policies/{policy_id}", status_code=204,
               tags=["re-verification"], response_class=Response,
               summary="Delete a policy; its runs and reports stay (admin; recorded)")
def delete_policy(policy_id: DisputeIdPath,
                  principal: Principal = Depends(require("policies:write")),
                  session: Session = Depends(get_session)) -> Response:
    name = reverification.delete_policy(session, policy_id)
    audit.record(session, principal, "policy.delete", policy_id, name=name)
    session.commit()
    return Response(status_code=204)


@router.get("/reverification-runs", tags=["re-verification"],
            summary="Runs (policy windows and fingerprint gates), newest first")
def list_runs(kind: Literal["policy", "gate"] | None = None,
              limit: int = Query(100, ge=1, le=1000),
              _: Principal = Depends(require("policies:read")),
              session: Session = Depends(get_session)) -> Any:
    stmt = select(ReverificationRun).order_by(ReverificationRun.created_at.desc()).limit(limit)
    if kind:
        stmt = stmt.where(ReverificationRun.kind == kind)
    return _json([{"id": str(r.id), "kind": r.kind,
                   "policy_id": str(r.policy_id) if r.policy_id else None,
                   "window_start": r.window_start, "window_end": r.window_end,
                   "sampled": r.sampled, "details": r.details, "created_at": r.created_at}
                  for r in session.scalars(stmt)])


@router.get("/reverification-runs/{run_id}", tags=["re-verification"],
            summary="A run's report: counts per outcome, drift per fingerprint and model, "
                    "the diverged requests")
def get_run(run_id: DisputeIdPath, _: Principal = Depends(require("policies:read")),
            session: Session = Depends(get_session)) -> Any:
    return _json(reverification.report(session, run_id))
