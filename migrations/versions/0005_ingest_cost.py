"""Cheaper ingest: lz4 for the stored DSSE bytes, no indexes on token counts.

``prompt_tokens`` and ``output_tokens`` stay columns (search and reports read them) but
nothing looks them up by value, and every index is paid for on each insert. lz4 compresses
the (mostly base64) DSSE bytes at a fraction of pglz's CPU cost.

Revision ID: 0005_ingest_cost
Revises: 0004_gate_unique
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0005_ingest_cost"
down_revision = "0004_gate_unique"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_envelopes_prompt_tokens", table_name="envelopes")
    op.drop_index("ix_envelopes_output_tokens", table_name="envelopes")
    op.execute("""
        DO $$
        BEGIN
          ALTER TABLE envelopes ALTER COLUMN dsse SET COMPRESSION lz4;
        EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
          RAISE NOTICE 'lz4 is not available in this PostgreSQL build; keeping pglz';
        END $$;
    """)


def downgrade() -> None:
    op.create_index("ix_envelopes_prompt_tokens", "envelopes", ["prompt_tokens"])
    op.create_index("ix_envelopes_output_tokens", "envelopes", ["output_tokens"])
