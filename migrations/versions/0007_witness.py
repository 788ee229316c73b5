"""Witnessed checkpoints: cosignatures from C2SP tlog-witness witnesses.

Revision ID: 0007_witness
Revises: 0006_registry_leaves
Create Date: 2026-12-01
"""

from __future__ import annotations

revision = "0007_witness"
down_revision = "0006_registry_leaves"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
