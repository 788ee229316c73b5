"""Least privilege: one database role per component (API, beat/integrator, workers,
auditors).

Creates the NOLOGIN group roles ``ledger_api``, ``ledger_beat``, ``ledger_worker`` and
``ledger_auditor`` (roles are cluster-wide, so creation tolerates roles that exist; grants
are per database) and grants each exactly what :data:`ledger.db.grants.GRANTS` lists,
column-level where a table is only partly mutable. Tables of the sibling migrations
0006/0007 are granted only where they exist.

Triggers add what grants cannot express, for every role including the owner (unless it
disables triggers):

- a checkpoint row can only be inserted for the tree the integrator just built: at
  commit, ``tree_size``/``root_hash`` must equal ``log_tree`` (a deferred constraint
  trigger), and never for more entries than are sequenced; ``log_tree`` only grows and
  never past ``log_state`` (so a checkpoint for a future size is refused, and later
  integrations cannot be wedged on a unique-key violation);
- revocation is final (``api_keys.revoked_at``, ``signing_keys.status``);
- a dispute's resolution, once set, does not change.

``ledger_app`` (0001-0003) is left as it was, for deployments that still use it; new
deployments use the component roles (docs/deployment.md, "Database roles").

Revision ID: 0008_component_roles
Revises: 0007_witness
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

from ledger.db.grants import GRANTS, OPTIONAL_TABLES, ROLES, grant_statements, serial_grant

revision = "0008_component_roles"
down_revision = "0007_witness"
branch_labels = None
depends_on = None


def _create_roles() -> None:
    for role in ROLES:
        op.execute(f"""
            DO $$
            BEGIN
              IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
                BEGIN
                  CREATE ROLE {role} NOLOGIN;
                EXCEPTION WHEN duplicate_object OR unique_violation THEN
                  NULL;  -- another database of this cluster created it meanwhile
                END;
              END IF;
            END $$;
        """)


def _guarded(table: str, sql: str) -> str:
    """``sql`` only where ``table`` exists (the tables of 0006/0007)."""
    if table not in OPTIONAL_TABLES:
        return sql
    body = sql.replace("$$", "$inner$")
    return (f"DO $guard$ BEGIN IF to_regclass('public.{table}') IS NOT NULL THEN "
            f"EXECUTE $stmt${body}$stmt$; END IF; END $guard$")


def _revoke(table: str, roles: str) -> None:
    op.execute(_guarded(table, f"REVOKE ALL ON {table} FROM {roles}"))
    op.execute(_guarded(table, serial_grant(table, f"REVOKE ALL ON SEQUENCE %s FROM {roles}")))


def _grant() -> None:
    roles = ", ".join(ROLES)
    op.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    op.execute(f"GRANT USAGE ON SCHEMA public TO {roles}")
    tables = sorted({t for g in GRANTS.values() for t in g})
    for table in tables:  # idempotent: start every table from nothing for these roles
        _revoke(table, roles)
    for table, sql in grant_statements():
        op.execute(_guarded(table, sql))


TRIGGERS = """
CREATE FUNCTION ledger_checkpoint_not_ahead() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE sequenced bigint;
BEGIN
  SELECT size INTO sequenced FROM log_state WHERE id = 1;
  IF NEW.tree_size > sequenced THEN
    RAISE EXCEPTION 'inference-ledger: checkpoint of size % is ahead of the % sequenced '
      'entries', NEW.tree_size, sequenced USING ERRCODE = 'check_violation';
  END IF;
  RETURN NEW;
END $$;

CREATE FUNCTION ledger_checkpoint_matches_tree() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE t record;
BEGIN
  SELECT size, root_hash INTO t FROM log_tree WHERE id = 1;
  IF NEW.tree_size IS DISTINCT FROM t.size OR NEW.root_hash IS DISTINCT FROM t.root_hash THEN
    RAISE EXCEPTION 'inference-ledger: a checkpoint may only be inserted for the tree just '
      'integrated (size %, not %)', t.size, NEW.tree_size USING ERRCODE = 'check_violation';
  END IF;
  RETURN NULL;
END $$;

