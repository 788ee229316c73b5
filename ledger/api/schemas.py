"""Request and response models of the REST API (they make the OpenAPI document)."""

from __future__ import annotations

from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from ledger.api.params import FINGERPRINT_PATTERN, AwareTime, RequestIdField
from ledger.core.envelope import SHA256_HEX_PATTERN, IndexFields
from ledger.core.states import DisputeState, Priority, Resolution

T = TypeVar("T")

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


class _StoredIndexFields(BaseModel):
    """What the ledger adds to an envelope's own index fields when it stores it."""

    log_index: int
    ingested_at: datetime
    keyids: list[str]
    dsse_sha256: str


#: An envelope's index columns: :class:`ledger.core.envelope.IndexFields` (from the signed
#: statement) plus what storing it added. A field with a default there (``data_subject``:
#: not a column) is not served.
if TYPE_CHECKING:
    IndexFieldsOut = _StoredIndexFields
else:
    IndexFieldsOut = create_model(
        "IndexFieldsOut", __base__=_StoredIndexFields,
        **{f.name: (get_type_hints(IndexFields)[f.name], ...)
           for f in dataclass_fields(IndexFields) if f.default is MISSING})


class EnvelopeOut(BaseModel):
    """The stored DSSE envelope (its bytes verbatim in the response) and its index fields."""

    dsse: DsseEnvelopeIn
    index: IndexFieldsOut


class Page(BaseModel, Generic[T]):
    """The one list shape: a page of items and the cursor of the next (None at the end)."""

    items: list[T]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page")


class EnvelopePage(Page[IndexFieldsOut]):
    pass


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    public_key: str = Field(description="PEM (SubjectPublicKeyInfo) or base64 of the raw 32 bytes",
                            max_length=2000)
    purpose: Literal["producer", "worker", "log", "ledger"]
    name: str = Field(min_length=1, max_length=200, pattern=SAFE_TEXT)
    not_before: AwareTime | None = None
    not_after: AwareTime | None = None


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
    model_config = ConfigDict(from_attributes=True)
    id: int
    at: datetime
    actor: str
    role: str
    action: str
    target: str | None
    details: dict[str, Any]


class AuditPage(Page[AuditEventOut]):
    next_after: int | None = Field(description="the last item's id (the older `after` "
                                   "cursor, kept)")


# --- disputes, verdicts, workers, re-verification ---------------------------------------

class DisputeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: RequestIdField
    reason: str = Field(min_length=1, max_length=4000, pattern=SAFE_TEXT)
    priority: Priority = Priority.NORMAL
    assertions: dict[str, Any] | None = Field(
        default=None, description="vendor records only: an assertion set (docs/semantic.md) "
        "the semantic verification checks instead of the record's own; signed into the "
        "dispute's opened event")


class CommentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=10_000, pattern=SAFE_TEXT)


class ResolveIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resolution: Resolution
    note: str = Field(min_length=1, max_length=10_000, pattern=SAFE_TEXT)


class CommentOut(BaseModel):
    seq: int
    event_id: str
    log_index: int


class DisputeOut(BaseModel):
    """A dispute; state, resolution and verdict as its signed events say (``integrity``
    names the stored columns that disagree)."""

    id: str
    request_id: str
    envelope_log_index: int
    fingerprint_id: str
    reason: str
    priority: str
    state: DisputeState | str | None
    state_reason: str | None
    opened_by: str
    opened_at: datetime
    updated_at: datetime
    job_id: str | None
    verdict_id: str | None
    resolution: str | None
    resolution_note: str | None
    resolved_by: str | None
    resolved_at: datetime | str | None
    integrity: dict[str, Any]


class DisputeEventOut(BaseModel):
    seq: int | None
    event_id: str | None
    kind: str | None
    actor: str | None
    at: datetime | str | None
    body: dict[str, Any] | None
    log_index: int
    integrity: dict[str, Any]


