"""Issue 18, acceptance 2: an insider with the database superuser tampers with erasure;
``ledger audit`` reports each case (and the clean log passes, so the checks can fail).

- an erasure leaf without the key destruction (the key row put back);
- a destroyed key without an erasure leaf (a data key deleted by hand, triggers off);
- an edited tombstone (an erased envelope's column, its digest, the erasure row's body,
  the erased_keys row).
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest

from ledger.core import sealing
from ledger.db.session import session_scope
from ledger.log.audit import audit
from ledger.privacy import erasure
from tests.conftest import ADMIN_PG
from tests.privacy.conftest import ORIGIN, SUBJECTS, Log
from tests.privacy.conftest import log as log


def _superuser(log: Log) -> psycopg.Connection:
    return psycopg.connect(ADMIN_PG.rsplit("/", 1)[0] + "/" + log.db_url.rsplit("/", 1)[1],
                           autocommit=True)


def _erased(log: Log) -> tuple[int, int, list[int]]:
    """Erase the first subject; (erasure leaf index, its key count, erased indices)."""
    with session_scope(log.engine) as s:
        result = erasure.erase_subject(s, log.service, log.kek, SUBJECTS[0], actor="admin",
                                       reason="request", legal_basis="GDPR Art. 17")
    log.integrate()
    return result.log_index, result.keys, [i for _, i, _, _ in log.records[SUBJECTS[0]]]


def _problems(log: Log) -> list[str]:
    return audit(log.engine, ORIGIN, signatures=True, kek=log.kek).problems


def _as_superuser(log: Log, *sql: str, params: tuple[object, ...] = ()) -> None:
    with _superuser(log) as conn:
        conn.execute("SET session_replication_role = replica")  # triggers off
        for stmt in sql:
            conn.execute(stmt, params)  # type: ignore[arg-type]


def test_clean_log_with_an_erasure_passes(log: Log) -> None:
    _erased(log)
    assert _problems(log) == []


def test_erasure_leaf_without_key_destruction(log: Log) -> None:
    """The wrapped key is put back (from a backup) after its erasure leaf."""
    with _superuser(log) as conn:
        backup = conn.execute("SELECT id, data_subject, channel, model_sha256, day, wrapped, "
                              "kek_id FROM data_keys WHERE data_subject = %s",
                              (SUBJECTS[0],)).fetchall()
    idx, _, _ = _erased(log)
    with _superuser(log) as conn:
        for row in backup:
            conn.execute("INSERT INTO data_keys (id, data_subject, channel, model_sha256, "
                         "day, wrapped, kek_id) VALUES (%s, %s, %s, %s, %s, %s, %s)", row)
    problems = _problems(log)
    assert any("without the key destruction" in p and f"(entry {idx})" in p
               for p in problems), problems


def test_destroyed_key_without_erasure_leaf(log: Log) -> None:
    """A subject's key deleted by hand (no leaf): its records are reported unreadable."""
    victim = SUBJECTS[1]
    _as_superuser(log, "DELETE FROM data_keys WHERE data_subject = %s", params=(victim,))
    problems = _problems(log)
    for _, idx, _, _ in log.records[victim]:
        assert any(p.startswith(f"entry {idx} (envelope") and "no erasure leaf signed by a "
                   "trusted service key destroyed it" in p for p in problems), problems


def _edit_column(log: Log, idx: int) -> None:
    _as_superuser(log, f"UPDATE envelopes SET model_name = 'edited' WHERE log_index = {idx}")


def _edit_digest(log: Log, idx: int) -> None:
    _as_superuser(log, "UPDATE envelopes SET dsse_sha256 = decode(repeat('ab', 32), 'hex') "
                       f"WHERE log_index = {idx}")


@pytest.mark.parametrize("edit,expect", [
    (_edit_column, "column model_name says 'edited', the signed envelope says 'tiny-demo'"),
    (_edit_digest, "column dsse_sha256 says"),
], ids=["index-column", "digest"])
def test_edited_tombstone_columns(log: Log, edit: Callable[[Log, int], None],
                                  expect: str) -> None:
    _, _, erased = _erased(log)
    edit(log, erased[0])
    problems = _problems(log)
    assert any(p.startswith(f"entry {erased[0]} (envelope") and expect in p
               for p in problems), problems


def test_edited_erasure_row(log: Log) -> None:
    idx, _, _ = _erased(log)
    _as_superuser(log, "UPDATE erasures SET body = jsonb_set(body, '{reason}', "
                       f"'\"edited\"') WHERE log_index = {idx}")
    problems = _problems(log)
    assert any(p.startswith(f"entry {idx} (erasure") and "column body" in p
               for p in problems), problems


def test_edited_erased_keys_row(log: Log) -> None:
    idx, _, _ = _erased(log)
    _as_superuser(log, f"UPDATE erased_keys SET records = 99 WHERE erasure_index = {idx}")
    problems = _problems(log)
    assert any("the erased_keys row of data key" in p and "99 records" in p
               for p in problems), problems


def test_tombstone_swapped_to_another_key(log: Log) -> None:
    """An erased envelope's sealed blob replaced by another subject's (still readable):
    the blob does not open for this record's digest."""
    _, _, erased = _erased(log)
    other = log.records[SUBJECTS[2]][0][1]
    _as_superuser(log, "UPDATE envelopes SET dsse = (SELECT dsse FROM envelopes WHERE "
                       f"log_index = {other}) WHERE log_index = {erased[0]}")
    problems = _problems(log)
    assert any(p.startswith(f"entry {erased[0]} (envelope") for p in problems), problems
    with _superuser(log) as conn:
        row = conn.execute(f"SELECT dsse FROM envelopes WHERE log_index = {erased[0]}"
                           ).fetchone()
    assert row is not None and sealing.is_sealed(bytes(row[0]))
