"""Tables. The schema itself is created only by Alembic migrations (``migrations/``);
these declarations must match them (a test compares the two).

Append-only tables (``APPEND_ONLY_TABLES``) are protected twice: the application role
``ledger_app`` has only SELECT and INSERT on them, and triggers reject UPDATE, DELETE and
TRUNCATE for everyone, owners included.
"""

from __future__ import annotations

import uuid
from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ledger.core.statements import ADMIN_EVENT_KINDS
from ledger.core.states import (
    DisputeState,
    JobState,
    Priority,
    Resolution,
    VerdictOutcome,
    check_in,
)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

APPEND_ONLY_TABLES = ("log_entries", "envelopes", "audit_events", "checkpoints",
                      "dispute_events", "verdicts", "admin_events", "checkpoint_cosignatures",
                      "erasures", "erased_keys")
APP_ROLE = "ledger_app"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _now() -> Any:
    return mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())


class LogState(Base):
    """One row: how many entries have been sequenced (the next log index)."""

    __tablename__ = "log_state"
    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger, nullable=False)
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),
                      CheckConstraint("size >= 0", name="size_nonnegative"))


class LogEntry(Base):
    """A leaf of the transparency log, in sequence order (gap-free from 0)."""

    __tablename__ = "log_entries"
    idx: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    ref: Mapped[str] = mapped_column(Text, nullable=False)
    entry: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    leaf_hash: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    created_at: Mapped[datetime] = _now()
    __table_args__ = (CheckConstraint("idx >= 0", name="idx_nonnegative"),
                      CheckConstraint("octet_length(leaf_hash) = 32", name="leaf_hash_len"))


class Envelope(Base):
    """A signed execution envelope: the DSSE bytes as stored, plus index columns."""

    __tablename__ = "envelopes"
    log_index: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("log_entries.idx"), primary_key=True, autoincrement=False)
    request_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    dsse: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    dsse_sha256: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    keyids: Mapped[list[str]] = mapped_column(ARRAY(Text), nullable=False)
    model_sha256: Mapped[str] = mapped_column(Text, nullable=False)
    model_name: Mapped[str] = mapped_column(Text, nullable=False)
    fingerprint_id: Mapped[str] = mapped_column(Text, nullable=False)
    channel: Mapped[str] = mapped_column(Text, nullable=False)
    tier: Mapped[str] = mapped_column(Text, nullable=False)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    output_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    ingested_at: Mapped[datetime] = _now()
    __table_args__ = (
        Index("ix_envelopes_model_sha256_log_index", "model_sha256", "log_index"),
        Index("ix_envelopes_fingerprint_id_log_index", "fingerprint_id", "log_index"),
        Index("ix_envelopes_channel_log_index", "channel", "log_index"),
        Index("ix_envelopes_recorded_at", "recorded_at"),
        # the console's search (0011): request ID prefixes, model names case-insensitively
        # on request_id COLLATE "C" (0011); reflection shows the column, so it is named so
        Index("ix_envelopes_request_id_prefix", "request_id"),
        Index("ix_envelopes_model_name_lower", func.lower(text("model_name")), "log_index"),
        # 0015: the envelopes sealed under one data key (sealed blob header)
        Index("ix_envelopes_sealed_key", text("substring(dsse from 1 for 21)")),
    )


class SigningKey(Base):
    """An Ed25519 public key the ledger trusts for one purpose, with a validity window."""

    __tablename__ = "signing_keys"
    keyid: Mapped[str] = mapped_column(Text, primary_key=True)
    public_key: Mapped[bytes] = mapped_column(LargeBinary, nullable=False, unique=True)
    purpose: Mapped[str] = mapped_column(Text, nullable=False)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False, server_default="active")
    not_before: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                 server_default=func.now())
    not_after: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _now()
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_reason: Mapped[str | None] = mapped_column(Text)
    __table_args__ = (
        CheckConstraint("purpose IN ('producer', 'worker', 'log', 'ledger')", name="purpose"),
        CheckConstraint("status IN ('active', 'revoked')", name="status"),
        CheckConstraint("octet_length(public_key) = 32", name="public_key_len"),
    )