class AttemptOut(BaseModel):
    attempt: int
    worker_id: str | None
    fingerprint_id: str | None
    started_at: datetime | None
    finished_at: datetime | None
    outcome: str | None
    detail: str | None


class VerdictOut(BaseModel):
    """A verdict as the worker signed it, with the stored DSSE envelope."""

    verdict_id: str | None
    log_index: int
    job_id: str
    request_id: str | None
    envelope_log_index: int | None
    outcome: str | None
    tier: str | None
    worker_id: str | None
    fingerprint_id: str | None
    details: dict[str, Any] | None
    created_at: datetime
    dsse: dict[str, Any]
    integrity: dict[str, Any]


class VerdictWithProofOut(VerdictOut):
    proof: dict[str, Any] | None = Field(description="inclusion proof; null until integrated")


class DisputeDetailOut(DisputeOut):
    events: list[DisputeEventOut]
    attempts: list[AttemptOut]
    verdict: VerdictOut | None
    proofs: dict[str, Any] = Field(description="inclusion proofs of the envelope, the "
                                   "verdict and each event (null until integrated)")


class DisputePage(Page[DisputeOut]):
    next_before: datetime | None = Field(description="the last item's opened_at when the "
                                         "page is full (the older `before` cursor, kept: "
                                         "it skips disputes opened at the same instant)")


class WorkerOut(BaseModel):
    worker_id: str
    fingerprint_id: str
    engine: str
    version: str
    models: Any
    hostname: str | None
    started_at: datetime
    last_heartbeat: datetime
    stopped_at: datetime | None
    live: bool
    runtime: dict[str, Any]


class FingerprintOut(BaseModel):
    fingerprint_id: str
    runtime: dict[str, Any]
    first_seen_at: datetime
    envelopes: int
    live_workers: list[str]
    has_live_worker: bool
    jobs_awaiting_worker: int


class FingerprintPage(Page[FingerprintOut]):
    without_live_worker: list[str]


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200, pattern=SAFE_TEXT)
    interval_seconds: int = Field(ge=1, le=366 * 86400)
    sample_size: int | None = Field(default=None, ge=1, le=100_000)
    sample_rate: float | None = Field(default=None, gt=0.0, le=1.0)
    model_sha256: str | None = Field(default=None, pattern=SHA256_HEX_PATTERN)
    fingerprint_id: str | None = Field(default=None, pattern=FINGERPRINT_PATTERN)
    channel: Literal["deterministic", "performance"] | None = None
    min_age_seconds: int = Field(default=0, ge=0, le=10 * 366 * 86400)
    max_age_seconds: int | None = Field(default=None, ge=1, le=10 * 366 * 86400)
    first_window_start: AwareTime | None = Field(
        default=None, description="default: now (only future windows are sampled)")
    enabled: bool = True
    drift_alert_threshold: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Alert (LEDGER_WEBHOOK_URL) when a run's "
        "drift rate for a (fingerprint, model) exceeds this.")

    @model_validator(mode="after")
    def _one_sampling_rule(self) -> PolicyIn:
        if (self.sample_size is None) == (self.sample_rate is None):
            raise ValueError("give exactly one of sample_size and sample_rate")
        return self


class PolicyOut(BaseModel):
    id: str
    name: str
    interval_seconds: int
    sample_size: int | None
    sample_rate: float | None
    model_sha256: str | None
    fingerprint_id: str | None
    channel: str | None
    min_age_seconds: int
    max_age_seconds: int | None
    enabled: bool
    drift_alert_threshold: float | None = None
    created_by: str | None
    created_at: datetime
    first_window_start: datetime


class PolicyPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(description="false pauses the policy, true resumes it")


class PolicyWithRunsOut(PolicyOut):
    runs: int


class PolicyPage(Page[PolicyWithRunsOut]):
    pass


