"""Witnessed checkpoints: cosignatures from C2SP tlog-witness witnesses.

``checkpoint_cosignatures`` holds every cosignature line a witness returned for a stored
checkpoint (append-only, like the checkpoints themselves); ``witness_status`` what the
log's submitter last learned from each witness (mutable).

Revision ID: 0007_witness
Revises: 0006_registry_leaves
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_witness"
down_revision = "0006_registry_leaves"
branch_labels = None
depends_on = None

APP_ROLE = "ledger_app"


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '5s'")
    op.create_table(
        "checkpoint_cosignatures",
        sa.Column("tree_size", sa.BigInteger, sa.ForeignKey("checkpoints.tree_size"),
                  primary_key=True, autoincrement=False),
        sa.Column("witness_name", sa.Text, primary_key=True),
        sa.Column("key_id", sa.BigInteger, nullable=False),
        sa.Column("timestamp", sa.BigInteger, nullable=False),
        sa.Column("signature", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
    )
    op.create_table(
        "witness_status",
        sa.Column("witness_name", sa.Text, primary_key=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("last_size", sa.BigInteger),
        sa.Column("last_ok_at", sa.DateTime(timezone=True)),
        sa.Column("last_error", sa.Text),
        sa.Column("last_attempt_at", sa.DateTime(timezone=True)),
    )
    op.execute("CREATE TRIGGER checkpoint_cosignatures_append_only BEFORE UPDATE OR DELETE "
               "ON checkpoint_cosignatures FOR EACH ROW EXECUTE FUNCTION "
               "ledger_reject_mutation()")
    op.execute("CREATE TRIGGER checkpoint_cosignatures_no_truncate BEFORE TRUNCATE ON "
               "checkpoint_cosignatures FOR EACH STATEMENT EXECUTE FUNCTION "
               "ledger_reject_mutation()")
    grants = [
        f"REVOKE ALL ON checkpoint_cosignatures FROM {APP_ROLE}, PUBLIC",
        f"GRANT SELECT, INSERT ON checkpoint_cosignatures TO {APP_ROLE}",
        f"GRANT SELECT, INSERT, UPDATE ON witness_status TO {APP_ROLE}",
    ]
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
    op.drop_table("witness_status")
    op.drop_table("checkpoint_cosignatures")
