"""Matrix runs over the fingerprint axis, and their Idempotency-Key enforced by the database.

- ``ux_replay_jobs_matrix_idempotency``: one matrix run per Idempotency-Key. Only a run's
  lead job (its first part) carries the key in ``params``, so two concurrent first
  requests with the same key cannot both make a run: the second insert waits for the
  first and fails, and the API returns the first run (or 409 for another body).
- ``ix_replay_jobs_matrix_run``: a run's other parts (one matrix job per fingerprint)
  name their lead job in ``params->>'matrix_run'``.

Revision ID: 0017_matrix_fingerprints
Revises: 0016_matrix_runs
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0017_matrix_fingerprints"
down_revision = "0016_matrix_runs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    # a key reused before this index existed: keep the first run's, drop the later ones'
    op.execute("""
        UPDATE replay_jobs j SET params = j.params - 'idempotency_key'
        WHERE kind = 'matrix' AND params ? 'idempotency_key'
          AND params->>'idempotency_key' IS NOT NULL
          AND EXISTS (SELECT 1 FROM replay_jobs e WHERE e.kind = 'matrix'
                      AND e.params->>'idempotency_key' = j.params->>'idempotency_key'
                      AND (e.created_at, e.id) < (j.created_at, j.id))
    """)
    op.execute("CREATE UNIQUE INDEX ux_replay_jobs_matrix_idempotency ON replay_jobs "
               "((params->>'idempotency_key')) WHERE kind = 'matrix' "
               "AND params->>'idempotency_key' IS NOT NULL")
    op.execute("CREATE INDEX ix_replay_jobs_matrix_run ON replay_jobs "
               "((params->>'matrix_run')) WHERE kind = 'matrix'")


def downgrade() -> None:
    op.execute("DROP INDEX ix_replay_jobs_matrix_run")
    op.execute("DROP INDEX ux_replay_jobs_matrix_idempotency")