CREATE FUNCTION ledger_tree_only_grows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE sequenced bigint;
BEGIN
  SELECT size INTO sequenced FROM log_state WHERE id = 1;
  IF NEW.size < OLD.size OR NEW.size > sequenced THEN
    RAISE EXCEPTION 'inference-ledger: log_tree size % is not between % and the % '
      'sequenced entries', NEW.size, OLD.size, sequenced USING ERRCODE = 'check_violation';
  END IF;
  RETURN NEW;
END $$;

CREATE FUNCTION ledger_api_key_revocation_is_final() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.revoked_at IS NOT NULL AND NEW.revoked_at IS DISTINCT FROM OLD.revoked_at THEN
    RAISE EXCEPTION 'inference-ledger: a revoked API key stays revoked'
      USING ERRCODE = 'insufficient_privilege';
  END IF;
  RETURN NEW;
END $$;

CREATE FUNCTION ledger_key_revocation_is_final() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.status = 'revoked' AND (NEW.status <> 'revoked'
       OR NEW.revoked_at IS DISTINCT FROM OLD.revoked_at) THEN
    RAISE EXCEPTION 'inference-ledger: a revoked signing key stays revoked'
      USING ERRCODE = 'insufficient_privilege';
  END IF;
  RETURN NEW;
END $$;

CREATE FUNCTION ledger_resolution_is_final() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.resolution IS NOT NULL AND (
       NEW.resolution IS DISTINCT FROM OLD.resolution
       OR NEW.resolution_note IS DISTINCT FROM OLD.resolution_note
       OR NEW.resolved_by IS DISTINCT FROM OLD.resolved_by
       OR NEW.resolved_at IS DISTINCT FROM OLD.resolved_at
       OR NEW.state IS DISTINCT FROM OLD.state) THEN
    RAISE EXCEPTION 'inference-ledger: dispute % is resolved; its resolution is final', OLD.id
      USING ERRCODE = 'insufficient_privilege';
  END IF;
  RETURN NEW;
END $$;

CREATE TRIGGER checkpoints_not_ahead BEFORE INSERT ON checkpoints
  FOR EACH ROW EXECUTE FUNCTION ledger_checkpoint_not_ahead();
CREATE CONSTRAINT TRIGGER checkpoints_match_tree AFTER INSERT ON checkpoints
  DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW EXECUTE FUNCTION ledger_checkpoint_matches_tree();
CREATE TRIGGER log_tree_only_grows BEFORE UPDATE ON log_tree
  FOR EACH ROW EXECUTE FUNCTION ledger_tree_only_grows();
CREATE TRIGGER api_keys_revocation_final BEFORE UPDATE ON api_keys
  FOR EACH ROW EXECUTE FUNCTION ledger_api_key_revocation_is_final();
CREATE TRIGGER signing_keys_revocation_final BEFORE UPDATE ON signing_keys
  FOR EACH ROW EXECUTE FUNCTION ledger_key_revocation_is_final();
CREATE TRIGGER disputes_resolution_final BEFORE UPDATE ON disputes
  FOR EACH ROW EXECUTE FUNCTION ledger_resolution_is_final();
"""

DROP_TRIGGERS = """
DROP TRIGGER IF EXISTS disputes_resolution_final ON disputes;
DROP TRIGGER IF EXISTS signing_keys_revocation_final ON signing_keys;
DROP TRIGGER IF EXISTS api_keys_revocation_final ON api_keys;
DROP TRIGGER IF EXISTS log_tree_only_grows ON log_tree;
DROP TRIGGER IF EXISTS checkpoints_match_tree ON checkpoints;
DROP TRIGGER IF EXISTS checkpoints_not_ahead ON checkpoints;
DROP FUNCTION IF EXISTS ledger_resolution_is_final();
DROP FUNCTION IF EXISTS ledger_key_revocation_is_final();
DROP FUNCTION IF EXISTS ledger_api_key_revocation_is_final();
DROP FUNCTION IF EXISTS ledger_tree_only_grows();
DROP FUNCTION IF EXISTS ledger_checkpoint_matches_tree();
DROP FUNCTION IF EXISTS ledger_checkpoint_not_ahead();
"""


def upgrade() -> None:
    _create_roles()
    _grant()
    op.execute(TRIGGERS)


def downgrade() -> None:
    op.execute(DROP_TRIGGERS)
    roles = ", ".join(ROLES)
    for table in sorted({t for g in GRANTS.values() for t in g}):
        _revoke(table, roles)
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {roles}")
    # The roles themselves are cluster-wide and may serve other databases: kept.
