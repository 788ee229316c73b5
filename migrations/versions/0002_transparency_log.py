"""Transparency log: the integrated tree, its tiles and every signed checkpoint.

``log_tree`` (one row) is the integrated size and root; ``tiles`` holds C2SP tlog-tiles
data (one row per level and index, the widest version: narrower partial tiles are its
prefixes); ``checkpoints`` keeps every checkpoint ever published and is append-only.

Revision ID: 0002_transparency_log
Revises: 0001_core
Create Date: 2026-11-29
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0002_transparency_log"
down_revision = "0001_core"
branch_labels = None
depends_on = None

APP_ROLE = "ledger_app"
EMPTY_ROOT = hashlib.sha256(b"").digest()


def upgrade() -> None:
    op.create_table(
        "log_tree",
        sa.Column("id", sa.SmallInteger, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("root_hash", sa.LargeBinary, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint("id = 1", name="single_row"),
        sa.CheckConstraint("size >= 0", name="size_nonnegative"),
    )
    op.execute(sa.text("INSERT INTO log_tree (id, size, root_hash) VALUES (1, 0, :root)")
               .bindparams(sa.bindparam("root", EMPTY_ROOT, type_=sa.LargeBinary)))
    op.create_table(
        "tiles",
        sa.Column("level", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.CheckConstraint("octet_length(data) BETWEEN 32 AND 8192 "
                           "AND octet_length(data) % 32 = 0", name="data_len"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("tree_size", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("root_hash", sa.LargeBinary, nullable=False),
        sa.Column("note", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
    )
    for event, suffix in (("UPDATE OR DELETE", "append_only"), ("TRUNCATE", "no_truncate")):
        level = "ROW" if suffix == "append_only" else "STATEMENT"
        op.execute(f"CREATE TRIGGER checkpoints_{suffix} BEFORE {event} ON checkpoints "
                   f"FOR EACH {level} EXECUTE FUNCTION ledger_reject_mutation()")
    op.execute(
        f"""
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            REVOKE ALL ON checkpoints FROM {APP_ROLE}, PUBLIC;
            GRANT SELECT, INSERT ON checkpoints TO {APP_ROLE};
            GRANT SELECT, INSERT, UPDATE ON log_tree, tiles TO {APP_ROLE};
          END IF;
        END $$;
        """
    )


def downgrade() -> None:
    for table in ("checkpoints", "tiles", "log_tree"):
        op.drop_table(table)
