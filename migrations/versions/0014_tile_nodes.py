"""Stored subtree hashes of full tiles: ``tile_nodes``.

A full tile (256 hashes) never changes once written. Its 255 interior hashes (tree levels
8L+1 .. 8L+8, :func:`ledger.core.tiles.tile_nodes`) are kept beside it so that an
inclusion or consistency proof is a handful of lookups instead of up to 255 SHA-256 calls
per proof element. They are derived data: the integrator writes them with the tile, every
proof built from them is verified against the signed checkpoint root before it is served
(``ledger.log.proofs``), and ``ledger audit`` recomputes them from the audited tiles.
Rows are never updated or deleted (the append-only trigger); the integrator roles may
insert, readers select.

The upgrade fills the table for the full tiles already stored (255 SHA-256 per tile:
about a second per million entries).

Revision ID: 0014_tile_nodes
Revises: 0015_erasure
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.core.tiles import FULL_TILE_BYTES, TILE_NODES_BYTES, tile_nodes
from ledger.db.grants import grant_statements

revision = "0014_tile_nodes"
down_revision = "0015_erasure"
branch_labels = None
depends_on = None

_BATCH = 2000


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.create_table(
        "tile_nodes",
        sa.Column("level", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("nodes", sa.LargeBinary, nullable=False),
        sa.CheckConstraint(f"octet_length(nodes) = {TILE_NODES_BYTES}", name="nodes_len"),
    )
    for event, suffix in (("UPDATE OR DELETE", "append_only"), ("TRUNCATE", "no_truncate")):
        level = "ROW" if suffix == "append_only" else "STATEMENT"
        op.execute(f"CREATE TRIGGER tile_nodes_{suffix} BEFORE {event} ON tile_nodes "
                   f"FOR EACH {level} EXECUTE FUNCTION ledger_reject_mutation()")
    for table, sql in grant_statements():
        if table == "tile_nodes":
            op.execute(sql)
    conn = op.get_bind()
    after = (-1, -1)
    while True:
        rows = conn.execute(sa.text(
            "SELECT level, idx, data FROM tiles WHERE octet_length(data) = :full "
            "AND (level, idx) > (:level, :idx) ORDER BY level, idx LIMIT :n"),
            {"full": FULL_TILE_BYTES, "level": after[0], "idx": after[1], "n": _BATCH},
        ).fetchall()
        if not rows:
            break
        conn.execute(sa.text("INSERT INTO tile_nodes (level, idx, nodes) "
                             "VALUES (:level, :idx, :nodes)"),
                     [{"level": r[0], "idx": r[1], "nodes": tile_nodes(bytes(r[2]))}
                      for r in rows])
        after = (rows[-1][0], rows[-1][1])


def downgrade() -> None:
    op.drop_table("tile_nodes")