class ApiKey(Base):
    """An API key, stored as HMAC-SHA256(pepper, key); the key itself is shown once."""

    __tablename__ = "api_keys"
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    role: Mapped[str] = mapped_column(Text, nullable=False)
    prefix: Mapped[str] = mapped_column(Text, nullable=False)
    key_hash: Mapped[bytes] = mapped_column(LargeBinary, nullable=False, unique=True)
    created_at: Mapped[datetime] = _now()
    created_by: Mapped[str | None] = mapped_column(Text)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (
        CheckConstraint("role IN ('ingester', 'reviewer', 'auditor', 'worker', 'admin')",
                        name="role"),
        Index("uq_api_keys_active_name", "name", unique=True,
              postgresql_where="revoked_at IS NULL"),
    )


class AuditEvent(Base):
    """Append-only record of every admin and reviewer action."""

    __tablename__ = "audit_events"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = _now()
    actor: Mapped[str] = mapped_column(Text, nullable=False)
    role: Mapped[str] = mapped_column(Text, nullable=False)
    action: Mapped[str] = mapped_column(Text, nullable=False)
    target: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False,
                                                    server_default="{}")
    __table_args__ = (Index("ix_audit_events_at", "at"),)


class LogTree(Base):
    """One row: the integrated tree (size and root) that the latest checkpoint signs."""

    __tablename__ = "log_tree"
    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger, nullable=False)
    root_hash: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    updated_at: Mapped[datetime] = _now()
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),
                      CheckConstraint("size >= 0", name="size_nonnegative"))


class TileRow(Base):
    """C2SP tlog-tiles data: the widest version of each (level, index) tile."""

    __tablename__ = "tiles"
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    idx: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    __table_args__ = (CheckConstraint("octet_length(data) BETWEEN 32 AND 8192 "
                                      "AND octet_length(data) % 32 = 0", name="data_len"),)


class TileNodesRow(Base):
    """The 255 subtree hashes inside each full tile (``ledger.core.tiles.tile_nodes``):
    derived, never changed, checked against the signed root whenever a proof uses them."""

    __tablename__ = "tile_nodes"
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    idx: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    nodes: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    __table_args__ = (CheckConstraint("octet_length(nodes) = 8160", name="nodes_len"),)


class CheckpointRow(Base):
    """Every checkpoint the log has published (append-only)."""

    __tablename__ = "checkpoints"
    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    root_hash: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    note: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    created_at: Mapped[datetime] = _now()


class Fingerprint(Base):
    """Every runtime fingerprint seen in an envelope (filled at ingest)."""

    __tablename__ = "fingerprints"
    fingerprint_id: Mapped[str] = mapped_column(Text, primary_key=True)
    runtime: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    first_seen_at: Mapped[datetime] = _now()


class Worker(Base):
    """A replay worker process: its fingerprint, the models it holds, its heartbeat."""

    __tablename__ = "workers"
    worker_id: Mapped[str] = mapped_column(Text, primary_key=True)
    fingerprint_id: Mapped[str] = mapped_column(Text, nullable=False, index=True)
    runtime: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    models: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False)
    engine: Mapped[str] = mapped_column(Text, nullable=False)
    version: Mapped[str] = mapped_column(Text, nullable=False)
    keyid: Mapped[str] = mapped_column(Text, nullable=False)
    hostname: Mapped[str] = mapped_column(Text, nullable=False)
    pid: Mapped[int] = mapped_column(Integer, nullable=False)
    started_at: Mapped[datetime] = _now()
    last_heartbeat: Mapped[datetime] = _now()
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ReplayJob(Base):
    """A unit of replay work for one fingerprint: one or more envelopes, run as one batch."""

    __tablename__ = "replay_jobs"
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    fingerprint_id: Mapped[str] = mapped_column(Text, nullable=False)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    state: Mapped[str] = mapped_column(Text, nullable=False)
    state_reason: Mapped[str | None] = mapped_column(Text)
    priority: Mapped[int] = mapped_column(SmallInteger, nullable=False, server_default="1")
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    max_attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="3")
    tolerance: Mapped[float | None] = mapped_column()
    run_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("reverification_runs.id"), index=True)
    created_at: Mapped[datetime] = _now()
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    worker_id: Mapped[str | None] = mapped_column(Text)
    last_error: Mapped[str | None] = mapped_column(Text)
    params: Mapped[dict[str, Any] | None] = mapped_column(JSONB)   # a matrix job's cells
    __table_args__ = (
        CheckConstraint("kind IN ('dispute', 'reverification', 'gate', 'matrix')",
                        name="kind"),
        CheckConstraint(check_in("state", JobState), name="state"),
        Index("ix_replay_jobs_state_fingerprint_id", "state", "fingerprint_id"),
        # 0017: one matrix run per Idempotency-Key (only a run's lead job carries it)
        Index("ux_replay_jobs_matrix_idempotency", text("(params ->> 'idempotency_key')"),
              unique=True, postgresql_where=text(
                  "kind = 'matrix' AND (params ->> 'idempotency_key') IS NOT NULL")),
        # 0017: a run's other parts (one matrix job per fingerprint) name their lead job
        Index("ix_replay_jobs_matrix_run", text("(params ->> 'matrix_run')"),
              postgresql_where=text("kind = 'matrix'")),
    )


