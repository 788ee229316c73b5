"""One fingerprint-change gate per (new fingerprint, model).

Revision ID: 0004_gate_unique
Revises: 0003_replay
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0004_gate_unique"
down_revision = "0003_replay"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE UNIQUE INDEX uq_reverification_runs_gate ON reverification_runs "
               "((details->>'new_fingerprint'), (details->>'model_sha256')) "
               "WHERE kind = 'gate'")


def downgrade() -> None:
    op.execute("DROP INDEX uq_reverification_runs_gate")
