"""Erasure without breaking the proofs: per-subject data keys, erasure leaves, retention.

- ``data_keys``: one AES-256 data key per (data subject, channel, model, UTC day of
  ``recorded_at``), stored only wrapped by the key-encryption key (which lives outside the
  database, ``LEDGER_KEK_FILE``). Envelope content sealed under it is readable while the
  row exists. The only table of the ledger that rows leave: deleting a row destroys the
  key (crypto-shredding), and a trigger allows that only for a key an ``erased_keys`` row
  of this transaction names (an erasure leaf signed by the service key).
- ``erasures``: signed erasure statements (``urn:inference-ledger:erasure:v1``), leaves
  of the log, append-only.
- ``erased_keys``: which erasure leaf destroyed which key (append-only; ``ledger audit``
  checks it against the signed statements).
- ``retention_policies``: erase what is older than N days, per channel and/or model
  (``ledger beat`` runs them).

Revision ID: 0015_erasure
Revises: 0012_policy_leaves
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from ledger.db.grants import GRANTS, ROLES, grant_statements, serial_grant

revision = "0015_erasure"
down_revision = "0012_policy_leaves"
branch_labels = None
depends_on = None

APP_ROLE = "ledger_app"
TABLES = ("data_keys", "erasures", "erased_keys", "retention_policies")
APPEND_ONLY = ("erasures", "erased_keys")

KEY_DESTRUCTION_TRIGGER = """
CREATE FUNCTION ledger_data_key_destroyed_with_erasure() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM erased_keys WHERE key_id = OLD.id) THEN
    RAISE EXCEPTION 'inference-ledger: data key % may only be destroyed by an erasure '
      '(an erased_keys row naming a signed erasure leaf)', OLD.id
      USING ERRCODE = 'insufficient_privilege';
  END IF;
  RETURN OLD;
END $$;
CREATE TRIGGER data_keys_destroyed_with_erasure BEFORE DELETE ON data_keys
  FOR EACH ROW EXECUTE FUNCTION ledger_data_key_destroyed_with_erasure();
CREATE FUNCTION ledger_data_key_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'inference-ledger: data keys are never changed, only destroyed'
    USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE TRIGGER data_keys_immutable BEFORE UPDATE ON data_keys
  FOR EACH ROW EXECUTE FUNCTION ledger_data_key_immutable();
CREATE TRIGGER data_keys_no_truncate BEFORE TRUNCATE ON data_keys
  FOR EACH STATEMENT EXECUTE FUNCTION ledger_reject_mutation();
"""


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.create_table(
        "data_keys",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("data_subject", sa.Text, nullable=False),
        sa.Column("channel", sa.Text, nullable=False),
        sa.Column("model_sha256", sa.Text, nullable=False),
        sa.Column("day", sa.Date, nullable=False),
        sa.Column("wrapped", sa.LargeBinary, nullable=False),
        sa.Column("kek_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.UniqueConstraint("data_subject", "channel", "model_sha256", "day",
                            name="uq_data_keys_scope"),
    )
    op.create_index("ix_data_keys_day", "data_keys", ["day"])
    # an erasure finds what a key sealed by the blob's header (magic + key ID)
    op.create_index("ix_envelopes_sealed_key", "envelopes",
                    [sa.text("substring(dsse from 1 for 21)")])
    op.create_table(
        "erasures",
        sa.Column("log_index", sa.BigInteger, sa.ForeignKey("log_entries.idx"),
                  primary_key=True, autoincrement=False),
        sa.Column("erasure_id", sa.Text, nullable=False, unique=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("data_subject_sha256", sa.Text),
        sa.Column("policy", sa.Text),
        sa.Column("body", postgresql.JSONB, nullable=False),
        sa.Column("dsse", sa.LargeBinary, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint("kind IN ('subject', 'retention')", name="kind"),
    )
    op.create_index("ix_erasures_data_subject_sha256", "erasures", ["data_subject_sha256"])
    op.create_table(
        "erased_keys",
        sa.Column("key_id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("erasure_index", sa.BigInteger, sa.ForeignKey("erasures.log_index"),
                  nullable=False),
        sa.Column("records", sa.Integer, nullable=False),
    )
    op.create_index("ix_erased_keys_erasure_index", "erased_keys", ["erasure_index"])
    op.create_table(
        "retention_policies",
        sa.Column("id", postgresql.UUID(as_uuid=True), primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("channel", sa.Text),
        sa.Column("model_sha256", sa.Text),
        sa.Column("erase_after_days", sa.Integer, nullable=False),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default="true"),
        sa.Column("created_by", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
        sa.CheckConstraint("erase_after_days >= 1", name="erase_after_days"),
    )
    for table in APPEND_ONLY:
        op.execute(f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                   "FOR EACH ROW EXECUTE FUNCTION ledger_reject_mutation()")
        op.execute(f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                   "FOR EACH STATEMENT EXECUTE FUNCTION ledger_reject_mutation()")
    op.execute(KEY_DESTRUCTION_TRIGGER)
    roles = ", ".join(ROLES)
    for table in TABLES:
        op.execute(f"REVOKE ALL ON {table} FROM {roles}, PUBLIC")
        op.execute(serial_grant(table, f"REVOKE ALL ON SEQUENCE %s FROM {roles}"))
    for _, sql in grant_statements({r: {t: p for t, p in g.items() if t in TABLES}
                                    for r, g in GRANTS.items()}):
        op.execute(sql)
    op.execute(f"""
        DO $$
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP_ROLE}') THEN
            GRANT SELECT, INSERT, DELETE ON data_keys TO {APP_ROLE};
            GRANT SELECT, INSERT ON erasures, erased_keys TO {APP_ROLE};
            GRANT SELECT, INSERT, UPDATE, DELETE ON retention_policies TO {APP_ROLE};
          END IF;
        END $$;
    """)


def downgrade() -> None:
    for table in ("retention_policies", "erased_keys", "erasures", "data_keys"):
        op.drop_table(table)
    op.execute("DROP FUNCTION IF EXISTS ledger_data_key_destroyed_with_erasure()")
    op.execute("DROP FUNCTION IF EXISTS ledger_data_key_immutable()")
