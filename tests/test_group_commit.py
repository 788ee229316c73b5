"""The API's storing step (ingest.GroupCommit) on a real PostgreSQL: requests waiting while
another one stores share one sequencing statement (one transaction: one ``xmin``), are
classified against each other in order (repeats, conflicts, atomic rejections), and a
request_id stored before goes through the unique constraint and comes back "existing"
with its old index, leaving no gap."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine

from ledger.db.session import make_engine, session_scope
from ledger.services import ingest
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import signed, statement

Outcome = ingest.ItemOutcome


def group(engine: Engine, settings: Settings, envelopes: list[Any],
          atomic: bool = False) -> ingest.Group:
    with session_scope(engine) as s:
        prepared, failures = ingest.decode_items(envelopes, settings, s)
    return ingest.Group(prepared, failures, atomic)


def rows(db_url: str) -> list[tuple[int, str, int]]:
    """(log_index, request_id, xmin) of every envelope, and the log's size checked."""
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        out = conn.execute("SELECT log_index, request_id, xmin::text::bigint FROM envelopes "
                           "ORDER BY log_index").fetchall()
        size = conn.execute("SELECT size FROM log_state").fetchone()
        entries = conn.execute("SELECT count(*) FROM log_entries").fetchone()
    assert size is not None and entries is not None and size[0] == entries[0] == len(out)
    return [(int(a), str(b), int(c)) for a, b, c in out]


def store_while_busy(gc: ingest.GroupCommit, groups: list[ingest.Group], *,
                     expect_errors: bool = False) -> None:
    """Queue ``groups`` behind a leader that is busy, then let them go: the oldest leads
    and stores all of them in one statement. With ``expect_errors`` what each ``store``
    raised (or None) is kept in ``store_while_busy.errors``, in the groups' order."""
    errors: list[BaseException | None] = [None] * len(groups)

    def store(i: int, g: ingest.Group) -> None:
        try:
            gc.store(g)
        except Exception as exc:  # kept for the test to look at
            if not expect_errors:
                raise
            errors[i] = exc

    store_while_busy.errors = errors  # type: ignore[attr-defined]
    with gc._lock:
        gc._busy = True
    threads = [threading.Thread(target=store, args=(i, g)) for i, g in enumerate(groups)]
    for n, t in enumerate(threads, 1):
        t.start()
        deadline = time.monotonic() + 30
        while True:  # queued in this order
            with gc._lock:
                if len(gc._waiting) == n:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.001)
    gc._hand_over()  # the busy leader is done
    for t in threads:
        t.join(30)
        assert not t.is_alive()


