"""Least privilege over real connections: each component's login may do exactly its part
(migration 0008, ledger/db/grants.py), checkpoints only for the tree just integrated, and
`ledger serve`/`beat`/`worker` refuse to start with more than their part."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import errors, sql

from ledger.core.keys import generate_private_key, private_pem, public_raw
from ledger.db.grants import GRANTS
from ledger.db.session import make_engine, session_scope
from ledger.log.integrator import integrate_once
from ledger.log.signer import LogSigner
from ledger.replay import disputes
from ledger.replay.records import Signer
from ledger.services import ingest
from ledger.services.keys import register_key
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import (
    REPO,
    free_port,
    login_url,
    run_ledger,
    shared_broker_url,
    signed,
    statement,
)

ORIGIN = "ledger.test/roles"

# role x (table, operation) -> allowed. Written out by hand (not derived from the grant map)
# so a wrong map fails here; the sweep below then checks the database matches the map.
EXPECTED: list[tuple[str, str, str, bool]] = [
    # the API: admin paths change keys, but never an API key's role or a key's bytes
    ("api", "api_keys", "UPDATE (revoked_at)", True),
    # the admin path changes a role, with a registry leaf (a row changed without one is
    # reported by the registry audit: tests/log/test_registry.py)
    ("api", "api_keys", "UPDATE (role)", True),
    ("api", "api_keys", "UPDATE (key_hash)", False),
    ("api", "api_keys", "DELETE", False),
    ("api", "signing_keys", "INSERT", True),
    ("api", "signing_keys", "UPDATE (public_key)", False),
    ("api", "signing_keys", "UPDATE (purpose)", False),
    ("api", "signing_keys", "DELETE", False),
    ("api", "envelopes", "INSERT", True),
    ("api", "envelopes", "UPDATE (request_id)", False),
    ("api", "log_entries", "DELETE", False),
    ("api", "checkpoints", "INSERT", True),
    ("api", "checkpoints", "UPDATE (note)", False),
    ("api", "checkpoints", "DELETE", False),
    ("api", "checkpoints", "TRUNCATE", False),
    ("api", "disputes", "UPDATE (resolution)", True),
    ("api", "disputes", "UPDATE (request_id)", False),
    ("api", "disputes", "DELETE", False),
    ("api", "verdicts", "INSERT", False),
    ("api", "workers", "INSERT", False),
    # beat + integrator: jobs and checkpoints, no keys, no resolutions
    ("beat", "signing_keys", "INSERT", False),
    ("beat", "signing_keys", "UPDATE (status)", False),
    ("beat", "api_keys", "SELECT", False),
    ("beat", "audit_events", "INSERT", False),
    ("beat", "envelopes", "INSERT", False),
    ("beat", "disputes", "UPDATE (state)", True),
    ("beat", "disputes", "UPDATE (resolution)", False),
    ("beat", "checkpoints", "INSERT", True),
    ("beat", "checkpoints", "DELETE", False),
    ("beat", "log_tree", "UPDATE (size)", True),
    ("beat", "reverification_runs", "INSERT", True),
    ("beat", "reverification_policies", "INSERT", False),
    ("beat", "verdicts", "INSERT", False),
    # workers: verdicts and attempts for jobs, envelopes read-only, nothing of the tree
    ("worker", "verdicts", "INSERT", True),
    ("worker", "job_attempts", "INSERT", True),
    ("worker", "dispute_events", "INSERT", True),
    ("worker", "log_entries", "INSERT", True),
    ("worker", "log_state", "UPDATE (size)", True),
    ("worker", "workers", "UPDATE (last_heartbeat)", True),
    ("worker", "disputes", "UPDATE (verdict_id)", True),
    ("worker", "disputes", "UPDATE (resolution)", False),
    ("worker", "envelopes", "SELECT", True),
    ("worker", "envelopes", "INSERT", False),
    ("worker", "checkpoints", "INSERT", False),
    ("worker", "tiles", "UPDATE (data)", False),
    ("worker", "log_tree", "UPDATE (size)", False),
    ("worker", "signing_keys", "INSERT", False),
    ("worker", "api_keys", "SELECT", False),
    ("worker", "replay_jobs", "INSERT", False),
    ("worker", "audit_events", "SELECT", False),
    # erasure (0015): only the API's admin path and beat's retention destroy data keys
    # (a trigger lets them only with an erasure record); workers and auditors only read
    ("api", "data_keys", "DELETE", True),
    ("api", "erasures", "INSERT", True),
    ("api", "erasures", "UPDATE (body)", False),
    ("api", "erased_keys", "DELETE", False),
    ("beat", "data_keys", "DELETE", True),
    ("beat", "data_keys", "INSERT", False),
    ("worker", "data_keys", "SELECT", True),
    ("worker", "data_keys", "DELETE", False),
    ("worker", "erasures", "INSERT", False),
    ("auditor", "data_keys", "DELETE", False),
    ("auditor", "erasures", "SELECT", True),
    # auditors read, and only read
    ("auditor", "envelopes", "SELECT", True),
    ("auditor", "checkpoints", "SELECT", True),
    ("auditor", "audit_events", "SELECT", True),
    ("auditor", "api_keys", "SELECT", True),   # the audit checks rows against leaves
    ("auditor", "api_keys", "UPDATE (role)", False),
    ("auditor", "envelopes", "INSERT", False),
    ("auditor", "checkpoints", "INSERT", False),
    ("auditor", "log_state", "UPDATE (size)", False),
    ("auditor", "disputes", "UPDATE (state)", False),
]


def _driver(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _statement(conn: psycopg.Connection, table: str, op: str) -> sql.Composed:
    """A statement that needs exactly ``op`` on ``table`` and changes no row."""
    t = sql.Identifier(table)
    if op.startswith("UPDATE"):
        col = sql.Identifier(op.split("(")[1].rstrip(")").strip())
        return sql.SQL("UPDATE {} SET {} = {} WHERE false").format(t, col, col)
    if op == "INSERT":
        first = conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
                             "AND attnum = 1", (table,)).fetchone()
        assert first is not None
        c = sql.Identifier(first[0])
        return sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} WHERE false").format(t, c, c, t)
    return {"SELECT": sql.SQL("SELECT 1 FROM {} LIMIT 0"),
            "DELETE": sql.SQL("DELETE FROM {} WHERE false"),
            "TRUNCATE": sql.SQL("TRUNCATE {}")}[op].format(t)


def _allowed(conn: psycopg.Connection, table: str, op: str) -> bool:
    """Run the statement in a savepoint: True if it ran, False on InsufficientPrivilege."""
    stmt = _statement(conn, table, op)
    try:
        with conn.transaction():
            conn.execute(stmt)
            raise _Rollback
    except _Rollback:
        return True
    except errors.InsufficientPrivilege:
        return False


class _Rollback(Exception):
    pass


@pytest.fixture
def logins(db_url: str) -> dict[str, str]:
    return {c: login_url(db_url, c) for c in ("api", "beat", "worker", "auditor")}


@pytest.mark.parametrize("role,table,op,allowed", EXPECTED,
                         ids=[f"{r}-{t}-{o}" for r, t, o, _ in EXPECTED])
def test_role_table_operation(logins: dict[str, str], role: str, table: str, op: str,
                              allowed: bool) -> None:
    with psycopg.connect(_driver(logins[role])) as conn:
        assert conn.execute("SELECT session_user").fetchone()[0].startswith("ledger_test_")
        assert _allowed(conn, table, op) is allowed, (role, table, op)


def _map_allows(role: str, table: str, op: str) -> bool:
    privileges = GRANTS[role].get(table, ())
    if op.startswith("UPDATE"):
        col = op.split("(")[1].rstrip(")").strip()
        return any(p == "UPDATE" or (p.startswith("UPDATE (") and col in
                                      [c.strip() for c in p[8:-1].split(",")])
                   for p in privileges)
    return op in privileges


@pytest.mark.parametrize("role", ["api", "beat", "worker", "auditor"])
def test_database_grants_match_the_map_both_ways(db_url: str, logins: dict[str, str],
                                                 role: str) -> None:
    """Every table and column of the schema, every operation: what the map grants runs,
    everything else is refused (so no privilege leaks in from PUBLIC or ledger_app)."""
    with psycopg.connect(_driver(db_url)) as owner:
        columns = owner.execute(
            "SELECT c.relname, a.attname FROM pg_class c JOIN pg_namespace n ON "
            "n.oid = c.relnamespace JOIN pg_attribute a ON a.attrelid = c.oid "
            "WHERE n.nspname = 'public' AND c.relkind = 'r' AND a.attnum > 0 "
            "AND NOT a.attisdropped ORDER BY 1, a.attnum").fetchall()
    tables: dict[str, list[str]] = {}
    for table, col in columns:
        tables.setdefault(table, []).append(col)
    group = {"api": "ledger_api", "beat": "ledger_beat", "worker": "ledger_worker",
             "auditor": "ledger_auditor"}[role]
    wrong = []
    with psycopg.connect(_driver(logins[role])) as conn:
        for table, cols in tables.items():
            ops = ["SELECT", "INSERT", "DELETE", "TRUNCATE"] + [f"UPDATE ({c})" for c in cols]
            for op in ops:
                if _allowed(conn, table, op) != _map_allows(group, table, op):
                    wrong.append((table, op, not _map_allows(group, table, op)))
    assert not wrong, f"{role}: (table, operation, allowed in the database) {wrong}"


@pytest.mark.parametrize("role,sequence,allowed", [
    ("worker", "job_attempts_id_seq", True), ("api", "audit_events_id_seq", True),
    ("beat", "audit_events_id_seq", False), ("worker", "audit_events_id_seq", False),
    ("auditor", "job_attempts_id_seq", False)])
def test_sequences_only_where_the_role_inserts(logins: dict[str, str], role: str,
                                               sequence: str, allowed: bool) -> None:
    with psycopg.connect(_driver(logins[role])) as conn:
        try:
            conn.execute("SELECT nextval(%s)", (sequence,))
            ran = True
        except errors.InsufficientPrivilege:
            ran = False
        conn.rollback()
    assert ran is allowed


# --- checkpoints: only for the tree the integrator just built ---------------------------

def _sequenced(db_url: str, n: int) -> None:
    """``n`` envelopes ingested (as the owner) by a newly registered producer."""
    key = generate_private_key()
    eng = make_engine(url=db_url, pool_size=1)
    with session_scope(eng) as s:
        register_key(s, public_key=public_raw(key), purpose="producer",
                     name=f"gw-{uuid.uuid4().hex[:6]}")
    with session_scope(eng) as s:
        res = ingest.ingest(s, [signed(statement(), key) for _ in range(n)],
                            Settings(database_url=db_url))
        assert all(r.status == 201 for r in res)
    eng.dispose()


def test_future_size_checkpoint_is_refused_and_integration_goes_on(
        db_url: str, logins: dict[str, str]) -> None:
    _sequenced(db_url, 3)
    note = b"forged\n"
    with psycopg.connect(_driver(logins["beat"])) as conn:
        with pytest.raises(errors.CheckViolation, match="ahead of the 3 sequenced"):
            conn.execute("INSERT INTO checkpoints (tree_size, root_hash, note) "
                         "VALUES (1000, %s, %s)", (b"\0" * 32, note))
        conn.rollback()
        # within the sequenced entries but not the integrated tree: refused at commit
        conn.execute("INSERT INTO checkpoints (tree_size, root_hash, note) VALUES (2, %s, %s)",
                     (b"\0" * 32, note))
        with pytest.raises(errors.CheckViolation, match="tree just integrated"):
            conn.commit()
        with pytest.raises(errors.CheckViolation, match="not between"):
            conn.execute("UPDATE log_tree SET size = 1000")
        conn.rollback()
    # the owner (superuser) is held to the same rule: triggers, not grants
    with psycopg.connect(_driver(db_url)) as conn, pytest.raises(errors.CheckViolation):
        conn.execute("INSERT INTO checkpoints (tree_size, root_hash, note) "
                     "VALUES (3, %s, %s)", (b"\0" * 32, note))
        conn.commit()
    # the integrator, as the beat's login, still publishes every later checkpoint
    signer = LogSigner(ORIGIN, generate_private_key())
    eng = make_engine(url=logins["beat"], pool_size=1)
    first = integrate_once(eng, signer)
    assert first is not None and first.tree_size == 3
    eng.dispose()
    _sequenced(db_url, 2)
    eng = make_engine(url=logins["beat"], pool_size=1)
    second = integrate_once(eng, signer)
    eng.dispose()
    assert second is not None and second.tree_size == 5


def test_revocation_and_resolution_are_final_for_the_api(db_url: str,
                                                         logins: dict[str, str]) -> None:
    provision(db_url)
    _sequenced(db_url, 1)
    with psycopg.connect(_driver(db_url)) as conn:
        request_id = conn.execute("SELECT request_id FROM envelopes").fetchone()[0]
    service = Signer(generate_private_key(), "ledger", "ledger-service")
    api = make_engine(url=logins["api"], pool_size=1)
    with session_scope(api) as s:
        service.ensure_registered(s)  # the API may register its own key
        dispute, _ = disputes.open_dispute(s, request_id=request_id, reason="r",
                                           priority="normal", actor="t", signer=service)
        did = dispute.id
    api.dispose()
    with psycopg.connect(_driver(logins["api"])) as conn:
        conn.execute("UPDATE api_keys SET revoked_at = now() WHERE name = 'test-admin'")
        conn.commit()
        with pytest.raises(errors.InsufficientPrivilege, match="stays revoked"):
            conn.execute("UPDATE api_keys SET revoked_at = NULL WHERE name = 'test-admin'")
        conn.rollback()
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("UPDATE api_keys SET key_hash = '\\x00' WHERE name = 'test-reviewer'")
        conn.rollback()
        conn.execute("UPDATE disputes SET resolution = 'upheld', state = 'resolved' "
                     "WHERE id = %s", (did,))
        conn.commit()
        with pytest.raises(errors.InsufficientPrivilege, match="resolution is final"):
            conn.execute("UPDATE disputes SET resolution = 'rejected' WHERE id = %s", (did,))
        conn.rollback()


# --- start-up refusals -----------------------------------------------------------------

def _ledger(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**clean, "COLUMNS": "200", **env})


def _refused(proc: subprocess.CompletedProcess[str], setting: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if "refusing to start" in ln]
    assert proc.returncode == 2, proc.stderr[-2000:]
    # one line per problem (`ledger check`); the one this test causes names its setting
    assert any(setting in ln for ln in lines), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "log.pem"
    path.write_bytes(private_pem(generate_private_key()))
    return path


def test_serve_refuses_a_superuser(db_url: str) -> None:
    proc = _ledger("serve", "--port", str(free_port()),
                   env={"LEDGER_DATABASE_URL": db_url, "LEDGER_API_KEY_PEPPER": "p",
                        "LEDGER_INTEGRATE_IN_API": "false"})
    _refused(proc, "LEDGER_DATABASE_URL")
    assert "superuser" in proc.stderr


def test_serve_refuses_the_schema_owner(db_url: str) -> None:
    owner = f"ledger_test_owner_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(_driver(db_url), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(owner)))
        conn.execute(sql.SQL("ALTER TABLE alembic_version OWNER TO {}").format(
            sql.Identifier(owner)))
    try:
        url = db_url.replace("postgres@", f"{owner}@")
        proc = _ledger("serve", "--port", str(free_port()),
                       env={"LEDGER_DATABASE_URL": url, "LEDGER_API_KEY_PEPPER": "p",
                            "LEDGER_INTEGRATE_IN_API": "false"})
        _refused(proc, "LEDGER_DATABASE_URL")
        assert "schema owner" in proc.stderr
    finally:
        with psycopg.connect(_driver(db_url), autocommit=True) as conn:
            conn.execute("ALTER TABLE alembic_version OWNER TO postgres")
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(owner)))


def test_serve_refuses_without_pepper_or_log_key(logins: dict[str, str],
                                                 key_file: Path) -> None:
    no_pepper = _ledger("serve", "--port", str(free_port()),
                        env={"LEDGER_DATABASE_URL": logins["api"],
                             "LEDGER_LOG_KEY_FILE": str(key_file)})
    _refused(no_pepper, "LEDGER_API_KEY_PEPPER")
    no_key = _ledger("serve", "--port", str(free_port()),
                     env={"LEDGER_DATABASE_URL": logins["api"], "LEDGER_API_KEY_PEPPER": "p"})
    _refused(no_key, "LEDGER_LOG_KEY_FILE")


def test_beat_and_worker_refuse_without_their_keys(db_url: str,
                                                   logins: dict[str, str]) -> None:
    beat = _ledger("beat", env={"LEDGER_DATABASE_URL": logins["beat"]})
    _refused(beat, "LEDGER_LOG_KEY_FILE")
    worker = _ledger("worker", "--models", "tiny-demo",
                     env={"LEDGER_DATABASE_URL": logins["worker"]})
    _refused(worker, "LEDGER_WORKER_KEY_FILE")
    as_super = _ledger("worker", "--models", "tiny-demo", "--key", "/nonexistent.pem",
                       env={"LEDGER_DATABASE_URL": db_url})
    _refused(as_super, "LEDGER_DATABASE_URL")
    wrong_group = _ledger("beat", env={"LEDGER_DATABASE_URL": logins["worker"],
                                       "LEDGER_LOG_KEY_FILE": "/nonexistent.pem"})
    _refused(wrong_group, "ledger_beat")


def test_beat_may_not_register_its_own_log_key(logins: dict[str, str], key_file: Path) -> None:
    """Only the API's admin paths change signing_keys: an unregistered log key stops the
    beat with the command that registers it, instead of signing checkpoints nobody can
    verify."""
    proc = _ledger("beat", env={"LEDGER_DATABASE_URL": logins["beat"],
                                "LEDGER_LOG_KEY_FILE": str(key_file),
                                "LEDGER_BROKER_URL": shared_broker_url()})
    _refused(proc, "LEDGER_LOG_KEY_FILE")
    assert "ledger keys register" in proc.stderr and "--purpose log" in proc.stderr


def test_test_servers_run_as_their_component_login(db_url: str, tmp_path: Path) -> None:
    """What main measured: `ledger serve` sessions showed up as the superuser. Here its
    sessions in pg_stat_activity belong to the API login, which is no superuser."""
    from tests.helpers import TEST_LOGINS, run_server

    with run_server(db_url, log_dir=tmp_path) as server:
        import httpx

        assert httpx.get(server.base_url + "/readyz", timeout=10).status_code == 200
        with psycopg.connect(_driver(db_url)) as conn:
            rows = conn.execute(
                "SELECT a.usename, r.rolsuper FROM pg_stat_activity a JOIN pg_roles r ON "
                "r.oid = a.usesysid WHERE a.datname = current_database() "
                "AND a.pid <> pg_backend_pid()").fetchall()
    assert rows and {tuple(r) for r in rows} == {(TEST_LOGINS["api"], False)}, rows


def test_insecure_dev_starts_as_superuser_and_says_so(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with run_ledger(["serve", "--port", str(port), "--insecure-dev"], port=port,
                    health_path="/healthz", log_path=log,
                    env={"LEDGER_DATABASE_URL": db_url}) as (_, proc):
        assert proc.poll() is None
    text = log.read_text()
    warnings = [ln for ln in text.splitlines() if ln.startswith("WARNING: insecure dev mode")]
    assert len(warnings) == 1 and "superuser" in warnings[0], text[-2000:]
    assert "LEDGER_API_KEY_PEPPER" in warnings[0]  # what it let through


def test_create_login_makes_a_member_of_one_component_role(db_url: str, tmp_path: Path) -> None:
    name = f"ledger_test_login_{uuid.uuid4().hex[:6]}"
    try:
        made = _ledger("db", "create-login", "--component", "auditor", "--name", name,
                       env={"LEDGER_DATABASE_URL": db_url})
        assert made.returncode == 0, made.stderr
        url = made.stdout.strip().splitlines()[-1]
        assert url.startswith(f"postgresql+psycopg://{name}:") and url.endswith(
            db_url.rsplit("/", 1)[1])
        again = _ledger("db", "create-login", "--component", "auditor", "--name", name,
                        "--no-password", env={"LEDGER_DATABASE_URL": db_url})
        assert again.returncode == 0, again.stderr
        with psycopg.connect(_driver(again.stdout.strip().splitlines()[-1])) as conn:
            assert conn.execute("SELECT session_user").fetchone()[0] == name
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute("INSERT INTO envelopes (request_id) SELECT 'x' WHERE false")
        pw = tmp_path / "pw"
        pw.write_text("s3cret-from-a-file\n")
        from_file = _ledger("db", "create-login", "--component", "auditor", "--name", name,
                            "--password-file", str(pw), env={"LEDGER_DATABASE_URL": db_url})
        assert from_file.returncode == 0, from_file.stderr
        assert "s3cret" not in from_file.stdout + from_file.stderr  # never echoed to logs
        other = _ledger("db", "create-login", "--component", "api", "--name", name,
                        env={"LEDGER_DATABASE_URL": db_url})
        assert other.returncode == 2 and "another component role" in other.stderr
    finally:
        with psycopg.connect(_driver(db_url), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def test_password_file_replaces_the_url_password(tmp_path: Path) -> None:
    from ledger.db.session import database_url

    pw = tmp_path / "pw"
    pw.write_text("p@ss:word\n")
    settings = Settings(database_url="postgresql+psycopg://ledger_api_login:old@db:5432/ledger",
                        database_password_file=pw)
    url = database_url(settings)
    assert url == "postgresql+psycopg://ledger_api_login:p%40ss%3Aword@db:5432/ledger"
    assert database_url(Settings(database_url="postgresql+psycopg://u@db/x")) == \
        "postgresql+psycopg://u@db/x"
