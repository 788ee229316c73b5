"""The schema comes only from Alembic; the ORM declarations must describe it exactly, and
the migrations must go down and up again."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

from ledger.db.models import Base
from ledger.db.session import alembic_config, upgrade


def test_models_match_migrations(db_url: str) -> None:
    engine = create_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True,
                                                     "compare_server_default": False})
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    assert diff == [], "\n".join(map(str, diff))


def test_downgrade_to_base_and_upgrade_again(db_url: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(db_url), "base")
    upgrade(db_url)
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() is not None
    engine.dispose()