class ReplayJobItem(Base):
    __tablename__ = "replay_job_items"
    job_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("replay_jobs.id"),
                                              primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    envelope_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("envelopes.log_index"),
                                                nullable=False, index=True)
    request_id: Mapped[str] = mapped_column(Text, nullable=False)
    dispute_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))


class JobAttempt(Base):
    """One delivery of a job to a worker: started, and how it ended (or not: a crash)."""

    __tablename__ = "job_attempts"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("replay_jobs.id"),
                                              nullable=False, index=True)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    worker_id: Mapped[str] = mapped_column(Text, nullable=False)
    fingerprint_id: Mapped[str] = mapped_column(Text, nullable=False)
    started_at: Mapped[datetime] = _now()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    outcome: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[str | None] = mapped_column(Text)


class Dispute(Base):
    __tablename__ = "disputes"
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    request_id: Mapped[str] = mapped_column(Text, ForeignKey("envelopes.request_id"),
                                            nullable=False, index=True)
    envelope_index: Mapped[int] = mapped_column(BigInteger, nullable=False)
    fingerprint_id: Mapped[str] = mapped_column(Text, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    priority: Mapped[str] = mapped_column(Text, nullable=False, server_default="normal")
    state: Mapped[str] = mapped_column(Text, nullable=False)
    state_reason: Mapped[str | None] = mapped_column(Text)
    opened_by: Mapped[str] = mapped_column(Text, nullable=False)
    opened_at: Mapped[datetime] = _now()
    updated_at: Mapped[datetime] = _now()
    job_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True),
                                                     ForeignKey("replay_jobs.id"))
    verdict_id: Mapped[str | None] = mapped_column(Text)
    resolution: Mapped[str | None] = mapped_column(Text)
    resolution_note: Mapped[str | None] = mapped_column(Text)
    resolved_by: Mapped[str | None] = mapped_column(Text)
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    idempotency_key: Mapped[str | None] = mapped_column(Text, unique=True)
    __table_args__ = (
        CheckConstraint(check_in("priority", Priority), name="priority"),
        CheckConstraint(check_in("state", DisputeState), name="state"),
        CheckConstraint("resolution IS NULL OR " + check_in("resolution", Resolution),
                        name="resolution"),
        Index("ix_disputes_state", "state", "opened_at"),
        Index("uq_disputes_open_request", "request_id", unique=True,
              postgresql_where=f"state <> '{DisputeState.RESOLVED.value}'"),
    )


class DisputeEvent(Base):
    """A dispute's state change or comment: signed by the ledger key, a leaf of the log."""

    __tablename__ = "dispute_events"
    log_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("log_entries.idx"),
                                           primary_key=True, autoincrement=False)
    event_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    dispute_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("disputes.id"),
                                                  nullable=False)
    seq: Mapped[int] = mapped_column(Integer, nullable=False)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    actor: Mapped[str] = mapped_column(Text, nullable=False)
    body: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    at: Mapped[datetime] = _now()
    dsse: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    __table_args__ = (UniqueConstraint("dispute_id", "seq"),)


class AdminEvent(Base):
    """A key or API-key change: signed by the ledger's service key, a leaf of the log
    (the registry through which every producer and worker key is trusted)."""

    __tablename__ = "admin_events"
    log_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("log_entries.idx"),
                                           primary_key=True, autoincrement=False)
    event_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    actor: Mapped[str] = mapped_column(Text, nullable=False)
    target: Mapped[str] = mapped_column(Text, nullable=False, index=True)
    body: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    dsse: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    at: Mapped[datetime] = _now()
    __table_args__ = (
        CheckConstraint("kind IN (" + ", ".join(f"'{k}'" for k in ADMIN_EVENT_KINDS) + ")",
                        name="kind"),
    )


