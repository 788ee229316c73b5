"""A replay matrix run's request as a registry leaf: the admin_events kind
``matrix.requested`` (ledger.core.statements), signed in the transaction that makes the
run's jobs, so ``ledger audit`` can tell a run requested through the API or the gate
from a job row planted or rewritten in the database.

Revision ID: 0018_matrix_requests
Revises: 0017_matrix_fingerprints
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0018_matrix_requests"
down_revision = "0017_matrix_fingerprints"
branch_labels = None
depends_on = None

BEFORE = ("signing_key.registered", "signing_key.revoked", "api_key.created",
          "api_key.revoked", "api_key.role_changed", "policy.created", "policy.paused",
          "policy.resumed", "policy.deleted", "policy.window_claimed", "gate.claimed",
          "retention.created")
AFTER = (*BEFORE, "matrix.requested")


def _kinds(kinds: tuple[str, ...]) -> None:
    op.execute("SET LOCAL lock_timeout = '5s'")
    op.drop_constraint("kind", "admin_events", type_="check")
    op.create_check_constraint("kind", "admin_events",
                               "kind IN (" + ", ".join(f"'{k}'" for k in kinds) + ")")


def upgrade() -> None:
    _kinds(AFTER)


def downgrade() -> None:
    # leaves cannot be deleted (append-only): a downgrade of a database holding a
    # matrix request fails on the constraint, as it should
    _kinds(BEFORE)
