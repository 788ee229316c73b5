"""Ingest's remembered credentials (ledger.services.credentials) on a real PostgreSQL: a
key is admitted from memory only as a fresh read found it, and the group commit's leader
stores nothing admitted so once its rows changed in any way that matters (the API key
revoked or given another role, a producer key revoked or its validity changed), while
the other requests of the same statement are stored."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from ledger.core import dsse
from ledger.db.session import AutocommitReads, make_engine, raw_cursor, session_scope
from ledger.log.store import SequenceRefused
from ledger.services import apikeys, credentials, ingest
from ledger.services import keys as key_service
from ledger.services.credentials import (
    CredentialCache,
    NotRemembered,
    Remembered,
    StaleCredentials,
    keys_for,
    stale,
)
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import TEST_PEPPER, signed, statement
from tests.test_group_commit import rows, store_while_busy

INGEST = frozenset({"ingester"})


class Setup:
    def __init__(self, db_url: str) -> None:
        self.keys, self.producer = provision(db_url)
        self.settings = Settings(database_url=db_url, api_key_pepper=TEST_PEPPER)
        self.engine: Engine = make_engine(self.settings, pool_size=1)
        self.reads = make_engine(self.settings, pre_ping=False, autocommit=True)
        self.cache = CredentialCache()

    def body(self) -> bytes:
        return json.dumps(signed(statement(), self.producer), separators=(",", ":")).encode()

    def read_fresh(self, key: str, body: bytes) -> None:
        """What the fresh path does: read the API key and the named producer keys, and
        remember them."""
        with AutocommitReads(self.reads) as reads:
            principal, found = apikeys.authenticate_reads_with_keys(
                reads, key, TEST_PEPPER, dsse.keyids_named(body))
        self.cache.remember(key, TEST_PEPPER, principal, found)

    def admit(self, key: str, body: bytes) -> tuple[Remembered, Any] | None:
        return self.cache.admit(key, TEST_PEPPER, INGEST, dsse.keyids_named(body))

    def is_stale(self, remembered: Remembered) -> bool:
        """:func:`stale` and the storing statement's guard (:func:`credentials.check`,
        the same condition in SQL) agree; either's answer."""
        with self.engine.connect() as conn, raw_cursor(conn) as cur:
            [changed] = stale(cur, [remembered])
            try:
                credentials.check(cur, [remembered])
                refused = False
            except SequenceRefused:
                refused = True
        assert refused == changed
        return changed

    def group(self, body: bytes, remembered: Remembered | None, keys: Any) -> ingest.Group:
        prepared, failures = ingest.decode_items([body], self.settings, keys_for(keys))
        assert not failures
        return ingest.Group(prepared, failures, False, remembered=remembered)

    def close(self) -> None:
        self.engine.dispose()
        self.reads.dispose()


@pytest.fixture()
def setup(db_url: str) -> Any:
    s = Setup(db_url)
    yield s
    s.close()


def test_only_what_a_fresh_read_found_is_admitted(setup: Setup) -> None:
    body = setup.body()
    key = setup.keys["ingester"]
    assert setup.admit(key, body) is None                 # nothing remembered yet
    setup.read_fresh(key, body)
    admitted = setup.admit(key, body)
    assert admitted is not None
    remembered, found = admitted
    assert [k.keyid for k in remembered.keys] == dsse.keyids_named(body)
    assert found.keyring(dsse.keyids_named(body), purpose="producer") is not None
    # another key, a role without the permission, a key ID not read, no key ID at all
    assert setup.admit(setup.keys["admin"], body) is None
    assert setup.cache.admit(key, TEST_PEPPER, frozenset({"admin"}),
                             dsse.keyids_named(body)) is None
    assert setup.cache.admit(key, TEST_PEPPER, INGEST, ["0" * 64]) is None
    assert setup.cache.admit(key, TEST_PEPPER, INGEST, []) is None
    # a loader over the remembered rows refuses a key ID they do not hold
    with pytest.raises(NotRemembered):
        keys_for(found)(["0" * 64])


def _change(setup: Setup, what: str) -> None:
    keyid = dsse.keyids_named(setup.body())[0]
    with session_scope(setup.engine) as s:
        if what == "api key revoked":
            [key] = [k for k in apikeys.list_api_keys(s) if k.role == "ingester"]
            apikeys.revoke_api_key(s, str(key.id))
        elif what == "api key role":
            [key] = [k for k in apikeys.list_api_keys(s) if k.role == "ingester"]
            apikeys.change_api_key_role(s, str(key.id), "reviewer")
        elif what == "producer key revoked":
            key_service.revoke_key(s, keyid, "rotated")
        elif what == "api key name":
            s.execute(text("UPDATE api_keys SET name = name || '-renamed' "
                           "WHERE role = 'ingester'"))
        elif what.startswith("producer key"):  # not_after: another time at each call
            until = None if what == "producer key never expires" else \
                datetime.now(UTC) + timedelta(days=1)
            s.execute(text("UPDATE signing_keys SET not_after = :t WHERE keyid = :k"),
                      {"t": until, "k": keyid})


