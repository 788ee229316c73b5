"""/v1/keys (signing keys), /v1/api-keys, /v1/audit-events."""

from __future__ import annotations

import base64
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from ledger.api.auth import require
from ledger.api.deps import get_session, get_settings_dep
from ledger.api.params import Cursor, Limit
from ledger.api.routing import StrictJsonRoute
from ledger.api.schemas import (
    COMMON_RESPONSES,
    ApiKeyCreated,
    ApiKeyIn,
    ApiKeyOut,
    AuditPage,
    KeyIn,
    KeyOut,
    RevokeIn,
)
from ledger.core.errors import ValidationFailed
from ledger.core.keys import parse_public_key
from ledger.db.models import ApiKey, SigningKey
from ledger.replay.records import Signer, require_signer
from ledger.services import apikeys as apikey_service
from ledger.services import audit
from ledger.services import keys as key_service
from ledger.services.apikeys import Principal
from ledger.settings import Settings

router = APIRouter(prefix="/v1", responses=COMMON_RESPONSES, route_class=StrictJsonRoute)

KeyIdPath = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the key")]
ApiKeyIdPath = Annotated[str, Path(max_length=64, pattern=r"^[0-9a-fA-F-]+$")]


def registry_signer(request: Request) -> Signer:
    """Key and API-key changes are signed registry leaves: without the service key they
    are refused (503), never made unsigned."""
    return require_signer(request.app.state.service_signer, "a key or API-key change")


class ApiKeyRoleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str


def key_out(row: SigningKey) -> KeyOut:
    return KeyOut(
        keyid=row.keyid, public_key=base64.b64encode(row.public_key).decode(),
        purpose=row.purpose, name=row.name, status=row.status, not_before=row.not_before,
        not_after=row.not_after, created_at=row.created_at, revoked_at=row.revoked_at,
        revoked_reason=row.revoked_reason)


def api_key_out(row: ApiKey) -> ApiKeyOut:
    return ApiKeyOut(id=str(row.id), name=row.name, role=row.role, prefix=row.prefix,
                     created_at=row.created_at, created_by=row.created_by,
                     revoked_at=row.revoked_at)


@router.post("/keys", response_model=KeyOut, status_code=201, tags=["keys"],
             summary="Register a producer, worker, log or ledger public key",
             responses={200: {"model": KeyOut, "description": "Already registered (no change)"},
                        409: COMMON_RESPONSES[400] | {"description": "Registered differently"}})
def register_key(body: KeyIn, response: Response,
                 principal: Principal = Depends(require("keys:write")),
                 session: Session = Depends(get_session),
                 signer: Signer = Depends(registry_signer)) -> KeyOut:
    if body.not_before and body.not_after and body.not_after <= body.not_before:
        raise ValidationFailed("not_after must be later than not_before", code="bad_window")
    raw = parse_public_key(body.public_key)
    row, created = key_service.register_key(session, public_key=raw, purpose=body.purpose,
                                            name=body.name, not_before=body.not_before,
                                            not_after=body.not_after, signer=signer,
                                            actor=principal.name)
    if created:
        audit.record(session, principal, "key.register", row.keyid, purpose=row.purpose,
                     name=row.name)
    session.commit()
    if not created:
        response.status_code = 200
    return key_out(row)


@router.get("/keys", response_model=list[KeyOut], tags=["keys"],
            summary="Signing keys (active and revoked)")
def list_keys(purpose: str | None = Query(None, pattern="^(producer|worker|log|ledger)$"),
              _: Principal = Depends(require("keys:read")),
              session: Session = Depends(get_session)) -> list[KeyOut]:
    return [key_out(k) for k in key_service.list_keys(session, purpose)]


@router.get("/keys/{keyid}", response_model=KeyOut, tags=["keys"])
def get_key(keyid: KeyIdPath, _: Principal = Depends(require("keys:read")),
            session: Session = Depends(get_session)) -> KeyOut:
    return key_out(key_service.get_key(session, keyid))


