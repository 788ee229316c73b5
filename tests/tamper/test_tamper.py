"""The tamper suite: an insider with the PostgreSQL superuser (and, in the last cases, the
log's or a producer's private key) edits the log; every edit must be caught by a named
``ledger audit`` mode, naming the first bad index.

Every leaf kind (envelope, verdict, dispute_event) gets: one byte of its signed record
flipped, the record deleted, the record and its entry deleted, two records swapped, the
record moved off the log or onto another kind's leaf, and every served column edited.
The mutable ``disputes`` rows get every derived column edited. Then the attacks that need
keys: the tail truncated with its checkpoints, a forged producer and log key inserted and
the log re-signed with it, a forged service key signing a rewritten resolution, a verdict
rewritten by the holder of the log key, a consistent rewrite with the real keys.

Each case runs all four modes (plain, --signatures, --trust with --signatures, --against
the saved checkpoints) and records the result for the session's table.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from psycopg.types.json import Jsonb

from ledger.core import dsse
from ledger.core.canonical import canonical_json
from ledger.core.envelope import output_digest
from ledger.core.keys import generate_private_key, key_id, public_raw
from ledger.core.logentry import log_entry_bytes
from ledger.core.merkle import EMPTY_ROOT, leaf_hash
from ledger.db.session import make_engine
from ledger.log.audit import AuditReport, audit
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.producer import sign_statement
from tests.helpers import REPO
from tests.tamper.conftest import MODES, ORIGIN, RESULTS, Built, pg, superuser

ENVELOPE = "tamper-7-4"  # an envelope nobody disputed
OTHER_ENVELOPE = "tamper-7-6"


def _cell(report: AuditReport) -> str:
    if report.ok:
        return "pass"
    return "FAIL" if report.first_bad_index is None else f"FAIL@{report.first_bad_index}"


def run_mode(built: Built, url: str, mode: str) -> AuditReport:
    engine = make_engine(url=url, pool_size=1)
    try:
        if mode == "plain":
            return audit(engine, ORIGIN)
        if mode == "signatures":
            return audit(engine, ORIGIN, signatures=True)
        if mode == "trust":
            return audit(engine, ORIGIN, signatures=True, trust=built.trust)
        if mode == "witness":  # the trust policy, plus what its witness last cosigned
            return audit(engine, ORIGIN, signatures=True, trust=built.trust,
                         witnessed=[built.witness_view])
        assert mode == "against"
        return audit(engine, ORIGIN, against=built.saved())
    finally:
        engine.dispose()


def all_modes(built: Built, url: str) -> dict[str, AuditReport]:
    return {m: run_mode(built, url, m) for m in MODES}


@dataclass(frozen=True)
class Case:
    id: str
    attack: str
    mode: str  # the weakest mode asserted to detect it
    tamper: Callable[[Built, str], tuple[int | None, str | tuple[str, ...]]]
    # -> (first bad index or None, words one problem names)
    unnoticed_by: tuple[str, ...] = ()  # modes asserted NOT to notice (the attack is real)


# --- what each leaf kind's record looks like -----------------------------------------

@dataclass(frozen=True)
class Kind:
    kind: str
    table: str
    target: Callable[[Built], int]
    other: Callable[[Built], int]
    columns: dict[str, str]  # column -> SQL expression that changes it


KINDS = (
    Kind("envelope", "envelopes", lambda b: b.env_index[ENVELOPE],
         lambda b: b.env_index[OTHER_ENVELOPE], {
             "request_id": "request_id || '-x'",
             "recorded_at": "recorded_at + interval '1 second'",
             "channel": "CASE channel WHEN 'deterministic' THEN 'performance' "
                        "ELSE 'deterministic' END",
             "tier": "CASE tier WHEN 'bitwise' THEN 'token' ELSE 'bitwise' END",
             "model_sha256": "repeat('0', 64)",
             "model_name": "'other-model'",
             "fingerprint_id": "'fp-0000000000000000'",
             "prompt_tokens": "prompt_tokens + 1",
             "output_tokens": "output_tokens + 1",
             "keyids": "ARRAY[repeat('a', 64)]",
             "dsse_sha256": "sha256('x'::bytea)",
         }),
    # the diverged verdict behind the upheld dispute
    Kind("verdict", "verdicts", lambda b: b.verdicts["upheld"]["idx"],
         lambda b: b.verdicts["rejected"]["idx"], {
             "verdict_id": "verdict_id || '-x'",
             "request_id": "request_id || '-x'",
             "envelope_index": "envelope_index + 1",
             "outcome": "'reproduced'",
             "tier": "CASE tier WHEN 'bitwise' THEN 'token' ELSE 'bitwise' END",
             "worker_id": "'mallory-worker'",
             "fingerprint_id": "'fp-0000000000000000'",
             "details": "details || '{\"max_abs_logprob_diff\": 0.5}'::jsonb",
         }),
    # the "resolved" event of the upheld dispute
    Kind("dispute_event", "dispute_events", lambda b: b.event("upheld", "resolved"),
         lambda b: b.event("rejected", "resolved"), {
             "event_id": "event_id || '-x'",
             "dispute_id": "gen_random_uuid()",
             "seq": "seq + 10",
             "kind": "'comment'",
             "actor": "'mallory (admin)'",
             "body": "jsonb_set(body, '{resolution}', '\"rejected\"')",
             "at": "at + interval '1 second'",
         }),
    # the registry leaf that vouches for the producer key (and the worker key's)
    Kind("admin_event", "admin_events", lambda b: b.admin["producer"],
         lambda b: b.admin["worker"], {
             "event_id": "event_id || '-x'",
             "kind": "'signing_key.revoked'",
             "actor": "'mallory (admin)'",
             "target": "repeat('b', 64)",
             "body": "jsonb_set(body, '{key,purpose}', '\"worker\"')",
             "at": "at + interval '1 second'",
         }),
)


def _flip(k: Kind) -> Callable[[Built, str], tuple[int, str]]:
    def tamper(b: Built, url: str) -> tuple[int, str]:
        i = k.target(b)
        superuser(url, (f"UPDATE {k.table} SET dsse = set_byte(dsse, 60, get_byte(dsse, 60) "
                        "# 1) WHERE log_index = %s", (i,)))
        return i, "does not match its record"
    return tamper


def _delete(k: Kind, with_entry: bool) -> Callable[[Built, str], tuple[int, str]]:
    def tamper(b: Built, url: str) -> tuple[int, str]:
        i = k.target(b)
        sql: list[tuple[str, tuple[object, ...]]] = [
            (f"DELETE FROM {k.table} WHERE log_index = %s", (i,))]
        if with_entry:
            sql.append(("DELETE FROM log_entries WHERE idx = %s", (i,)))
        superuser(url, *sql)
        return i, (f"entries {i}..{i} are missing" if with_entry
                   else f"its {k.kind} record is missing")
    return tamper


def _swap(k: Kind) -> Callable[[Built, str], tuple[int, str]]:
    def tamper(b: Built, url: str) -> tuple[int, str]:
        i, j = k.target(b), k.other(b)
        superuser(url,
                  (f"UPDATE {k.table} SET log_index = -1 WHERE log_index = %s", (i,)),
                  (f"UPDATE {k.table} SET log_index = %s WHERE log_index = %s", (i, j)),
                  (f"UPDATE {k.table} SET log_index = %s WHERE log_index = -1", (j,)))
        return min(i, j), "does not match its record"
    return tamper


def _orphan(k: Kind) -> Callable[[Built, str], tuple[int, str]]:
    def tamper(b: Built, url: str) -> tuple[int, str]:
        i = k.target(b)
        superuser(url, (f"UPDATE {k.table} SET log_index = 1000000 WHERE log_index = %s", (i,)))
        return i, "claims log_index 1000000, which has no log entry"
    return tamper


def _onto_other_kind(k: Kind) -> Callable[[Built, str], tuple[int, str]]:
    """The record moved onto another kind's leaf (whose own record is moved away)."""
    def tamper(b: Built, url: str) -> tuple[int, str]:
        i = k.target(b)
        j = b.env_index[OTHER_ENVELOPE] if k.kind != "envelope" else b.verdicts["open"]["idx"]
        other_table = "envelopes" if k.kind != "envelope" else "verdicts"
        superuser(url,
                  (f"UPDATE {other_table} SET log_index = 2000000 WHERE log_index = %s", (j,)),
                  (f"UPDATE {k.table} SET log_index = %s WHERE log_index = %s", (j, i)))
        return min(i, j), "claims this index"
    return tamper


