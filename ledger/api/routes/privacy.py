"""/v1/data-subjects/{id}/erasure and /v1/retention-policies (docs/privacy.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from ledger.api.auth import require
from ledger.api.deps import get_session, get_settings_dep
from ledger.api.routing import StrictJsonRoute
from ledger.api.schemas import COMMON_RESPONSES
from ledger.core.erasure import data_subject_digest
from ledger.db.models import RetentionPolicy
from ledger.privacy import erasure
from ledger.privacy.keys import kek_from_settings
from ledger.replay.records import require_signer
from ledger.services import audit
from ledger.services.apikeys import Principal
from ledger.settings import Settings

router = APIRouter(prefix="/v1", responses=COMMON_RESPONSES, route_class=StrictJsonRoute,
                   tags=["privacy"])

DataSubjectPath = Annotated[str, Path(pattern=r"^[A-Za-z0-9._:@+=-]{1,200}$",
                                      description="the envelopes' data_subject pseudonym")]


class ErasureIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=2000)
    legal_basis: str = Field(min_length=1, max_length=200,
                             description="e.g. 'GDPR Art. 17(1)(b)'")


class ErasureOut(BaseModel):
    erasure_id: str
    log_index: int
    keys_destroyed: int
    records_erased: int
    created: bool


class RetentionPolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    erase_after_days: int = Field(ge=1, le=36_500)
    channel: str | None = Field(default=None, pattern=r"^(deterministic|performance)$")
    model_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class RetentionPolicyOut(RetentionPolicyIn):
    id: str
    enabled: bool
    created_by: str


def _policy_out(row: RetentionPolicy) -> RetentionPolicyOut:
    return RetentionPolicyOut(id=str(row.id), name=row.name,
                              erase_after_days=row.erase_after_days, channel=row.channel,
                              model_sha256=row.model_sha256, enabled=row.enabled,
                              created_by=row.created_by)


@router.post("/data-subjects/{data_subject}/erasure", response_model=ErasureOut,
             status_code=201, summary="Erase a data subject: destroy its data keys and "
             "append a signed erasure leaf (201; 200 when already erased)")
def erase_data_subject(
    data_subject: DataSubjectPath,
    body: ErasureIn,
    request: Request,
    principal: Principal = Depends(require("privacy:admin")),
    session: Session = Depends(get_session),
    settings: Settings = Depends(get_settings_dep),
) -> JSONResponse:
    signer = require_signer(request.app.state.service_signer, "an erasure")
    result = erasure.erase_subject(session, signer, kek_from_settings(settings),
                                   data_subject, actor=principal.name, reason=body.reason,
                                   legal_basis=body.legal_basis)
    if result.created:
        audit.record(session, principal, "data_subject.erased",
                     data_subject_digest(data_subject), erasure_id=result.erasure_id,
                     log_index=result.log_index, legal_basis=body.legal_basis)
    session.commit()  # the leaf, the records and the key destruction: one transaction
    return JSONResponse(result.to_json(), status_code=201 if result.created else 200)


@router.post("/retention-policies", response_model=RetentionPolicyOut, status_code=201,
             summary="Erase what is older than N days (of a channel and/or model)")
def create_retention_policy(
    body: RetentionPolicyIn, request: Request,
    principal: Principal = Depends(require("privacy:admin")),
    session: Session = Depends(get_session),
) -> RetentionPolicyOut:
    signer = require_signer(request.app.state.service_signer, "a retention policy")
    row = erasure.create_policy(session, signer, name=body.name,
                                erase_after_days=body.erase_after_days,
                                channel=body.channel, model_sha256=body.model_sha256,
                                created_by=principal.name)
    audit.record(session, principal, "retention_policy.created", str(row.id),
                 **body.model_dump())
    session.commit()
    return _policy_out(row)


@router.get("/retention-policies", response_model=list[RetentionPolicyOut],
            summary="Retention policies")
def list_retention_policies(
    _: Principal = Depends(require("privacy:admin")),
    session: Session = Depends(get_session),
) -> list[RetentionPolicyOut]:
    return [_policy_out(r) for r in erasure.list_policies(session)]
