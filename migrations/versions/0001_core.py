"""Ledger core: log entries, envelopes, signing keys, API keys, audit events.

Append-only protection: triggers reject UPDATE, DELETE and TRUNCATE on the append-only
tables for every role (owners and superusers included, unless they disable triggers), and
the application role ``ledger_app`` gets only SELECT and INSERT on them.

Revision ID: 0001_core
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None

APPEND_ONLY = ("log_entries", "envelopes", "audit_events")
MUTABLE = ("log_state", "signing_keys", "api_keys")
APP_ROLE = "ledger_app"


def _ts(name: str, nullable: bool = False, default: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable,
                     server_default=sa.func.now() if default else None)


def upgrade() -> None:
    op.create_table(
        "log_state",
        sa.Column("id", sa.SmallInteger, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.CheckConstraint("id = 1", name="single_row"),
        sa.CheckConstraint("size >= 0", name="size_nonnegative"),
    )
    op.execute("INSERT INTO log_state (id, size) VALUES (1, 0)")

    op.create_table(
        "log_entries",
        sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("ref", sa.Text, nullable=False),
        sa.Column("entry", sa.LargeBinary, nullable=False),
        sa.Column("leaf_hash", sa.LargeBinary, nullable=False),
        _ts("created_at"),
        sa.CheckConstraint("idx >= 0", name="idx_nonnegative"),
        sa.CheckConstraint("octet_length(leaf_hash) = 32", name="leaf_hash_len"),
    )

    op.create_table(
        "envelopes",
        sa.Column("log_index", sa.BigInteger, sa.ForeignKey("log_entries.idx"),
                  primary_key=True, autoincrement=False),
        sa.Column("request_id", sa.Text, nullable=False, unique=True),
        sa.Column("dsse", sa.LargeBinary, nullable=False),
        sa.Column("dsse_sha256", sa.LargeBinary, nullable=False),
        sa.Column("keyids", postgresql.ARRAY(sa.Text), nullable=False),
        sa.Column("model_sha256", sa.Text, nullable=False),
        sa.Column("model_name", sa.Text, nullable=False),
        sa.Column("fingerprint_id", sa.Text, nullable=False),
        sa.Column("channel", sa.Text, nullable=False),
        sa.Column("tier", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("output_tokens", sa.Integer, nullable=False),
        _ts("ingested_at"),
    )
    op.create_index("ix_envelopes_model_sha256_log_index", "envelopes",
                    ["model_sha256", "log_index"])
    op.create_index("ix_envelopes_fingerprint_id_log_index", "envelopes",
                    ["fingerprint_id", "log_index"])
    op.create_index("ix_envelopes_channel_log_index", "envelopes", ["channel", "log_index"])
    op.create_index("ix_envelopes_recorded_at", "envelopes", ["recorded_at"])
    op.create_index("ix_envelopes_prompt_tokens", "envelopes", ["prompt_tokens"])
    op.create_index("ix_envelopes_output_tokens", "envelopes", ["output_tokens"])

    op.create_table(
        "signing_keys",
        sa.Column("keyid", sa.Text, primary_key=True),
        sa.Column("public_key", sa.LargeBinary, nullable=False, unique=True),
        sa.Column("purpose", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="active"),
        _ts("not_before"),
        sa.Column("not_after", sa.DateTime(timezone=True)),
        _ts("created_at"),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
        sa.Column("revoked_reason", sa.Text),
        sa.CheckConstraint("purpose IN ('producer', 'worker', 'log', 'ledger')", name="purpose"),
        sa.CheckConstraint("status IN ('active', 'revoked')", name="status"),
        sa.CheckConstraint("octet_length(public_key) = 32", name="public_key_len"),
    )

    op.create_table(
        "api_keys",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("prefix", sa.Text, nullable=False),
        sa.Column("key_hash", sa.LargeBinary, nullable=False, unique=True),
        _ts("created_at"),
        sa.Column("created_by", sa.Text),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint("role IN ('ingester', 'reviewer', 'auditor', 'worker', 'admin')",
                           name="role"),
    )
    op.create_index("uq_api_keys_active_name", "api_keys", ["name"], unique=True,
                    postgresql_where=sa.text("revoked_at IS NULL"))

    op.create_table(
        "audit_events",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        _ts("at"),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("target", sa.Text),
        sa.Column("details", postgresql.JSONB, nullable=False, server_default="{}"),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])

    op.execute(
        """
        CREATE FUNCTION ledger_reject_mutation() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          RAISE EXCEPTION 'inference-ledger: % on append-only table % is not allowed',
            TG_OP, TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';
        END $$;
        """
    )
    for table in APPEND_ONLY:
        op.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION ledger_reject_mutation()"
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION ledger_reject_mutation()"
        )
    grant_app_role(APPEND_ONLY, MUTABLE)


def grant_app_role(append_only: tuple[str, ...], mutable: tuple[str, ...]) -> None:
    """Create the NOLOGIN application role if we may, and grant it what the app needs.

    A deployment logs in as its own user that is a member of ``ledger_app`` (see
    docs/deployment.md); where the migrating user may not create roles, the grants are
    skipped with a notice and an operator applies them.
    """
    op.execute(
        f"""
        DO $$
        BEGIN
          IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            BEGIN
              CREATE ROLE {APP_ROLE} NOLOGIN;
            EXCEPTION WHEN insufficient_privilege THEN
              RAISE NOTICE 'cannot create role {APP_ROLE}; grant it by hand';
            END;
          END IF;
        END $$;
        """
    )
    statements = [f"GRANT USAGE ON SCHEMA public TO {APP_ROLE}"]
    for table in append_only:
        statements.append(f"REVOKE ALL ON {table} FROM {APP_ROLE}, PUBLIC")
        statements.append(f"GRANT SELECT, INSERT ON {table} TO {APP_ROLE}")
    for table in mutable:
        statements.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {APP_ROLE}")
    statements.append(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {APP_ROLE}")
    body = ";\n".join(statements)
    op.execute(
        f"""
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            {body};
          END IF;
        END $$;
        """
    )


def downgrade() -> None:
    for table in ("audit_events", "api_keys", "signing_keys", "envelopes", "log_entries",
                  "log_state"):
        op.drop_table(table)
    op.execute("DROP FUNCTION IF EXISTS ledger_reject_mutation()")