def _column(k: Kind, column: str, expr: str) -> Callable[[Built, str], tuple[int, str]]:
    def tamper(b: Built, url: str) -> tuple[int, str]:
        i = k.target(b)
        superuser(url, (f"UPDATE {k.table} SET {column} = {expr} WHERE log_index = %s", (i,)))
        return i, f"column {column} says"
    return tamper


DISPUTE_COLUMNS = {
    "state": "'verdict'",
    "resolution": "'rejected'",
    "resolution_note": "'edited by the insider'",
    "resolved_by": "'mallory (admin)'",
    "verdict_id": "(SELECT verdict_id FROM verdicts WHERE outcome = 'reproduced' LIMIT 1)",
    "request_id": f"'{ENVELOPE}'",
    "envelope_index": "envelope_index + 1",
    "fingerprint_id": "'fp-0000000000000000'",
}


def _dispute_column(column: str, expr: str) -> Callable[[Built, str], tuple[Any, Any]]:
    """A disputes row is a cache, not a leaf: the problem names the dispute and column
    (and the trail's last entry) but no bad log index."""
    def tamper(b: Built, url: str) -> tuple[Any, Any]:
        superuser(url, (f"UPDATE disputes SET {column} = {expr} WHERE id = %s",
                        (b.disputes["upheld"]["id"],)))
        return None, (f"dispute {b.disputes['upheld']['id']} (signed trail",
                      f"column {column} says")
    return tamper