class Verdict(Base):
    """A signed verdict on one envelope (a leaf of the log); one per job and envelope."""

    __tablename__ = "verdicts"
    log_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("log_entries.idx"),
                                           primary_key=True, autoincrement=False)
    verdict_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    job_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("replay_jobs.id"),
                                              nullable=False)
    envelope_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("envelopes.log_index"),
                                                nullable=False, index=True)
    request_id: Mapped[str] = mapped_column(Text, nullable=False)
    outcome: Mapped[str] = mapped_column(Text, nullable=False)
    tier: Mapped[str | None] = mapped_column(Text)
    worker_id: Mapped[str] = mapped_column(Text, nullable=False)
    fingerprint_id: Mapped[str] = mapped_column(Text, nullable=False)
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    dsse: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    created_at: Mapped[datetime] = _now()
    __table_args__ = (
        UniqueConstraint("job_id", "envelope_index"),
        CheckConstraint(check_in("outcome", VerdictOutcome), name="outcome"),
    )


class MatrixRun(Base):
    """A signed replay matrix report (a leaf of the log), by the worker that ran it."""

    __tablename__ = "matrix_runs"
    log_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("log_entries.idx"),
                                           primary_key=True, autoincrement=False)
    run_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    job_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("replay_jobs.id"), unique=True)
    worker_id: Mapped[str] = mapped_column(Text, nullable=False)
    fingerprint_id: Mapped[str] = mapped_column(Text, nullable=False)
    report: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    dsse: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    created_at: Mapped[datetime] = _now()


class ReverificationPolicy(Base):
    __tablename__ = "reverification_policies"
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    name: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    interval_seconds: Mapped[int] = mapped_column(Integer, nullable=False)
    sample_size: Mapped[int | None] = mapped_column(Integer)
    sample_rate: Mapped[float | None] = mapped_column()
    model_sha256: Mapped[str | None] = mapped_column(Text)
    fingerprint_id: Mapped[str | None] = mapped_column(Text)
    channel: Mapped[str | None] = mapped_column(Text)
    min_age_seconds: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    max_age_seconds: Mapped[int | None] = mapped_column(Integer)
    enabled: Mapped[bool] = mapped_column(nullable=False, server_default="true")
    #: a run whose drift rate (per fingerprint and model) exceeds this raises an alert
    drift_alert_threshold: Mapped[float | None] = mapped_column()
    created_by: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = _now()
    first_window_start: Mapped[datetime] = mapped_column(DateTime(timezone=True),
                                                         nullable=False)
    __table_args__ = (
        CheckConstraint("interval_seconds >= 1", name="interval"),
        CheckConstraint("(sample_size IS NULL) <> (sample_rate IS NULL)", name="sample"),
        CheckConstraint("drift_alert_threshold IS NULL OR (drift_alert_threshold >= 0 AND "
                        "drift_alert_threshold <= 1)", name="drift_alert_threshold"),
    )


class Alert(Base):
    """A webhook alert (drift above a policy's threshold, a failed fingerprint gate): one
    row per alert, retried by ``ledger beat`` until delivered (LEDGER_WEBHOOK_URL)."""

    __tablename__ = "alerts"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    ref: Mapped[str] = mapped_column(Text, nullable=False)
    body: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = _now()
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    next_attempt_at: Mapped[datetime] = _now()
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    __table_args__ = (UniqueConstraint("kind", "ref"),
                      CheckConstraint("kind IN ('drift', 'gate_failed')", name="kind"))


class ReverificationRun(Base):
    __tablename__ = "reverification_runs"
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    policy_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("reverification_policies.id"))
    kind: Mapped[str] = mapped_column(Text, nullable=False, server_default="policy")
    window_start: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    window_end: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    sampled: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default="{}")
    created_at: Mapped[datetime] = _now()
    __table_args__ = (
        UniqueConstraint("policy_id", "window_start"),
        CheckConstraint("kind IN ('policy', 'gate')", name="kind"),
        Index("uq_reverification_runs_gate", text("(details ->> 'new_fingerprint')"),
              text("(details ->> 'model_sha256')"), unique=True,
              postgresql_where=text("kind = 'gate'")),
    )


class CheckpointCosignature(Base):
    """A witness's cosignature (C2SP tlog-cosignature line) on a stored checkpoint,
    verified against the witness's configured key before it was stored (append-only)."""

    __tablename__ = "checkpoint_cosignatures"
    tree_size: Mapped[int] = mapped_column(BigInteger, ForeignKey("checkpoints.tree_size"),
                                           primary_key=True, autoincrement=False)
    witness_name: Mapped[str] = mapped_column(Text, primary_key=True)
    key_id: Mapped[int] = mapped_column(BigInteger, nullable=False)
    timestamp: Mapped[int] = mapped_column(BigInteger, nullable=False)
    signature: Mapped[str] = mapped_column(Text, nullable=False)
    """The whole signature line, without its newline."""
    created_at: Mapped[datetime] = _now()


