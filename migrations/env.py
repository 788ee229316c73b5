"""Alembic environment. Migrations take short lock and statement timeouts so a migration
never queues behind long transactions holding the ledger hostage (warehouse's habit)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

from ledger.db.models import Base
from ledger.settings import get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("database_url") or get_settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    connection.execute(text("SET lock_timeout = '10s'"))
    connection.execute(text("SET statement_timeout = '300s'"))
    context.configure(connection=connection, target_metadata=target_metadata,
                      transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()
    if connection.in_transaction():
        connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
