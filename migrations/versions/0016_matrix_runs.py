"""Replay matrix runs: ``matrix_runs`` (signed report leaves) and matrix jobs.

- ``matrix_runs``: one row per replay matrix report, a leaf of the log
  (``urn:inference-ledger:matrix-run:v1``, signed by the worker that ran it). ``report``
  holds the report's canonical bytes (``ledger.core.statements.matrix_report_bytes``),
  whose SHA-256 the signed statement carries; ``ledger audit`` checks the row against
  its leaf. Append-only.
- ``replay_jobs.kind`` may be ``matrix`` (a matrix run requested through
  ``POST /v1/matrix-runs``); ``replay_jobs.params`` holds what such a job runs (cells,
  sample), which the signed report repeats.

Revision ID: 0016_matrix_runs
Revises: 0014_tile_nodes
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from ledger.db.grants import GRANTS, ROLES, grant_statements

revision = "0016_matrix_runs"
down_revision = "0014_tile_nodes"
branch_labels = None
depends_on = None

APP_ROLE = "ledger_app"


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.add_column("replay_jobs", sa.Column("params", postgresql.JSONB))
    op.drop_constraint("kind", "replay_jobs", type_="check")
    op.create_check_constraint("kind", "replay_jobs",
                               "kind IN ('dispute', 'reverification', 'gate', 'matrix')")
    op.create_table(
        "matrix_runs",
        sa.Column("log_index", sa.BigInteger, sa.ForeignKey("log_entries.idx"),
                  primary_key=True, autoincrement=False),
        sa.Column("run_id", sa.Text, nullable=False, unique=True),
        sa.Column("job_id", postgresql.UUID(as_uuid=True), sa.ForeignKey("replay_jobs.id"),
                  unique=True),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("fingerprint_id", sa.Text, nullable=False),
        sa.Column("report", sa.LargeBinary, nullable=False),
        sa.Column("dsse", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
    )
    op.execute("CREATE TRIGGER matrix_runs_append_only BEFORE UPDATE OR DELETE ON "
               "matrix_runs FOR EACH ROW EXECUTE FUNCTION ledger_reject_mutation()")
    op.execute("CREATE TRIGGER matrix_runs_no_truncate BEFORE TRUNCATE ON matrix_runs "
               "FOR EACH STATEMENT EXECUTE FUNCTION ledger_reject_mutation()")
    op.execute(f"REVOKE ALL ON matrix_runs FROM {', '.join(ROLES)}, PUBLIC")
    for _, sql in grant_statements({r: {t: p for t, p in g.items() if t == "matrix_runs"}
                                    for r, g in GRANTS.items()}):
        op.execute(sql)
    op.execute(f"""
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            GRANT SELECT, INSERT ON matrix_runs TO {APP_ROLE};
          END IF;
        END $$;
    """)


def downgrade() -> None:
    op.drop_table("matrix_runs")
    op.execute("DELETE FROM replay_job_items WHERE job_id IN "
               "(SELECT id FROM replay_jobs WHERE kind = 'matrix')")
    op.execute("DELETE FROM job_attempts WHERE job_id IN "
               "(SELECT id FROM replay_jobs WHERE kind = 'matrix')")
    op.execute("DELETE FROM replay_jobs WHERE kind = 'matrix'")
    op.drop_constraint("kind", "replay_jobs", type_="check")
    op.create_check_constraint("kind", "replay_jobs",
                               "kind IN ('dispute', 'reverification', 'gate')")
    op.drop_column("replay_jobs", "params")
