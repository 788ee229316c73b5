"""Registry leaves: key and API-key changes as signed log leaves (admin_events).

Every registration or revocation of a signing key and every creation, revocation or role
change of an API key is an in-toto statement (``urn:inference-ledger:admin-event:v1``)
signed by the ledger's service key and sequenced as an ``admin_event`` leaf of the
transparency log. ``admin_events`` keeps the signed bytes, append-only like
``dispute_events`` and ``verdicts``: ``ledger_app`` may only SELECT and INSERT, and
triggers reject UPDATE, DELETE and TRUNCATE for everyone.

Revision ID: 0006_registry_leaves
Revises: 0005_ingest_cost
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006_registry_leaves"
down_revision = "0005_ingest_cost"
branch_labels = None
depends_on = None

APP_ROLE = "ledger_app"
KINDS = ("signing_key.registered", "signing_key.revoked", "api_key.created",
         "api_key.revoked", "api_key.role_changed")


def upgrade() -> None:
    op.create_table(
        "admin_events",
        sa.Column("log_index", sa.BigInteger, sa.ForeignKey("log_entries.idx"),
                  primary_key=True, autoincrement=False),
        sa.Column("event_id", sa.Text, nullable=False, unique=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("body", postgresql.JSONB, nullable=False),
        sa.Column("dsse", sa.LargeBinary, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint("kind IN (" + ", ".join(f"'{k}'" for k in KINDS) + ")",
                           name="kind"),
    )
    op.create_index("ix_admin_events_target", "admin_events", ["target"])
    op.execute("CREATE TRIGGER admin_events_append_only BEFORE UPDATE OR DELETE ON "
               "admin_events FOR EACH ROW EXECUTE FUNCTION ledger_reject_mutation()")
    op.execute("CREATE TRIGGER admin_events_no_truncate BEFORE TRUNCATE ON admin_events "
               "FOR EACH STATEMENT EXECUTE FUNCTION ledger_reject_mutation()")
    op.execute(
        f"""
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            REVOKE ALL ON admin_events FROM {APP_ROLE}, PUBLIC;
            GRANT SELECT, INSERT ON admin_events TO {APP_ROLE};
          END IF;
        END $$;
        """
    )


def downgrade() -> None:
    op.drop_table("admin_events")