@router.post("/keys/{keyid}/revoke", response_model=KeyOut, tags=["keys"],
             summary="Revoke a key: new envelopes signed by it are refused; old ones stay "
                     "verifiable")
def revoke_key(keyid: KeyIdPath, body: RevokeIn,
               principal: Principal = Depends(require("keys:write")),
               session: Session = Depends(get_session),
               signer: Signer = Depends(registry_signer)) -> KeyOut:
    row = key_service.revoke_key(session, keyid, body.reason, signer=signer,
                                 actor=principal.name)
    audit.record(session, principal, "key.revoke", keyid, reason=body.reason)
    session.commit()
    return key_out(row)


@router.post("/api-keys", response_model=ApiKeyCreated, status_code=201, tags=["api-keys"],
             responses={409: COMMON_RESPONSES[400] | {"description": "Name in use"}})
def create_api_key(body: ApiKeyIn, principal: Principal = Depends(require("apikeys:admin")),
                   session: Session = Depends(get_session),
                   settings: Settings = Depends(get_settings_dep),
                   signer: Signer = Depends(registry_signer)) -> ApiKeyCreated:
    row, secret = apikey_service.create_api_key(
        session, name=body.name, role=body.role,
        pepper=settings.api_key_pepper.get_secret_value(), created_by=principal.name,
        signer=signer)
    audit.record(session, principal, "api_key.create", str(row.id), name=row.name,
                 role=row.role)
    session.commit()
    return ApiKeyCreated(**api_key_out(row).model_dump(), key=secret)


@router.get("/api-keys", response_model=list[ApiKeyOut], tags=["api-keys"])
def list_api_keys(_: Principal = Depends(require("apikeys:admin")),
                  session: Session = Depends(get_session)) -> list[ApiKeyOut]:
    return [api_key_out(r) for r in apikey_service.list_api_keys(session)]


@router.post("/api-keys/{key_id}/revoke", response_model=ApiKeyOut, tags=["api-keys"])
def revoke_api_key(key_id: ApiKeyIdPath, principal: Principal = Depends(require("apikeys:admin")),
                   session: Session = Depends(get_session),
                   signer: Signer = Depends(registry_signer)) -> ApiKeyOut:
    row = apikey_service.revoke_api_key(session, key_id, signer=signer, actor=principal.name)
    audit.record(session, principal, "api_key.revoke", key_id)
    session.commit()
    return api_key_out(row)


@router.post("/api-keys/{key_id}/role", response_model=ApiKeyOut, tags=["api-keys"],
             summary="Give an active API key another role (a signed registry leaf)")
def change_api_key_role(key_id: ApiKeyIdPath, body: ApiKeyRoleIn,
                        principal: Principal = Depends(require("apikeys:admin")),
                        session: Session = Depends(get_session),
                        signer: Signer = Depends(registry_signer)) -> ApiKeyOut:
    if body.role not in apikey_service.ROLES:
        raise ValidationFailed(f"role must be one of {', '.join(apikey_service.ROLES)}",
                               code="bad_role")
    row = apikey_service.change_api_key_role(session, key_id, body.role, signer=signer,
                                             actor=principal.name)
    audit.record(session, principal, "api_key.role_change", key_id, role=body.role)
    session.commit()
    return api_key_out(row)


@router.get("/audit-events", response_model=AuditPage, tags=["audit"],
            summary="The append-only record of admin and reviewer actions")
def list_audit_events(after: int = Query(0, ge=0, le=2**62, description="events after "
                                        "this id (the older cursor, kept)"),
                      limit: Limit = 100, cursor: Cursor = None,
                      _: Principal = Depends(require("audit:read")),
                      session: Session = Depends(get_session)) -> AuditPage:
    found = audit.list_events(session, after_id=after, limit=limit, cursor=cursor)
    last = found.items[-1].id if len(found.items) == limit else None
    return AuditPage.model_validate({"items": found.items, "next_cursor": found.next_cursor,
                                     "next_after": last})
