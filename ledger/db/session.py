"""Engine and session factories; the migrations runner.

One session per request or task; services only ``flush()``; the boundary (the request
dependency, the task, the CLI command) commits or rolls back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from importlib import resources
from typing import Any, TypeVar

import psycopg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.orm import Session, sessionmaker

from ledger.settings import Settings, get_settings

T = TypeVar("T")


def database_url(settings: Settings, url: str | None = None) -> str:
    """``url`` (default ``LEDGER_DATABASE_URL``) with the password from
    ``LEDGER_DATABASE_PASSWORD_FILE`` when that is set."""
    url = url or settings.database_url
    if settings.database_password_file is None:
        return url
    password = settings.database_password_file.read_text().strip()
    return make_url(url).set(password=password).render_as_string(hide_password=False)


def make_engine(settings: Settings | None = None, *, url: str | None = None,
                pool_size: int | None = None, pre_ping: bool = True,
                autocommit: bool = False, application_name: str | None = None,
                keep_overflow: bool = False) -> Engine:
    """``pre_ping=False`` skips the round trip that tests a pooled connection at each
    checkout: its user must handle a stale connection itself (:class:`AutocommitReads`).
    ``autocommit``: every connection in autocommit, set once when it is opened (no BEGIN,
    and no isolation level reset when it goes back to the pool). ``application_name``
    names the connections in ``pg_stat_activity``. ``keep_overflow``: the overflow
    (``db_pool_size`` connections) is pooled too, with none past it (the same most
    connections), so a pool used by more than ``pool_size`` at once keeps its
    connections instead of opening and closing one (a PostgreSQL backend started and
    ended) per checkout past ``pool_size``."""
    settings = settings or get_settings()
    size = pool_size or settings.db_pool_size
    overflow = settings.db_pool_size
    engine = create_engine(
        database_url(settings, url),
        pool_size=size + overflow if keep_overflow else size,
        max_overflow=0 if keep_overflow else overflow,
        pool_pre_ping=pre_ping,
        pool_timeout=settings.db_pool_timeout_s,
        pool_recycle=1800,
        connect_args={"connect_timeout": 5,
                      **({"application_name": application_name} if application_name else {})},
        **({"isolation_level": "AUTOCOMMIT"} if autocommit else {}),
    )
    role = settings.database_role
    if role:
        @event.listens_for(engine, "connect")
        def _set_role(dbapi_conn: Any, _record: Any) -> None:
            with dbapi_conn.cursor() as cur:
                cur.execute(f'SET ROLE "{role}"')
            dbapi_conn.commit()
    return engine


@lru_cache(maxsize=4)
def _cached_engine(url: str) -> Engine:
    return make_engine(url=url)


def get_engine() -> Engine:
    return _cached_engine(get_settings().database_url)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False, autoflush=False)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """Commit on success, roll back on any exception."""
    session = session_factory(engine)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


class AutocommitReads:
    """Read-only statements on one pooled connection of an autocommit engine made with
    ``pre_ping=False`` (the ingest path: each statement is one round trip, no BEGIN, no
    ROLLBACK, no ping). A statement that fails with ``OperationalError`` (a connection
    the server dropped while it sat in the pool, after a restart) is run once more on a
    fresh connection: these are reads, so running one again is safe. Use it as a context
    manager; the connection goes back to the pool on the way out."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: Connection | None = None

    def fetchall(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        def rows(conn: Connection) -> list[tuple[Any, ...]]:
            with raw_cursor(conn) as cur:
                cur.execute(query, params)
                return cur.fetchall()

        return self.run(rows)

    def run(self, work: Callable[[Connection], T]) -> T:
        """``work(connection)`` on this object's connection, with :meth:`fetchall`'s one
        retry on a fresh connection: ``work`` must only read (it may run twice)."""
        for attempt in range(2):
            if self._conn is None:
                self._conn = self.engine.connect()
            try:
                return work(self._conn)
            except psycopg.OperationalError:
                self._conn.invalidate()
                self.release()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def release(self) -> None:
        """Give the connection back to the pool now (a later statement takes another)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> AutocommitReads:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


# --- migrations ------------------------------------------------------------------------

def raw_connection(db: Session | Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under a session (or SQLAlchemy connection), in its
    transaction. Prefer :func:`raw_cursor`; this is for server-side (named) cursors."""
    conn = db.connection() if isinstance(db, Session) else db
    driver = conn.connection.driver_connection
    assert driver is not None, "the database connection is closed"
    return driver  # type: ignore[no-any-return]


def raw_cursor(db: Session | Connection) -> psycopg.Cursor[Any]:
    """A psycopg cursor inside the session's transaction: for COPY, ``executemany`` and
    the log's hot paths, where the ORM costs too much. Use it as a context manager
    (``with raw_cursor(session) as cur:``)."""
    return raw_connection(db).cursor()


def alembic_config(url: str) -> Config:
    script_location = str(resources.files("ledger.migrations"))
    cfg = Config()
    cfg.set_main_option("script_location", script_location)
    cfg.attributes["database_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ping(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
