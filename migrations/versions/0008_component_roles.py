"""Least privilege: one database role per component (API, beat/integrator, workers,
auditors).

Revision ID: 0008_component_roles
Revises: 0007_witness
Create Date: 2026-12-01
"""

from __future__ import annotations

revision = "0008_component_roles"
down_revision = "0007_witness"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