def _delete_dispute_row(b: Built, url: str) -> tuple[int | None, str]:
    superuser(url, ("DELETE FROM disputes WHERE id = %s", (b.disputes["upheld"]["id"],)))
    return None, "but no dispute row"


# --- attacks that need keys ----------------------------------------------------------

def _stored(url: str, table: str, index: int) -> bytes:
    with psycopg.connect(pg(url)) as conn:
        row = conn.execute(f"SELECT dsse FROM {table} WHERE log_index = %s", (index,)).fetchone()
    assert row is not None
    return bytes(row[0])


def _statement(dsse_bytes: bytes) -> dict[str, Any]:
    env = dsse.envelope_from_json(dsse_bytes)
    return dict(orjson.loads(env.payload))


def _edited_envelope(url: str, index: int, producer: Ed25519PrivateKey) -> bytes:
    st = _statement(_stored(url, "envelopes", index))
    tokens = st["predicate"]["output"]["token_ids"]
    tokens[0] = (tokens[0] + 1) % 256
    st["subject"][0]["digest"]["sha256"] = output_digest(tokens)
    return sign_statement(st, producer).canonical_bytes()


def _insert_key(url: str, public: bytes, purpose: str, name: str) -> None:
    superuser(url, ("INSERT INTO signing_keys (keyid, public_key, purpose, name) "
                    "VALUES (%s, %s, %s, %s)", (key_id(public), public, purpose, name)))


def _replace_record(url: str, table: str, kind: str, index: int, ref: str, new_dsse: bytes,
                    **columns: Any) -> None:
    """Swap a record's signed bytes (and columns) and make its entry match."""
    digest = hashlib.sha256(new_dsse).hexdigest()
    entry = log_entry_bytes(kind, ref, digest)
    sets = ", ".join(f"{c} = %s" for c in columns)
    superuser(url,
              (f"UPDATE {table} SET dsse = %s{', ' + sets if sets else ''} "
               "WHERE log_index = %s", (new_dsse, *columns.values(), index)),
              ("UPDATE log_entries SET entry = %s, leaf_hash = %s WHERE idx = %s",
               (entry, leaf_hash(entry), index)))


