"""Registry leaves: key and API-key changes as signed log leaves (admin_events).

Revision ID: 0006_registry_leaves
Revises: 0005_ingest_cost
Create Date: 2026-12-01
"""

from __future__ import annotations

revision = "0006_registry_leaves"
down_revision = "0005_ingest_cost"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
