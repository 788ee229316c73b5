"""Shared fixtures: real PostgreSQL databases built by the Alembic migrations, real API
servers over real HTTP. Nothing here mocks our own storage.

``LEDGER_TEST_PG`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``) names a
server where the tests may create and drop databases.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine

from ledger.core.keys import generate_private_key, private_pem, public_raw
from ledger.db.session import make_engine, session_scope, upgrade
from ledger.services.apikeys import ROLES, create_api_key
from ledger.services.keys import register_key
from tests.helpers import TEST_PEPPER, ApiServer, free_port, run_server, shared_broker_url

ADMIN_PG = os.environ.get("LEDGER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _sa_url(dbname: str) -> str:
    from sqlalchemy.engine import make_url

    # make_url keeps a socket directory (``?host=/dir``, scripts/vllm_e2e.py) as it is
    return make_url(ADMIN_PG).set(drivername="postgresql+psycopg", database=dbname) \
        .render_as_string(hide_password=False)


def _admin(sql: str) -> None:
    with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
        conn.execute(sql)


def _drop(dbname: str) -> None:
    _admin(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    name = f"ledger_tmpl_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}"')
    try:
        upgrade(_sa_url(name))
        yield name
    finally:
        _drop(name)


def _fresh(template: str) -> Iterator[str]:
    name = f"ledger_t_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        yield _sa_url(name)
    finally:
        _drop(name)


@pytest.fixture
def db_url(template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    yield from _fresh(template_db)


@pytest.fixture(scope="module")
def module_db_url(template_db: str) -> Iterator[str]:
    """A fresh, migrated database shared by one test module."""
    yield from _fresh(template_db)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(url=db_url, pool_size=2)
    yield eng
    eng.dispose()


def provision(db_url: str, signer: Any = None) -> tuple[dict[str, str], Ed25519PrivateKey]:
    """API keys for every role and a registered producer key (with ``signer``, the
    service key, each a registry leaf, as the API's admin paths make them)."""
    eng = make_engine(url=db_url, pool_size=1)
    keys: dict[str, str] = {}
    producer = Ed25519PrivateKey.generate()
    with session_scope(eng) as session:
        for role in ROLES:
            _, secret = create_api_key(session, name=f"test-{role}", role=role,
                                       pepper=TEST_PEPPER, signer=signer)
            keys[role] = secret
        register_key(session, public_key=public_raw(producer), purpose="producer",
                     name="test-gateway", signer=signer)
    eng.dispose()
    return keys, producer


@pytest.fixture(scope="module")
def api(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A real `ledger serve` process on a module database, with keys for every role."""
    keys, producer = provision(module_db_url)
    logs = tmp_path_factory.mktemp("logs")
    metrics_port = free_port()
    env = {"LEDGER_BROKER_URL": shared_broker_url(),
           "LEDGER_METRICS_PORT": str(metrics_port)}
    for name in ("log", "service"):
        path = logs / f"{name}.pem"
        path.write_bytes(private_pem(generate_private_key()))
        env[f"LEDGER_{name.upper()}_KEY_FILE"] = str(path)
    with run_server(module_db_url, log_dir=logs, extra_env=env) as server:
        server.keys = keys
        server.producer = producer  # type: ignore[attr-defined]
        server.db_url = module_db_url  # type: ignore[attr-defined]
        server.service_key_file = logs / "service.pem"  # type: ignore[attr-defined]
        server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # type: ignore[attr-defined]
        yield server
    # jobs published for fingerprints nobody consumes here: leave the broker as found
    import contextlib

    import redis

    with contextlib.suppress(redis.ConnectionError):  # no Redis (scripts/vllm_e2e.py)
        redis.Redis.from_url(env["LEDGER_BROKER_URL"], socket_connect_timeout=2).flushdb()


@pytest.fixture(scope="session")
def tiny_engine() -> Any:
    """The reference engine on tiny-demo (fp32, batch invariant, one CPU thread)."""
    from workers.engine import load_engine

    return load_engine("tiny-demo")
