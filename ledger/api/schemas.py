"""Request and response models of the REST API (they make the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Free text from clients: no control characters (PostgreSQL text cannot hold NUL at all).
SAFE_TEXT = r"^[^\x00-\x1f\x7f]*$"


class Problem(BaseModel):
    """RFC 9457 problem details."""

    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    detail: str
    code: str


PROBLEM_CONTENT = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": desc, "content": PROBLEM_CONTENT}
    for status, desc in (
        (400, "Malformed request"),
        (401, "Missing or bad API key"),
        (403, "Role not allowed"),
        (404, "Not found"),
        (409, "Conflicts with the stored state (the problem says how)"),
        (413, "Body or item too large"),
        (422, "Invalid content"),
        (503, "Database unavailable; retry after Retry-After seconds"),
    )
}


class DsseSignature(BaseModel):
    keyid: str = Field(pattern=r"^[0-9a-f]{64}$")
    sig: str


class DsseEnvelopeIn(BaseModel):
    """A DSSE envelope; ``payload`` is the base64 of the in-toto statement bytes."""

    model_config = ConfigDict(extra="forbid")
    payload: str
    payloadType: Literal["application/vnd.in-toto+json"]
    signatures: list[DsseSignature] = Field(min_length=1, max_length=8)


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    envelopes: list[DsseEnvelopeIn] = Field(min_length=1)


class IngestResult(BaseModel):
    """Outcome of one envelope: created (201), existing (200) or, in a batch, an error."""

    position: int = 0
    status: int
    outcome: Literal["created", "existing", "conflict", "rejected"]
    request_id: str | None = None
    log_index: int | None = None
    dsse_sha256: str | None = None
    fingerprint_id: str | None = None
    existing_dsse_sha256: str | None = None
    problem: dict[str, Any] | None = None
    receipt: dict[str, Any] | None = None


class BatchOut(BaseModel):
    created: int
    existing: int
    conflicts: int
    rejected: int
    results: list[IngestResult]


class IndexFieldsOut(BaseModel):
    request_id: str
    log_index: int
    recorded_at: datetime
    ingested_at: datetime
    channel: str
    tier: str
    model_sha256: str
    model_name: str
    fingerprint_id: str
    prompt_tokens: int
    output_tokens: int
    keyids: list[str]
    dsse_sha256: str


class EnvelopeOut(BaseModel):
    """The stored DSSE envelope (its bytes verbatim in the response) and its index fields."""

    dsse: DsseEnvelopeIn
    index: IndexFieldsOut


class EnvelopePage(BaseModel):
    items: list[IndexFieldsOut]
    next_cursor: str | None


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    public_key: str = Field(description="PEM (SubjectPublicKeyInfo) or base64 of the raw 32 bytes",
                            max_length=2000)
    purpose: Literal["producer", "worker", "log", "ledger"]
    name: str = Field(min_length=1, max_length=200, pattern=SAFE_TEXT)
    not_before: datetime | None = None
    not_after: datetime | None = None


class KeyOut(BaseModel):
    keyid: str
    public_key: str = Field(description="base64 of the raw 32-byte Ed25519 public key")
    purpose: str
    name: str
    status: str
    not_before: datetime
    not_after: datetime | None
    created_at: datetime
    revoked_at: datetime | None
    revoked_reason: str | None


class RevokeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=1000, pattern=SAFE_TEXT)


class ApiKeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200, pattern=SAFE_TEXT)
    role: Literal["ingester", "reviewer", "auditor", "worker", "admin"]


class ApiKeyOut(BaseModel):
    id: str
    name: str
    role: str
    prefix: str
    created_at: datetime
    created_by: str | None
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyOut):
    key: str = Field(description="The API key. It is shown only in this response.")


class AuditEventOut(BaseModel):
    id: int
    at: datetime
    actor: str
    role: str
    action: str
    target: str | None
    details: dict[str, Any]


class AuditPage(BaseModel):
    items: list[AuditEventOut]
    next_after: int | None