class RunOut(BaseModel):
    id: str
    kind: str
    policy_id: str | None
    window_start: datetime | None
    window_end: datetime | None
    sampled: int
    details: dict[str, Any]
    created_at: datetime


class RunPage(Page[RunOut]):
    pass


class RunReportOut(RunOut):
    jobs: dict[str, int]
    complete: bool
    counts: dict[str, int]
    tiers: dict[str, int]
    drift: list[dict[str, Any]]
    diverged: list[dict[str, Any]]
    semantic: list[dict[str, Any]] = Field(
        default_factory=list, description="vendor records: pass rates pooled per (vendor "
        "fingerprint, model alias) with Wilson intervals (docs/semantic.md)")
    gate: dict[str, Any] | None = Field(
        None, description="a fingerprint gate's decision: passed (None until complete), "
        "decided_by (its signed matrix report), matrix_run, reason")


class SemanticPassRatesOut(BaseModel):
    """Pass rates of semantic verdicts per (vendor fingerprint, model alias, time bucket)."""

    items: list[dict[str, Any]]


class MatrixRunIn(BaseModel):
    """A replay matrix run: a sample of one model's records replayed by a worker under
    each cell (``axis:value+...``: batch, arrivals, chunk, prefix, graphs, kernels)."""

    model_config = ConfigDict(extra="forbid")
    model_sha256: str = Field(pattern=SHA256_HEX_PATTERN)
    fingerprint_id: str | None = Field(
        None, pattern=FINGERPRINT_PATTERN,
        description="The runtime to run on (its workers' queue); default: the runtime most "
                    "of the sample was recorded on")
    records_fingerprint_id: str | None = Field(
        None, pattern=FINGERPRINT_PATTERN,
        description="Sample only records recorded on this runtime")
    sample: int = Field(16, ge=1, le=256)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    cells: list[Annotated[str, Field(min_length=1, max_length=100,
                                     pattern=r"^[a-z0-9:+]+$")]] = Field(
        default_factory=list, max_length=16,
        description="Cells to run (default: every axis)")
    fingerprints: Literal["all"] | list[Annotated[str, Field(
        pattern=FINGERPRINT_PATTERN)]] | None = Field(
        None, max_length=16,
        description='The fingerprint axis: the same records replayed by the workers of each '
                    'of these runtimes ("all": every live one whose worker holds the model), '
                    "one signed report per fingerprint")


class MatrixRunSummary(BaseModel):
    """A matrix run in the list, checked against its signed request first: with a
    ``problem`` (why it is not vouched for) only its ID and time are given."""

    id: str
    created_at: datetime
    problem: str | None = Field(description="why the run's jobs are not the ones its signed "
                                            "matrix.requested leaf states; null when they are")
    model_sha256: str | None
    cells: list[str]
    requested_by: str | None
    gate_run_id: str | None
    parts: list[tuple[str, str]] = Field(description="(fingerprint, state) of each part, "
                                                     "the lead first")
    links: dict[str, str] = Field(default_factory=dict)


class MatrixRunPage(Page[MatrixRunSummary]):
    pass


class MatrixRunOut(BaseModel):
    """A matrix run's state; ``report`` once its worker signed it (checked against the
    signed leaf before it is served: ``signed`` says what was checked)."""

    id: str
    state: str
    state_reason: str | None
    fingerprint_id: str
    params: dict[str, Any]
    records: int
    created_at: datetime
    finished_at: datetime | None
    report: dict[str, Any] | None
    signed: dict[str, Any] | None
    parts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="One per fingerprint (the first is the lead: report and signed above "
                    "are its): state, the report its worker signed, what was checked")
    by_fingerprint: list[dict[str, Any]] = Field(
        default_factory=list, description="Each part's cells, one row per (fingerprint, cell)")
    gate_run_id: str | None = Field(
        None, description="The fingerprint gate (re-verification run) this run decides")
    links: dict[str, str] = Field(default_factory=dict)
