"""Re-verification policies as registry leaves: the admin_events kinds a policy's
creation, pause, resumption, deletion and each claimed window are signed as, and the
fingerprint gates the beat claims, and a retention policy's creation (its table comes in
0015).

Revision ID: 0012_policy_leaves
Revises: 0009_policy_ops
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0012_policy_leaves"
down_revision = "0009_policy_ops"
branch_labels = None
depends_on = None

BEFORE = ("signing_key.registered", "signing_key.revoked", "api_key.created",
          "api_key.revoked", "api_key.role_changed")
AFTER = (*BEFORE, "policy.created", "policy.paused", "policy.resumed", "policy.deleted",
         "policy.window_claimed", "gate.claimed", "retention.created")


def _kinds(kinds: tuple[str, ...]) -> None:
    op.execute("SET LOCAL lock_timeout = '5s'")
    op.drop_constraint("kind", "admin_events", type_="check")
    op.create_check_constraint("kind", "admin_events",
                               "kind IN (" + ", ".join(f"'{k}'" for k in kinds) + ")")


def upgrade() -> None:
    _kinds(AFTER)


def downgrade() -> None:
    # policy leaves cannot be deleted (append-only): a downgrade of a database holding
    # any fails on the constraint, as it should
    _kinds(BEFORE)