def _resign_log(url: str, signer: LogSigner, *, keep_genuine_upto: int | None = None) -> None:
    """Rebuild tiles and checkpoints from the (edited) entries and sign them with
    ``signer``; optionally put back the genuine checkpoints up to a size (they still
    match: nothing before it changed)."""
    with psycopg.connect(pg(url)) as conn:
        genuine = conn.execute("SELECT tree_size, root_hash, note FROM checkpoints "
                               "WHERE tree_size <= %s", (keep_genuine_upto or -1,)).fetchall()
    superuser(url, ("DELETE FROM checkpoints", ()), ("DELETE FROM tiles", ()),
              ("UPDATE log_tree SET size = 0, root_hash = %s", (EMPTY_ROOT,)))
    engine = make_engine(url=url, pool_size=1)
    try:
        integrate_all(engine, signer, max_entries=1)
    finally:
        engine.dispose()
    if genuine:
        superuser(url, ("DELETE FROM checkpoints WHERE tree_size <= %s", (keep_genuine_upto,)),
                  *[("INSERT INTO checkpoints (tree_size, root_hash, note) VALUES (%s, %s, %s)",
                     tuple(r)) for r in genuine])


def truncate_tail(b: Built, url: str) -> tuple[int, str]:
    """Delete the newest entries, their records and their checkpoints, and wind the log
    state back: the database agrees with itself."""
    m = b.tail[1]
    assert b.tail == [i for i, _, _ in b.entries[-len(b.tail):]]
    superuser(url,
              ("DELETE FROM envelopes WHERE log_index >= %s", (m,)),
              ("DELETE FROM log_entries WHERE idx >= %s", (m,)),
              ("DELETE FROM checkpoint_cosignatures WHERE tree_size > %s", (m,)),
              ("DELETE FROM checkpoints WHERE tree_size > %s", (m,)),
              ("UPDATE log_state SET size = %s", (m,)),
              ("UPDATE log_tree SET size = %s, root_hash = (SELECT root_hash FROM checkpoints "
               "WHERE tree_size = %s)", (m, m)))
    return m, "the log was truncated"


def forged_log_and_producer_keys(b: Built, url: str) -> tuple[int, str]:
    """Insert a producer key and a log key of the insider's own, rewrite an envelope with
    the forged producer key, and re-sign every checkpoint after it with the forged log
    key. The rows of signing_keys vouch for both; only the trust policy does not."""
    k = b.env_index[ENVELOPE]
    producer, log_key = generate_private_key(), generate_private_key()
    _insert_key(url, public_raw(producer), "producer", "forged-gateway")
    _insert_key(url, public_raw(log_key), "log", ORIGIN)
    new = _edited_envelope(url, k, producer)
    _replace_record(url, "envelopes", "envelope", k, ENVELOPE, new,
                    dsse_sha256=hashlib.sha256(new).digest(),
                    keyids=[key_id(public_raw(producer))])
    _resign_log(url, LogSigner(ORIGIN, log_key), keep_genuine_upto=k)
    return k, "not signed by a log key of the trust policy"


def forged_service_key(b: Built, url: str) -> tuple[int, str]:
    """Holding the log key, the insider registers a service key of their own, signs a
    resolved event that says the opposite, updates the dispute row to match and re-signs
    the log with the real log key."""
    k = b.event("upheld", "resolved")
    service = generate_private_key()
    _insert_key(url, public_raw(service), "ledger", "forged-service")
    st = _statement(_stored(url, "dispute_events", k))
    st["predicate"]["body"]["resolution"] = "rejected"
    new = sign_statement(st, service).canonical_bytes()
    body = orjson.dumps(st["predicate"]["body"]).decode()
    _replace_record(url, "dispute_events", "dispute_event", k, st["predicate"]["event_id"],
                    new, body=Jsonb(orjson.loads(body)))
    superuser(url, ("UPDATE disputes SET resolution = 'rejected' WHERE id = %s",
                    (b.disputes["upheld"]["id"],)))
    _resign_log(url, b.log_signer)
    return k, "which is not a ledger key"


