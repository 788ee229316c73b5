"""Re-verification you can operate: a policy's drift alert threshold, the alerts table
(webhook deliveries: one row per alert, retried until delivered), and the grants that let
the API pause, resume and delete policies and the beat record alerts.

Revision ID: 0009_policy_ops
Revises: 0011_console
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from ledger.db.grants import GRANTS, OPTIONAL_TABLES, ROLES, grant_statements, serial_grant

revision = "0009_policy_ops"
down_revision = "0011_console"
branch_labels = None
depends_on = None

APP_ROLE = "ledger_app"
TABLES = ("reverification_policies", "reverification_runs", "alerts")


def _guarded(table: str, sql: str) -> str:
    if table not in OPTIONAL_TABLES:
        return sql
    body = sql.replace("$$", "$inner$")
    return (f"DO $guard$ BEGIN IF to_regclass('public.{table}') IS NOT NULL THEN "
            f"EXECUTE $stmt${body}$stmt$; END IF; END $guard$")


def _regrant() -> None:
    """Grant these tables exactly what :data:`ledger.db.grants.GRANTS` lists now."""
    roles = ", ".join(ROLES)
    for table in TABLES:
        op.execute(_guarded(table, f"REVOKE ALL ON {table} FROM {roles}"))
        op.execute(_guarded(table, serial_grant(table, f"REVOKE ALL ON SEQUENCE %s FROM "
                                                       f"{roles}")))
    for table, sql in grant_statements({r: {t: p for t, p in g.items() if t in TABLES}
                                        for r, g in GRANTS.items()}):
        op.execute(_guarded(table, sql))


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '5s'")
    op.add_column("reverification_policies",
                  sa.Column("drift_alert_threshold", sa.Float, nullable=True))
    op.create_check_constraint(
        "drift_alert_threshold", "reverification_policies",
        "drift_alert_threshold IS NULL OR (drift_alert_threshold >= 0 AND "
        "drift_alert_threshold <= 1)")
    op.create_table(
        "alerts",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("ref", sa.Text, nullable=False),
        sa.Column("body", JSONB, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("delivered_at", sa.DateTime(timezone=True)),
        sa.Column("last_error", sa.Text),
        sa.UniqueConstraint("kind", "ref"),
        sa.CheckConstraint("kind IN ('drift', 'gate_failed')", name="kind"),
    )
    _regrant()
    op.execute(f"""
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            GRANT SELECT, INSERT, UPDATE, DELETE ON alerts TO {APP_ROLE};
            GRANT USAGE, SELECT ON SEQUENCE alerts_id_seq TO {APP_ROLE};
          END IF;
        END $$;
    """)


def downgrade() -> None:
    op.drop_table("alerts")
    op.drop_column("reverification_policies", "drift_alert_threshold")