@pytest.mark.parametrize("what,first", [
    ("api key revoked", None), ("api key role", None), ("api key name", None),
    ("producer key revoked", None),
    ("producer key expires", None),                          # not_after NULL -> a time
    ("producer key expires", "producer key expires"),        # a time -> another
    ("producer key never expires", "producer key expires"),  # a time -> NULL
])
def test_a_changed_row_is_stale(setup: Setup, what: str, first: str | None) -> None:
    body = setup.body()
    if first is not None:  # remembered with this change made first: equal, then not
        _change(setup, first)
    setup.read_fresh(setup.keys["ingester"], body)
    admitted = setup.admit(setup.keys["ingester"], body)
    assert admitted is not None
    assert not setup.is_stale(admitted[0])
    _change(setup, what)
    assert setup.is_stale(admitted[0])


def test_the_leader_stores_the_current_and_returns_the_stale(setup: Setup, db_url: str
                                                              ) -> None:
    """Three requests in one statement: the middle one was admitted from memory with an
    API key revoked since; it is not stored (StaleCredentials), the others are, with
    consecutive indices."""
    key = setup.keys["ingester"]
    bodies = [setup.body() for _ in range(3)]
    setup.read_fresh(key, bodies[0])
    admitted = setup.admit(key, bodies[1])
    assert admitted is not None
    groups = []
    for i, body in enumerate(bodies):
        loader = keys_for(admitted[1])
        prepared, failures = ingest.decode_items([body], setup.settings, loader)
        assert not failures
        groups.append(ingest.Group(prepared, failures, False,
                                   remembered=admitted[0] if i == 1 else None))
    _change(setup, "api key revoked")
    gc = ingest.GroupCommit(make_engine(setup.settings, pool_size=1), setup.settings)
    try:
        store_while_busy(gc, groups, expect_errors=True)
    finally:
        gc.close()
    errors = store_while_busy.errors  # type: ignore[attr-defined]
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], StaleCredentials)
    stored = rows(db_url)
    assert [r[1] for r in stored] == [request_id(b) for b in (bodies[0], bodies[2])]
    assert [r[0] for r in stored] == [0, 1]


def test_the_storing_statement_is_the_check(setup: Setup, db_url: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests admitted from memory with current keys are stored by one statement that
    checks them itself: no separate check (stale() is not called)."""
    key = setup.keys["ingester"]
    bodies = [setup.body() for _ in range(3)]
    setup.read_fresh(key, bodies[0])
    admitted = setup.admit(key, bodies[0])
    assert admitted is not None

    def no_separate_check(*_: Any) -> None:
        raise AssertionError("the storing statement checks remembered keys itself")

    monkeypatch.setattr(ingest, "stale", no_separate_check)
    monkeypatch.setattr(credentials, "check", no_separate_check)
    gc = ingest.GroupCommit(make_engine(setup.settings, pool_size=1), setup.settings)
    try:
        store_while_busy(gc, [setup.group(b, admitted[0], admitted[1]) for b in bodies])
    finally:
        gc.close()
    stored = rows(db_url)
    assert [r[1] for r in stored] == [request_id(b) for b in bodies]
    assert len({r[2] for r in stored}) == 1  # one transaction


def test_a_stale_request_is_not_answered_existing(setup: Setup, db_url: str) -> None:
    """A request admitted from memory whose envelope is stored already is answered
    "existing" only if its keys are as remembered: with its API key revoked it is sent
    back (and the fresh path refuses it), even though nothing new would be stored."""
    key = setup.keys["ingester"]
    body = setup.body()
    setup.read_fresh(key, body)
    admitted = setup.admit(key, body)
    assert admitted is not None
    gc = ingest.GroupCommit(make_engine(setup.settings, pool_size=1), setup.settings)
    try:
        first = setup.group(body, admitted[0], admitted[1])
        gc.store(first)
        assert first.report is not None
        assert first.report.results[0].outcome is ingest.ItemOutcome.CREATED
        again = setup.group(body, admitted[0], admitted[1])
        gc.store(again)
        assert again.report is not None
        assert again.report.results[0].outcome is ingest.ItemOutcome.EXISTING
        _change(setup, "api key revoked")
        with pytest.raises(StaleCredentials):
            gc.store(setup.group(body, admitted[0], admitted[1]))
    finally:
        gc.close()
    # classified first (as after a lost race): nothing new, the check runs on its own
    with setup.engine.connect() as conn, raw_cursor(conn) as cur, \
            pytest.raises(SequenceRefused):
        ingest.store_groups(cur, [setup.group(body, admitted[0], admitted[1])])
    assert len(rows(db_url)) == 1


def request_id(body: bytes) -> str:
    return str(json.loads(dsse.envelope_from_json(body).payload)["predicate"]["request_id"])