def verdict_rewritten_with_log_key(b: Built, url: str) -> tuple[int, str]:
    """Holding the log key but no worker key, the insider turns a diverged verdict into
    a reproduction: the payload changes, the worker's signature cannot follow."""
    k = b.verdicts["reverify-diverged"]["idx"]
    old = dsse.envelope_from_json(_stored(url, "verdicts", k))
    st = dict(orjson.loads(old.payload))
    st["predicate"]["outcome"] = "reproduced"
    payload = canonical_json(st)
    new = dsse.Envelope(old.payload_type, base64.b64encode(payload).decode(), payload,
                        old.signatures).canonical_bytes()
    _replace_record(url, "verdicts", "verdict", k, st["predicate"]["verdict_id"], new,
                    outcome="reproduced")
    superuser(url, ("UPDATE verdicts SET details = jsonb_set(details, '{outcome}', "
                    "'\"reproduced\"') WHERE log_index = %s", (k,)))
    _resign_log(url, b.log_signer)
    return k, "signature"


def consistent_rewrite(b: Built, url: str) -> tuple[int, str]:
    """Holding the log key and a producer key: a validly signed alternative record, every
    hash, tile and checkpoint recomputed and signed with the real log key."""
    k = b.env_index[ENVELOPE]
    new = _edited_envelope(url, k, b.producer)
    _replace_record(url, "envelopes", "envelope", k, ENVELOPE, new,
                    dsse_sha256=hashlib.sha256(new).digest())
    _resign_log(url, b.log_signer)
    # and the cosignatures the rewrite invalidated go too: what is left all verifies
    superuser(url, ("DELETE FROM checkpoint_cosignatures WHERE tree_size > %s", (k,)))
    return k, "history was rewritten at entr"  # "y 13", or "ies 13..N-1" from a witness


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _cases() -> list[Case]:
    cases = []
    for k in KINDS:
        name = k.kind.replace("_", "-")
        cases += [
            Case(f"{name}-flip-signed-byte", f"one byte of {_a(k.kind)}'s DSSE flipped",
                 "plain", _flip(k)),
            Case(f"{name}-delete-record", f"{_a(k.kind)} row deleted", "plain",
                 _delete(k, with_entry=False)),
            Case(f"{name}-delete-record-and-entry", f"{_a(k.kind)} row and its log entry "
                 "deleted", "plain", _delete(k, with_entry=True)),
            Case(f"{name}-swap-two", f"two {k.kind} rows swap log_index", "plain", _swap(k)),
            Case(f"{name}-move-off-log", f"{_a(k.kind)} row moved to a log_index with no entry",
                 "plain", _orphan(k)),
            Case(f"{name}-move-onto-other-kind", f"{_a(k.kind)} row moved onto another kind's "
                 "leaf", "plain", _onto_other_kind(k)),
        ]
        cases += [Case(f"{name}-column-{col}", f"{k.table}.{col} edited", "plain",
                       _column(k, col, expr)) for col, expr in k.columns.items()]
    cases += [Case(f"dispute-column-{col}", f"disputes.{col} edited", "plain",
                   _dispute_column(col, expr)) for col, expr in DISPUTE_COLUMNS.items()]
    cases += [
        Case("dispute-row-deleted", "a disputes row deleted (its signed trail stays)",
             "plain", _delete_dispute_row),
        Case("tail-truncated-with-checkpoints", "newest entries deleted with their "
             "checkpoints and cosignatures, log_state and log_tree wound back", "witness",
             truncate_tail, ("plain", "signatures", "trust")),
        Case("forged-producer-and-log-key", "forged producer + log key rows, an envelope "
             "rewritten and the log re-signed with the forged key", "trust",
             forged_log_and_producer_keys, ("plain", "signatures")),
        Case("forged-service-key", "forged service key row signs a flipped resolution; "
             "log re-signed with the real log key", "trust", forged_service_key,
             ("plain", "signatures")),
        Case("verdict-rewritten-with-log-key", "a verdict's outcome rewritten by the log "
             "key holder (worker signature now invalid)", "signatures",
             verdict_rewritten_with_log_key, ("plain",)),
        Case("consistent-rewrite-real-keys", "validly re-signed envelope, log re-signed "
             "with the real log key, invalidated cosignatures deleted", "witness",
             consistent_rewrite, ("plain", "signatures")),
    ]
    return cases


CASES = _cases()


