"""Append-only twice over: the app role lacks UPDATE/DELETE/TRUNCATE, and triggers reject
them for everyone else (here the superuser who owns the tables)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from sqlalchemy import text

from ledger.db.session import make_engine
from ledger.settings import Settings
from tests.conftest import ADMIN_PG, provision
from tests.helpers import signed, statement

APPEND_ONLY = ("log_entries", "envelopes", "audit_events")


def _seed(db_url: str) -> None:
    from ledger.db.session import session_scope
    from ledger.services import audit, ingest
    from ledger.services.apikeys import Principal

    _, producer = provision(db_url)
    eng = make_engine(url=db_url, pool_size=1)
    with session_scope(eng) as s:
        res = ingest.ingest(s, [signed(statement(), producer)], Settings(database_url=db_url))
        assert res[0].status == 201
        audit.record(s, Principal("x", "tester", "admin"), "test.seed")
    eng.dispose()


@pytest.fixture
def app_login(db_url: str):
    """A login role that is a member of ledger_app, as docs/deployment.md prescribes."""
    name = f"ledger_api_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN IN ROLE ledger_app")
    yield db_url.replace("postgres@", f"{name}@")
    with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
        conn.execute(f"DROP ROLE {name}")


@pytest.mark.parametrize("table", APPEND_ONLY)
def test_app_role_has_no_update_delete_truncate(db_url: str, app_login: str, table: str) -> None:
    _seed(db_url)
    eng = make_engine(Settings(database_url=app_login, database_role="ledger_app"), pool_size=1)
    with eng.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() >= 1
    column = {"log_entries": "kind", "envelopes": "request_id", "audit_events": "actor"}[table]
    for stmt in (f"UPDATE {table} SET {column} = 'x'",
                 f"DELETE FROM {table}", f"TRUNCATE {table} CASCADE"):
        with eng.connect() as conn, pytest.raises(Exception) as info:
            conn.execute(text(stmt))
        assert "permission denied" in str(info.value), stmt
    eng.dispose()


@pytest.mark.parametrize("table", APPEND_ONLY)
def test_triggers_reject_update_delete_truncate_for_the_owner(db_url: str, table: str) -> None:
    _seed(db_url)
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    column = {"log_entries": "kind", "envelopes": "request_id", "audit_events": "actor"}[table]
    for stmt in (f"UPDATE {table} SET {column} = 'tampered'", f"DELETE FROM {table}",
                 f"TRUNCATE {table} CASCADE"):
        with psycopg.connect(url) as conn, pytest.raises(psycopg.Error) as info:
            conn.execute(stmt)
        assert "append-only" in str(info.value), (stmt, info.value)
    with psycopg.connect(url) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] >= 1


def test_app_role_can_still_ingest(db_url: str, app_login: str) -> None:
    """The grants are enough for the real work: ingest as the restricted login works."""
    from ledger.db.session import session_scope
    from ledger.services import ingest

    _, producer = provision(db_url)
    settings = Settings(database_url=app_login, database_role="ledger_app")
    eng = make_engine(settings, pool_size=1)
    with session_scope(eng) as s:
        res = ingest.ingest(s, [signed(statement(), producer)], settings)
    assert res[0].status == 201
    eng.dispose()
