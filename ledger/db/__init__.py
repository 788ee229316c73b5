"""Postgres storage: SQLAlchemy 2 models, engine/session factory, migrations runner."""