def test_clean_log_passes_every_mode(built: Built, copy_url: str) -> None:
    """The control: without this, a suite of failing audits proves nothing."""
    reports = all_modes(built, copy_url)
    RESULTS.insert(0, {"case": "clean-control", "attack": "none", "mode": "-",
                       "modes": {m: _cell(r)
                                 for m, r in reports.items()}})
    for mode, report in reports.items():
        assert report.ok, (mode, report.problems)
    assert reports["trust"].signatures_checked == len(built.entries)
    assert reports["plain"].records_checked == {
        "envelope": len(built.env_index),
        "verdict": sum(1 for _, kind, _ in built.entries if kind == "verdict"),
        "dispute_event": sum(1 for _, kind, _ in built.entries if kind == "dispute_event"),
        "admin_event": sum(1 for _, kind, _ in built.entries if kind == "admin_event")}
    assert reports["plain"].disputes_checked == 3
    assert reports["against"].saved_checkpoints == len(built.entries)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tamper_is_detected(built: Built, copy_url: str, case: Case) -> None:
    index, words = case.tamper(built, copy_url)
    reports = all_modes(built, copy_url)
    RESULTS.append({"case": case.id, "attack": case.attack, "mode": case.mode,
                    "modes": {m: _cell(r)
                              for m, r in reports.items()}})
    report = reports[case.mode]
    assert not report.ok, f"{case.mode} audit did not notice {case.attack}"
    assert report.first_bad_index == index, report.problems
    wanted = (words,) if isinstance(words, str) else words
    assert any(all(w in p for w in wanted) for p in report.problems), report.problems
    for mode in case.unnoticed_by:
        assert reports[mode].ok, (mode, reports[mode].problems)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", "audit", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "250", **env})


def test_cli_trust_option_and_setting(built: Built, copy_url: str) -> None:
    """`ledger audit --trust FILE` and LEDGER_TRUST_POLICY_FILE pin the log key: a log
    re-signed with a forged key registered in signing_keys passes without them."""
    env = {"LEDGER_DATABASE_URL": copy_url, "LEDGER_LOG_NAME": ORIGIN}
    clean = _cli("--signatures", "--trust", str(built.trust_file), "--against",
                 str(built.sink), env=env)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "trust policy" in clean.stdout and "OK" in clean.stdout
    index, _ = forged_log_and_producer_keys(built, copy_url)
    unpinned = _cli("--signatures", env=env)
    assert unpinned.returncode == 0, unpinned.stdout
    pinned = _cli("--trust", str(built.trust_file), env=env)
    assert pinned.returncode == 1
    assert f"first bad index {index}" in pinned.stdout, pinned.stdout
    from_setting = _cli(env={**env, "LEDGER_TRUST_POLICY_FILE": str(built.trust_file)})
    assert from_setting.returncode == 1 and f"first bad index {index}" in from_setting.stdout


def test_payloads_decoded_in_helper_processes_give_the_same_report(built: Built,
                                                                    copy_url: str) -> None:
    """Large logs decode envelope payloads in helper processes (audit's ``workers``): the
    same findings, in the same order, as decoding them in line."""
    engine = make_engine(url=copy_url, pool_size=1)
    try:
        clean = audit(engine, ORIGIN, signatures=True, trust=built.trust, workers=1)
        assert clean.ok, clean.problems
        assert clean.records_checked["envelope"] == len(built.env_index)
        k = built.env_index[ENVELOPE]
        superuser(copy_url, ("UPDATE envelopes SET model_name = 'other-model' "
                             "WHERE log_index = %s", (k,)),
                  ("UPDATE envelopes SET dsse = dsse || 'x'::bytea WHERE log_index = %s",
                   (built.env_index[OTHER_ENVELOPE],)))
        inline = audit(engine, ORIGIN, workers=0)
        helpers = audit(engine, ORIGIN, workers=1)
    finally:
        engine.dispose()
    assert not helpers.ok and helpers.problems == inline.problems
    assert helpers.first_bad_index == inline.first_bad_index == min(
        k, built.env_index[OTHER_ENVELOPE])
    assert any("column model_name" in p for p in helpers.problems), helpers.problems
