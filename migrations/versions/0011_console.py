"""The reviewer console: registered tokenizers, sign-in sessions, search indexes.

- ``tokenizers``: a ``tokenizer.json`` registered by an admin under the SHA-256 of its
  bytes (the envelope's ``artifacts.tokenizer_sha256``); the console decodes token IDs
  with it and re-hashes the bytes before every use, so an edited row decodes nothing.
- ``console_sessions``: an API key exchanged for a session cookie; the row keeps only the
  HMAC of the cookie under the API-key pepper, the key it stands for and the session's CSRF token. Revoking the
  key ends its sessions (every request re-checks the key).
- ``envelopes`` indexes for the console's search: request ID prefixes (on
  ``request_id COLLATE "C"``, so ``LIKE 'abc%'`` and the ID order of a page both use it,
  whatever the database's collation) and model names case-insensitively.

Revision ID: 0011_console
Revises: 0008_component_roles
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from ledger.db.grants import grant_statements

revision = "0011_console"
down_revision = "0008_component_roles"
branch_labels = None
depends_on = None

_TABLES = ("tokenizers", "console_sessions")


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.create_table(
        "tokenizers",
        sa.Column("tokenizer_sha256", sa.Text(), primary_key=True),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("vocab_size", sa.Integer(), nullable=False),
        sa.Column("registered_by", sa.Text(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint("tokenizer_sha256 ~ '^[0-9a-f]{64}$'",
                           name="ck_tokenizers_sha256_hex"),
    )
    op.create_table(
        "console_sessions",
        sa.Column("token_sha256", sa.LargeBinary(), primary_key=True),
        sa.Column("api_key_id", postgresql.UUID(as_uuid=True),
                  sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("csrf_token", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_console_sessions_api_key_id", "console_sessions", ["api_key_id"])
    op.create_index("ix_envelopes_request_id_prefix", "envelopes",
                    [sa.text('request_id COLLATE "C"')])
    op.create_index("ix_envelopes_model_name_lower", "envelopes",
                    [sa.text("lower(model_name)"), "log_index"])
    # the component roles of 0008, as ledger.db.grants lists them for these tables
    for table, sql in grant_statements():
        if table in _TABLES:
            op.execute(sql)


def downgrade() -> None:
    op.drop_index("ix_envelopes_model_name_lower", table_name="envelopes")
    op.drop_index("ix_envelopes_request_id_prefix", table_name="envelopes")
    op.drop_index("ix_console_sessions_api_key_id", table_name="console_sessions")
    op.drop_table("console_sessions")
    op.drop_table("tokenizers")
