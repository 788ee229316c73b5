"""Replay: fingerprints, workers, disputes and their events, replay jobs and attempts,
verdicts, re-verification policies and runs.

``dispute_events`` and ``verdicts`` are leaves of the transparency log and append-only,
like envelopes. ``fingerprints`` is filled at ingest (one row per distinct runtime).

Revision ID: 0003_replay
Revises: 0002_transparency_log
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003_replay"
down_revision = "0002_transparency_log"
branch_labels = None
depends_on = None

APP_ROLE = "ledger_app"
APPEND_ONLY = ("dispute_events", "verdicts")
MUTABLE = ("fingerprints", "workers", "disputes", "replay_jobs", "replay_job_items",
           "job_attempts", "reverification_policies", "reverification_runs")


def _now(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable,
                     server_default=None if nullable else sa.func.now())


def upgrade() -> None:
    op.create_table(
        "fingerprints",
        sa.Column("fingerprint_id", sa.Text, primary_key=True),
        sa.Column("runtime", postgresql.JSONB, nullable=False),
        _now("first_seen_at"),
    )
    op.execute("INSERT INTO fingerprints (fingerprint_id, runtime) "
               "SELECT DISTINCT ON (fingerprint_id) fingerprint_id, '{}'::jsonb FROM envelopes")
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.Text, primary_key=True),
        sa.Column("fingerprint_id", sa.Text, nullable=False),
        sa.Column("runtime", postgresql.JSONB, nullable=False),
        sa.Column("models", postgresql.JSONB, nullable=False),
        sa.Column("engine", sa.Text, nullable=False),
        sa.Column("version", sa.Text, nullable=False),
        sa.Column("keyid", sa.Text, nullable=False),
        sa.Column("hostname", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        _now("started_at"),
        _now("last_heartbeat"),
        _now("stopped_at", nullable=True),
    )
    op.create_index("ix_workers_fingerprint_id", "workers", ["fingerprint_id"])

    op.create_table(
        "replay_jobs",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("fingerprint_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("state_reason", sa.Text),
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default="1"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default="3"),
        sa.Column("tolerance", sa.Float),
        sa.Column("run_id", postgresql.UUID(as_uuid=True)),
        _now("created_at"),
        _now("published_at", nullable=True),
        _now("started_at", nullable=True),
        _now("finished_at", nullable=True),
        sa.Column("worker_id", sa.Text),
        sa.Column("last_error", sa.Text),
        sa.CheckConstraint("kind IN ('dispute', 'reverification', 'gate')", name="kind"),
        sa.CheckConstraint("state IN ('awaiting_worker', 'queued', 'running', 'done', "
                           "'poisoned', 'failed')", name="state"),
    )
    op.create_index("ix_replay_jobs_state_fingerprint_id", "replay_jobs",
                    ["state", "fingerprint_id"])
    op.create_index("ix_replay_jobs_run_id", "replay_jobs", ["run_id"])
    op.create_table(
        "replay_job_items",
        sa.Column("job_id", postgresql.UUID(as_uuid=True),
                  sa.ForeignKey("replay_jobs.id"), primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("envelope_index", sa.BigInteger, sa.ForeignKey("envelopes.log_index"),
                  nullable=False),
        sa.Column("request_id", sa.Text, nullable=False),
        sa.Column("dispute_id", postgresql.UUID(as_uuid=True)),
    )
    op.create_index("ix_replay_job_items_envelope_index", "replay_job_items",
                    ["envelope_index"])
    op.create_table(
        "job_attempts",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("job_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("replay_jobs.id"),
                  nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("fingerprint_id", sa.Text, nullable=False),
        _now("started_at"),
        _now("finished_at", nullable=True),
        sa.Column("outcome", sa.Text),
        sa.Column("detail", sa.Text),
    )
    op.create_index("ix_job_attempts_job_id", "job_attempts", ["job_id"])

    op.create_table(
        "disputes",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("request_id", sa.Text, sa.ForeignKey("envelopes.request_id"), nullable=False),
        sa.Column("envelope_index", sa.BigInteger, nullable=False),
        sa.Column("fingerprint_id", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("priority", sa.Text, nullable=False, server_default="normal"),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("state_reason", sa.Text),
        sa.Column("opened_by", sa.Text, nullable=False),
        _now("opened_at"),
        _now("updated_at"),
        sa.Column("job_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("replay_jobs.id")),
        sa.Column("verdict_id", sa.Text),
        sa.Column("resolution", sa.Text),
        sa.Column("resolution_note", sa.Text),
        sa.Column("resolved_by", sa.Text),
        _now("resolved_at", nullable=True),
        sa.Column("idempotency_key", sa.Text, unique=True),
        sa.CheckConstraint("priority IN ('low', 'normal', 'high')", name="priority"),
        sa.CheckConstraint("state IN ('opened', 'queued', 'awaiting_worker', 'replaying', "
                           "'verdict', 'resolved')", name="state"),
        sa.CheckConstraint("resolution IS NULL OR resolution IN ('upheld', 'rejected')",
                           name="resolution"),
    )
    op.create_index("ix_disputes_state", "disputes", ["state", "opened_at"])
    op.create_index("ix_disputes_request_id", "disputes", ["request_id"])
    op.create_index("uq_disputes_open_request", "disputes", ["request_id"], unique=True,
                    postgresql_where=sa.text("state <> 'resolved'"))

    op.create_table(
        "dispute_events",
        sa.Column("log_index", sa.BigInteger, sa.ForeignKey("log_entries.idx"),
                  primary_key=True, autoincrement=False),
        sa.Column("event_id", sa.Text, nullable=False, unique=True),
        sa.Column("dispute_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("disputes.id"),
                  nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("body", postgresql.JSONB, nullable=False),
        _now("at"),
        sa.Column("dsse", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("dispute_id", "seq", name="uq_dispute_events_dispute_id_seq"),
    )
    op.create_table(
        "verdicts",
        sa.Column("log_index", sa.BigInteger, sa.ForeignKey("log_entries.idx"),
                  primary_key=True, autoincrement=False),
        sa.Column("verdict_id", sa.Text, nullable=False, unique=True),
        sa.Column("job_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("replay_jobs.id"),
                  nullable=False),
        sa.Column("envelope_index", sa.BigInteger, sa.ForeignKey("envelopes.log_index"),
                  nullable=False),
        sa.Column("request_id", sa.Text, nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("tier", sa.Text),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("fingerprint_id", sa.Text, nullable=False),
        sa.Column("details", postgresql.JSONB, nullable=False),
        sa.Column("dsse", sa.LargeBinary, nullable=False),
        _now("created_at"),
        sa.UniqueConstraint("job_id", "envelope_index", name="uq_verdicts_job_id_envelope_index"),
        sa.CheckConstraint("outcome IN ('reproduced', 'diverged', 'unverifiable', 'error')",
                           name="outcome"),
    )
    op.create_index("ix_verdicts_envelope_index", "verdicts", ["envelope_index"])

    op.create_table(
        "reverification_policies",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("interval_seconds", sa.Integer, nullable=False),
        sa.Column("sample_size", sa.Integer),
        sa.Column("sample_rate", sa.Float),
        sa.Column("model_sha256", sa.Text),
        sa.Column("fingerprint_id", sa.Text),
        sa.Column("channel", sa.Text),
        sa.Column("min_age_seconds", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_age_seconds", sa.Integer),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("created_by", sa.Text, nullable=False),
        _now("created_at"),
        sa.Column("first_window_start", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("interval_seconds >= 1", name="interval"),
        sa.CheckConstraint("(sample_size IS NULL) <> (sample_rate IS NULL)", name="sample"),
    )
    op.create_table(
        "reverification_runs",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("policy_id", postgresql.UUID(as_uuid=True),
                  sa.ForeignKey("reverification_policies.id")),
        sa.Column("kind", sa.Text, nullable=False, server_default="policy"),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sampled", sa.Integer, nullable=False, server_default="0"),
        sa.Column("details", postgresql.JSONB, nullable=False, server_default="{}"),
        _now("created_at"),
        sa.UniqueConstraint("policy_id", "window_start",
                            name="uq_reverification_runs_policy_id_window_start"),
        sa.CheckConstraint("kind IN ('policy', 'gate')", name="kind"),
    )
    op.create_foreign_key("fk_replay_jobs_run_id_reverification_runs", "replay_jobs",
                          "reverification_runs", ["run_id"], ["id"])

    for table in APPEND_ONLY:
        op.execute(f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                   f"FOR EACH ROW EXECUTE FUNCTION ledger_reject_mutation()")
        op.execute(f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                   f"FOR EACH STATEMENT EXECUTE FUNCTION ledger_reject_mutation()")
    grants = [f"REVOKE ALL ON {t} FROM {APP_ROLE}, PUBLIC; GRANT SELECT, INSERT ON {t} "
              f"TO {APP_ROLE}" for t in APPEND_ONLY]
    grants += [f"GRANT SELECT, INSERT, UPDATE, DELETE ON {t} TO {APP_ROLE}" for t in MUTABLE]
    grants.append(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {APP_ROLE}")
    op.execute(
        f"""
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            {'; '.join(grants)};
          END IF;
        END $$;
        """
    )


def downgrade() -> None:
    op.drop_constraint("fk_replay_jobs_run_id_reverification_runs", "replay_jobs")
    for table in ("reverification_runs", "reverification_policies", "verdicts",
                  "dispute_events", "disputes", "job_attempts", "replay_job_items",
                  "replay_jobs", "workers", "fingerprints"):
        op.drop_table(table)