def test_waiting_requests_share_one_statement(db_url: str) -> None:
    _, producer = provision(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    gc = ingest.GroupCommit(make_engine(settings, pool_size=1))
    try:
        groups = [group(engine, settings, [signed(statement(), producer)]) for _ in range(6)]
        store_while_busy(gc, groups)
    finally:
        gc.close()
        engine.dispose()
    stored = rows(db_url)
    assert [r[0] for r in stored] == list(range(6))
    assert len({r[2] for r in stored}) == 1, "not one transaction"
    # each request got its own envelope's index, in the order they queued
    for i, g in enumerate(groups):
        assert g.report is not None
        [res] = g.report.results
        assert res.outcome is Outcome.CREATED and res.log_index == i
        assert stored[i][1] == res.request_id


def test_one_statement_classifies_its_requests_in_order(db_url: str) -> None:
    _, producer = provision(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    gc = ingest.GroupCommit(make_engine(settings, pool_size=1))
    x = statement()
    x_env = signed(x, producer)
    x_other = signed(statement(x["predicate"]["request_id"], output_len=5), producer)
    y_env = signed(statement(), producer)
    try:
        groups = [group(engine, settings, [x_env]),                 # new
                  group(engine, settings, [x_env]),                 # repeat of the above
                  group(engine, settings, [x_other]),               # conflict with it
                  group(engine, settings, [y_env, x_other], atomic=True),  # rejected whole
                  group(engine, settings, [y_env])]                 # so Y is new here
        store_while_busy(gc, groups)
    finally:
        gc.close()
        engine.dispose()
    reports = [g.report for g in groups]
    assert all(r is not None for r in reports)
    a, b, c, d, e = (r.results for r in reports if r is not None)
    assert (a[0].outcome, a[0].log_index) == (Outcome.CREATED, 0)
    assert (b[0].outcome, b[0].log_index) == (Outcome.EXISTING, 0)
    assert (c[0].outcome, c[0].log_index) == (Outcome.CONFLICT, 0)
    assert c[0].existing_dsse_sha256 == a[0].dsse_sha256
    assert [r.outcome for r in d] == [Outcome.ABORTED, Outcome.CONFLICT]
    assert reports[3] is not None and reports[3].outcome is ingest.BatchOutcome.REJECTED
    assert (e[0].outcome, e[0].log_index) == (Outcome.CREATED, 1)
    assert [r[1] for r in rows(db_url)] == [a[0].request_id, e[0].request_id]


def test_a_stored_request_id_is_existing_and_leaves_no_gap(db_url: str) -> None:
    """The first attempt takes every request_id for new (no read); the stored one fails
    that statement on the unique constraint, the retry reads and answers "existing"."""
    _, producer = provision(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    gc = ingest.GroupCommit(make_engine(settings, pool_size=1))
    first, again = signed(statement(), producer), signed(statement(), producer)
    try:
        gc.store(g1 := group(engine, settings, [first]))
        gc.store(g2 := group(engine, settings, [again, first]))
        gc.store(g3 := group(engine, settings, [signed(statement(), producer)]))
    finally:
        gc.close()
        engine.dispose()
    assert g1.report is not None and g2.report is not None and g3.report is not None
    assert [(r.outcome, r.log_index) for r in g2.report.results] == [
        (Outcome.CREATED, 1), (Outcome.EXISTING, 0)]
    assert g3.report.results[0].log_index == 2
    assert [r[0] for r in rows(db_url)] == [0, 1, 2]


def _failing_on(db_url: str) -> None:
    """A trigger that fails an envelope's row by its request_id: ``bad-...`` with a
    data exception (22000: one group's bad value), ``lost-...`` with a serialization
    failure (40001: any failure that is not about the row's values)."""
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("""
            CREATE FUNCTION fail_marked() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF NEW.request_id LIKE 'bad-%' THEN
                RAISE EXCEPTION 'marked bad' USING ERRCODE = '22000';
              ELSIF NEW.request_id LIKE 'lost-%' THEN
                RAISE EXCEPTION 'marked lost' USING ERRCODE = '40001';
              END IF;
              RETURN NEW;
            END $$""")
        conn.execute("CREATE TRIGGER fail_marked BEFORE INSERT ON envelopes "
                     "FOR EACH ROW EXECUTE FUNCTION fail_marked()")


def test_a_group_stored_one_by_one_is_not_failed_by_a_later_group(db_url: str) -> None:
    """A bad value fails the shared statement; the groups are then stored one at a time.
    When a later group fails for another reason, the groups stored before it are stored
    (committed), and their requests are told so, not given that failure (a 503 for a
    stored envelope)."""
    _, producer = provision(db_url)
    _failing_on(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    gc = ingest.GroupCommit(make_engine(settings, pool_size=1))
    try:
        good, bad, lost, after = (
            group(engine, settings, [signed(statement(f"{p}-{secrets.token_hex(4)}"), producer)])
            for p in ("good", "bad", "lost", "after"))
        store_while_busy(gc, [good, bad, lost, after], expect_errors=True)
    finally:
        gc.close()
        engine.dispose()
    stored = rows(db_url)
    assert [r[1].split("-")[0] for r in stored] == ["good"]
    assert good.report is not None and good.report.results[0].log_index == 0
    errors = store_while_busy.errors  # type: ignore[attr-defined]
    assert errors[0] is None, f"a stored group was failed: {errors[0]!r}"
    assert isinstance(errors[1], psycopg.errors.DataError)
    assert isinstance(errors[2], psycopg.errors.SerializationFailure)
    # not stored: the failure reached it (it was never attempted)
    assert isinstance(errors[3], psycopg.errors.SerializationFailure)


def test_a_queued_group_frees_its_thread_and_the_lead_is_handed_on(db_url: str) -> None:
    """``submit`` behind a busy leader returns at once (the request's thread is free; its
    future is completed by the leader). A leader given ``spawn`` stores one statement and
    hands the lead on to another thread while groups wait, so its own request is answered
    at once; that thread stores the rest."""
    _, producer = provision(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    spawned: list[Any] = []
    gc = ingest.GroupCommit(make_engine(settings, pool_size=1), max_items=1,
                            spawn=spawned.append)
    try:
        groups = [group(engine, settings, [signed(statement(), producer)]) for _ in range(3)]
        with gc._lock:
            gc._busy = True
        futures = [gc.submit(g) for g in groups]  # none of them waits
        assert not any(f.done() for f in futures)
        assert not futures[0].cancel(), "a caller that stops waiting could cancel it"
        gc._hand_over()  # the busy leader is done: it stores one and hands on
        assert futures[0].done() and not futures[1].done()
        assert len(spawned) == 1
        spawned.pop()()  # the other thread: the second, and hands on again
        assert futures[1].done() and not futures[2].done()
        spawned.pop()()
        assert all(f.done() and f.exception() is None for f in futures)
        assert not spawned and not gc._busy
    finally:
        gc.close()
        engine.dispose()
    assert [r[0] for r in rows(db_url)] == [0, 1, 2]
    assert [g.report.results[0].log_index for g in groups if g.report] == [0, 1, 2]


def test_a_leader_that_raises_leaves_the_waiting_groups_a_leader(db_url: str) -> None:
    """A leader whose statement raises something no group catches (here
    KeyboardInterrupt, as a signal would) re-raises it, and the groups still waiting
    are led by another thread instead of hanging until some later submit."""
    _, producer = provision(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)
    spawned: list[Any] = []

    class Interrupted(ingest.GroupCommit):
        first = True

        def _flush(self, batch: Any) -> None:
            if self.first:
                self.first = False
                raise KeyboardInterrupt
            super()._flush(batch)

    gc = Interrupted(make_engine(settings, pool_size=1), max_items=1, spawn=spawned.append)
    try:
        groups = [group(engine, settings, [signed(statement(), producer)]) for _ in range(2)]
        with gc._lock:
            gc._busy = True
        futures = [gc.submit(g) for g in groups]
        with pytest.raises(KeyboardInterrupt):
            gc._hand_over()
        assert len(spawned) == 1 and not futures[1].done()
        spawned.pop()()
        assert futures[1].done() and futures[1].exception() is None
        assert not gc._busy
    finally:
        gc.close()
        engine.dispose()
    assert [r[0] for r in rows(db_url)] == [0]


@pytest.mark.parametrize("spawn", ["refuses", "none", "no threads at all"])
def test_a_submit_that_must_not_lead_here_still_gets_a_leader(
        db_url: str, spawn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``submit(here=False)`` with nobody leading (an event loop's submit): a thread of
    its own leads when ``spawn`` refuses or there is none; with no thread to be had at
    all, this thread leads after all rather than leave the group (and every later one)
    without a leader."""
    _, producer = provision(db_url)
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=1)

    def refuse(_: Any) -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")

    gc = ingest.GroupCommit(make_engine(settings, pool_size=1),
                            spawn=None if spawn == "none" else refuse)
    if spawn == "no threads at all":
        def no_thread(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")
        monkeypatch.setattr(threading.Thread, "start", no_thread)
    try:
        g = group(engine, settings, [signed(statement(), producer)])
        future = gc.submit(g, here=False)
        assert future.result(30) is None
        assert g.report is not None and g.report.results[0].log_index == 0
        deadline = time.monotonic() + 30
        while gc._busy:  # the leader lets go once nothing waits
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        monkeypatch.undo()
        gc.close()
        engine.dispose()
    assert [r[0] for r in rows(db_url)] == [0]