class WitnessStatus(Base):
    """What the log knows of each configured witness (mutable; informational: trust rests
    on the cosignatures, never on this row)."""

    __tablename__ = "witness_status"
    witness_name: Mapped[str] = mapped_column(Text, primary_key=True)
    url: Mapped[str] = mapped_column(Text, nullable=False)
    last_size: Mapped[int | None] = mapped_column(BigInteger)
    """The size the witness last said it cosigned (from a 200 or a 409)."""
    last_ok_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    last_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Tokenizer(Base):
    """A ``tokenizer.json`` an admin registered, keyed by the SHA-256 of its bytes (the
    envelope's ``artifacts.tokenizer_sha256``). Used only to show token IDs as text in the
    console; the bytes are re-hashed before use."""

    __tablename__ = "tokenizers"
    tokenizer_sha256: Mapped[str] = mapped_column(Text, primary_key=True)
    content: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    vocab_size: Mapped[int] = mapped_column(Integer, nullable=False)
    registered_by: Mapped[str] = mapped_column(Text, nullable=False)
    registered_at: Mapped[datetime] = _now()
    __table_args__ = (CheckConstraint("tokenizer_sha256 ~ '^[0-9a-f]{64}$'",
                                      name="sha256_hex"),)


class ConsoleSession(Base):
    """A console sign-in: an API key exchanged for a cookie (only its HMAC under the API-key
    pepper is kept, as for API keys)."""

    __tablename__ = "console_sessions"
    token_sha256: Mapped[bytes] = mapped_column(LargeBinary, primary_key=True)
    api_key_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("api_keys.id"),
                                                  nullable=False, index=True)
    csrf_token: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = _now()
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class DataKey(Base):
    """A per-subject data key, wrapped by the key-encryption key (which is not in the
    database). Scope: one data subject's envelopes of one channel, model and UTC day.
    Deleting the row destroys the key (only with an erasure leaf: migration 0015)."""

    __tablename__ = "data_keys"
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    data_subject: Mapped[str] = mapped_column(Text, nullable=False)
    channel: Mapped[str] = mapped_column(Text, nullable=False)
    model_sha256: Mapped[str] = mapped_column(Text, nullable=False)
    day: Mapped[date] = mapped_column(Date, nullable=False, index=True)
    wrapped: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    kek_id: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = _now()
    __table_args__ = (UniqueConstraint("data_subject", "channel", "model_sha256", "day",
                                       name="uq_data_keys_scope"),)


class Erasure(Base):
    """A signed erasure statement (a leaf of the log): which data keys were destroyed and
    the tombstones of the envelopes sealed under them (append-only)."""

    __tablename__ = "erasures"
    log_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("log_entries.idx"),
                                           primary_key=True, autoincrement=False)
    erasure_id: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    actor: Mapped[str] = mapped_column(Text, nullable=False)
    data_subject_sha256: Mapped[str | None] = mapped_column(Text, index=True)
    policy: Mapped[str | None] = mapped_column(Text)
    body: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    dsse: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    at: Mapped[datetime] = _now()
    __table_args__ = (CheckConstraint("kind IN ('subject', 'retention')", name="kind"),)


class ErasedKey(Base):
    """Which erasure leaf destroyed which data key (append-only; audited against the
    signed statement)."""

    __tablename__ = "erased_keys"
    key_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    erasure_index: Mapped[int] = mapped_column(BigInteger, ForeignKey("erasures.log_index"),
                                               nullable=False, index=True)
    records: Mapped[int] = mapped_column(Integer, nullable=False)


class RetentionPolicy(Base):
    """Erase the envelopes older than ``erase_after_days`` (of a channel and/or model,
    or all), run by ``ledger beat``."""

    __tablename__ = "retention_policies"
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    name: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    channel: Mapped[str | None] = mapped_column(Text)
    model_sha256: Mapped[str | None] = mapped_column(Text)
    erase_after_days: Mapped[int] = mapped_column(Integer, nullable=False)
    enabled: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="true")
    created_by: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = _now()
    __table_args__ = (CheckConstraint("erase_after_days >= 1", name="erase_after_days"),)
