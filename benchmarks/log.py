"""Transparency-log benchmark on PostgreSQL.

1. integration throughput: N synthetic entries (default 1,000,000) sequenced with COPY,
   then folded into the tree by the integrator (batches of 20,000, a signed checkpoint per
   batch); baseline in the same run: recomputing the root from all leaf hashes in memory;
2. inclusion and consistency proof latency at that size, in-process (from the tiles in
   Postgres) and over HTTP (`ledger serve`), p50/p99 over random indices;
3. offline verification rate of an exported bundle of real signed envelopes (512 prompt /
   128 output tokens) with `ledger verify`;
4. `ledger audit` of a log of real signed records of every leaf kind (default 1,000,000
   entries: per block of 50, 44 envelopes, a dispute with 5 signed events and a verdict),
   every kind checked (entries rebuilt from each record, every served column
   cross-checked against the signed payload, disputes against their trails) next to the
   envelope-only, digest-only audit it replaced, in the same run, with the ratio.

The end-to-end ingest figure with integration on is `benchmarks/ingest.py --integrate`.

    python benchmarks/log.py [--entries 1000000] [--samples 2000] [--bundle 5000]
                             [--audit-entries 1000000] [--only-audit] [--audit-db NAME]
                             [--audit-since 10000] [--only-incremental]
                             [--only-proofs --audit-db NAME [--http-samples N] [--no-export]]

5. with ``--audit-since ADD`` (or ``--only-incremental``, ADD default 10,000): the full
   audit of a log of ``--audit-entries`` + ADD entries next to ``ledger audit --since``
   the checkpoint at ``--audit-entries``, same run (the acceptance: < 5%).

6. with ``--only-proofs --audit-db NAME`` (issue 17, acceptance 2): on the audit's log of
   ``--audit-entries`` real records, inclusion and consistency proofs in-process next to
   a point SELECT of one entry and the proofs as they were before (subtrees recomputed),
   over HTTP next to ``GET /healthz`` and ``GET /v1/log/checkpoint``, and a whole-log
   export next to COPY of
   the same DSSE columns to a file (text and binary), all in the same run.

``--audit-db NAME`` keeps the audit's log in database NAME (built on the first run, reused
by later runs with the same ``--audit-entries``: building 1,000,000 signed entries takes
minutes); drop it by hand afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ADMIN_PG, machine, pct, scratch_database, table


def sequence_synthetic(pg_url: str, n: int) -> None:
    from ledger.core.logentry import log_entry_bytes
    from ledger.core.merkle import leaf_hash

    with psycopg.connect(pg_url) as conn, conn.cursor() as cur:
        with cur.copy("COPY log_entries (idx, kind, ref, entry, leaf_hash) "
                      "FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["int8", "text", "text", "bytea", "bytea"])
            for i in range(n):
                ref = f"req-{i:012d}"
                entry = log_entry_bytes("envelope", ref, hashlib.sha256(ref.encode()).hexdigest())
                copy.write_row((i, "envelope", ref, entry, leaf_hash(entry)))
        cur.execute("UPDATE log_state SET size = %s", (n,))
        conn.commit()


BLOCK = 50  # entries per block: 44 envelopes, 5 dispute events and one verdict


def build_audit_log(url: str, n: int) -> tuple[Any, Any]:
    """n entries of real signed records of every kind, written with COPY (the way ingest
    writes envelopes), then integrated; returns (engine, log signer)."""
    engine, signer, _ = _build_audit_log(url, n)
    return engine, signer


def _build_audit_log(url: str, n: int, add: int = 0) -> tuple[Any, Any, Any]:
    """:func:`build_audit_log`, then ``add`` more entries of the same kinds appended and
    integrated; the third item appends more: ``append(count)``."""
    import uuid
    from datetime import UTC, datetime

    from psycopg.types.json import Jsonb

    from ledger.core.envelope import index_fields, validate_statement
    from ledger.core.keys import generate_private_key, key_id, public_raw
    from ledger.core.logentry import log_entry_bytes
    from ledger.core.merkle import leaf_hash
    from ledger.core.statements import event_statement, verdict_statement
    from ledger.db.session import make_engine, session_scope
    from ledger.log.integrator import integrate_all
    from ledger.log.signer import LogSigner
    from ledger.producer import sign_statement
    from ledger.services.keys import register_key
    from ledger.settings import Settings
    from tests.helpers import statement

    producer, worker, service = (generate_private_key() for _ in range(3))
    signer = LogSigner(AUDIT_ORIGIN, generate_private_key())
    engine = make_engine(Settings(database_url=url), pool_size=2)
    with session_scope(engine) as s:
        signer.ensure_registered(s)
        for key, purpose in ((producer, "producer"), (worker, "worker"), (service, "ledger")):
            register_key(s, public_key=public_raw(key), purpose=purpose, name=purpose)
    template = statement("bench-template")
    fixed = index_fields(validate_statement(template))
    job_id = uuid.uuid4()
    pg_url = url.replace("postgresql+psycopg://", "postgresql://")

    def sign(st: dict[str, Any], key: Any) -> bytes:
        return sign_statement(st, key).canonical_bytes()

    with psycopg.connect(pg_url) as conn:
        conn.execute("INSERT INTO replay_jobs (id, fingerprint_id, kind, state) "
                     "VALUES (%s, %s, 'dispute', 'done')", (job_id, fixed.fingerprint_id))
        conn.commit()

    def append(start: int, n: int) -> None:
        with psycopg.connect(pg_url) as conn:
            idx = start
            while idx < n:
                entries, envs, disputes, verdicts, events = [], [], [], [], []
                for _ in range(min(200, -(-(n - idx) // BLOCK))):
                    block_start = idx
                    for _ in range(min(BLOCK - 6, n - idx)):
                        rid = f"req-{idx:012d}"
                        st = statement(rid)
                        d = sign(st, producer)
                        digest = hashlib.sha256(d)
                        entries.append((idx, "envelope", rid,
                                        log_entry_bytes("envelope", rid, digest.hexdigest())))
                        envs.append((idx, rid, d, digest.digest(), [key_id(public_raw(producer))],
                                     fixed.model_sha256, fixed.model_name, fixed.fingerprint_id,
                                     fixed.channel, fixed.tier,
                                     datetime.fromisoformat(st["predicate"]["recorded_at"]),
                                     fixed.prompt_tokens, fixed.output_tokens))
                        idx += 1
                    if n - idx < 6:
                        continue
                    disputed = envs[-(idx - block_start)]
                    rid, env_index, env_digest = disputed[1], disputed[0], disputed[3].hex()
                    did = uuid.uuid4()
                    vid = f"verdict-{job_id}-{env_index}"
                    now = datetime.now(UTC)
                    trail = [("opened", service, {"reason": "bench", "priority": "normal"}),
                             ("queued", service, {"job_id": str(job_id), "state": "queued"}),
                             ("replaying", worker, {"job_id": str(job_id), "attempt": 1,
                                                    "state": "replaying"}),
                             ("verdict", worker, {"verdict_id": vid, "outcome": "reproduced",
                                                  "tier": "bitwise", "verdict_log_index": idx + 3,
                                                  "state": "verdict"}),
                             ("resolved", service, {"resolution": "rejected", "note": "ok",
                                                    "state": "resolved"})]
                    for seq, (kind, key, body) in enumerate(trail, start=1):
                        if kind == "verdict":
                            details = {"job_id": str(job_id), "tier": "bitwise", "reason": None,
                                       "worker": {"worker_id": "bench-worker",
                                                  "fingerprint_id": fixed.fingerprint_id}}
                            vd = sign(verdict_statement(
                                verdict_id=vid, request_id=rid, envelope_index=env_index,
                                envelope_dsse_sha256=env_digest, outcome="reproduced",
                                details=details), worker)
                            entries.append((idx, "verdict", vid, log_entry_bytes(
                                "verdict", vid, hashlib.sha256(vd).hexdigest())))
                            verdicts.append((idx, vid, job_id, env_index, rid, "reproduced",
                                             "bitwise", "bench-worker", fixed.fingerprint_id,
                                             Jsonb(details), vd))
                            idx += 1
                        eid = f"dispute-{did}-{seq}"
                        actor = "bench-worker" if key is worker else "ledger"
                        ed = sign(event_statement(
                            event_id=eid, dispute_id=str(did), seq=seq, kind=kind, actor=actor,
                            at=now.isoformat(), request_id=rid, envelope_dsse_sha256=env_digest,
                            body=body), key)
                        entries.append((idx, "dispute_event", eid, log_entry_bytes(
                            "dispute_event", eid, hashlib.sha256(ed).hexdigest())))
                        events.append((idx, eid, did, seq, kind, actor, Jsonb(body), now, ed))
                        idx += 1
                    disputes.append((did, rid, env_index, fixed.fingerprint_id, "bench", "resolved",
                                     "reviewer", vid, "rejected", "ok", "ledger", now))
                with conn.cursor() as cur:
                    for sql, rows in (
                            ("COPY log_entries (idx, kind, ref, entry, leaf_hash) FROM STDIN",
                             [(*e, leaf_hash(e[3])) for e in entries]),
                            ("COPY envelopes (log_index, request_id, dsse, dsse_sha256, keyids, "
                             "model_sha256, model_name, fingerprint_id, channel, tier, "
                             "recorded_at, "
                             "prompt_tokens, output_tokens) FROM STDIN", envs),
                            ("COPY disputes (id, request_id, envelope_index, fingerprint_id, "
                             "reason, "
                             "state, opened_by, verdict_id, resolution, resolution_note, "
                             "resolved_by, resolved_at) FROM STDIN", disputes),
                            ("COPY verdicts (log_index, verdict_id, job_id, envelope_index, "
                             "request_id, outcome, tier, worker_id, fingerprint_id, details, dsse) "
                             "FROM STDIN", verdicts),
                            ("COPY dispute_events (log_index, event_id, dispute_id, seq, kind, "
                             "actor, "
                             "body, at, dsse) FROM STDIN", events)):
                        with cur.copy(sql) as copy:
                            for row in rows:
                                copy.write_row(row)
                conn.commit()
                print(f"\r  built {idx:,} / {n:,} entries", end="", flush=True)
            conn.execute("UPDATE log_state SET size = %s", (n,))
            conn.commit()
        print()
        integrate_all(engine, signer, max_entries=20_000)

    append(0, n)
    size = [n]

    def more(count: int) -> None:
        append(size[0], size[0] + count)
        size[0] += count

    if add:
        more(add)
    return engine, signer, more


#: main before every kind was audited: its `ledger audit` is the baseline ("today's").
MAIN_BEFORE = "a167aa0"


def main_audit() -> Any:
    """``audit`` of ``ledger/log/audit.py`` as it was on main at :data:`MAIN_BEFORE`, read
    from git (not copied into the tree); None outside a git checkout."""
    import importlib.util
    import subprocess
    import tempfile

    try:
        source = subprocess.run(["git", "show", f"{MAIN_BEFORE}:ledger/log/audit.py"],
                                cwd=Path(__file__).parent, capture_output=True, check=True,
                                text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "audit_main_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("audit_main_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.audit


AUDIT_ORIGIN = "bench.example/audit"


def kept_database(name: str) -> tuple[str, bool]:
    """(SQLAlchemy URL, whether it existed) of database ``name``, created when missing:
    a log kept between benchmark runs (``--audit-db``)."""
    with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                              (name,)).fetchone() is not None
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN_PG.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) \
        + f"/{name}"
    return url, exists


@contextmanager
def audit_log(n: int, keep: str | None) -> Iterator[Any]:
    """An engine on a database holding the audit's log of ``n`` entries: a scratch one, or
    ``keep`` (built unless it already holds such a log; never dropped)."""
    from ledger.db.session import make_engine, upgrade
    from ledger.settings import Settings

    if keep is None:
        with scratch_database("ledger_auditbench") as url:
            t = time.perf_counter()
            engine, _ = build_audit_log(url, n)
            print(f"built and integrated {n:,} signed entries of every kind in "
                  f"{time.perf_counter() - t:.0f} s")
            try:
                yield engine
            finally:
                engine.dispose()
        return
    url, exists = kept_database(keep)
    if exists:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
            row = conn.execute("SELECT size FROM log_state WHERE id = 1").fetchone()
            built = conn.execute("SELECT max(tree_size) FROM checkpoints").fetchone()
        if row is None or row[0] != n or built is None or built[0] != n:
            sys.exit(f"database {keep} does not hold a built log of {n:,} entries: drop it "
                     "or name another")
        print(f"reusing the log of {n:,} entries in database {keep}")
        engine = make_engine(Settings(database_url=url), pool_size=2)
    else:
        upgrade(url)
        t = time.perf_counter()
        engine, _ = build_audit_log(url, n)
        print(f"built and integrated {n:,} signed entries of every kind in {keep} in "
              f"{time.perf_counter() - t:.0f} s (kept)")
    try:
        yield engine
    finally:
        engine.dispose()


def audit_benchmark(n: int, signatures: bool, keep: str | None = None) -> list[list[object]]:
    from ledger.log.audit import ENVELOPE_DIGEST_ONLY, LEAF_KINDS, audit

    rows: list[list[object]] = []
    with audit_log(n, keep) as engine:
        modes = [("envelope-only, digest only (before)", ENVELOPE_DIGEST_ONLY, False),
                 ("every kind, columns and dispute trails (now)", LEAF_KINDS, False)]
        if signatures:
            modes += [("envelope-only + signatures (before)", ENVELOPE_DIGEST_ONLY, True),
                      ("every kind + signatures (now)", LEAF_KINDS, True)]
        before = main_audit()
        best: dict[str, float] = {}
        today = f"main's ledger audit at {MAIN_BEFORE}, envelope leaves only (today)"
        for _ in range(3):  # alternate and keep the best: the machine is shared
            if before is not None:
                t = time.perf_counter()
                old = before(engine, AUDIT_ORIGIN)
                el = time.perf_counter() - t
                assert old.ok, old.problems[:5]
                best[today] = min(best.get(today, el), el)
                print(f"  {today}: {el:.2f} s", flush=True)
            for label, kinds, sigs in modes:
                t = time.perf_counter()
                report = audit(engine, AUDIT_ORIGIN, kinds=kinds, signatures=sigs)
                el = time.perf_counter() - t
                assert report.ok, report.problems[:5]
                assert report.entries == n
                best[label] = min(best.get(label, el), el)
                print(f"  {label}: {el:.2f} s", flush=True)
    if today in best:
        rows.append([f"audit {n:,} entries: {today}", n / best[today],
                     f"{best[today]:.1f} s", "x1.00"])
    for i, (label, _, _) in enumerate(modes):
        base = best[modes[i - i % 2][0]]
        vs_today = (f", x{best[label] / best[today]:.2f} of today"
                    if today in best and not label.endswith("(before)") and not sigs_label(label)
                    else "")
        rows.append([f"audit {n:,} entries: {label}", n / best[label],
                     f"{best[label]:.1f} s", f"x{best[label] / base:.2f}{vs_today}"])
    return rows


def incremental_benchmark(n: int, add: int, keep: str | None = None,
                          rounds: int = 3) -> list[list[object]]:
    """`ledger audit` of the whole log vs `ledger audit --since` the checkpoint at ``n``,
    after ``add`` entries were appended to a log of ``n`` (same run, alternating, best of
    ``rounds``). The log is kept in ``<keep>_plus<add>`` with ``--audit-db``."""
    from ledger.db.session import make_engine, upgrade
    from ledger.log.audit import audit
    from ledger.settings import Settings

    def timed(engine: Any, note: bytes | None) -> tuple[float, Any]:
        t = time.perf_counter()
        report = audit(engine, AUDIT_ORIGIN, since=note)
        return time.perf_counter() - t, report

    def run(url: str, build: bool) -> list[list[object]]:
        if build:
            t = time.perf_counter()
            engine, _, _ = _build_audit_log(url, n, add)
            print(f"built {n:,} + {add:,} signed entries of every kind in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
        else:
            engine = make_engine(Settings(database_url=url), pool_size=2)
        try:
            with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as c:
                row = c.execute("SELECT note FROM checkpoints WHERE tree_size = %s",
                                (n,)).fetchone()
                size = c.execute("SELECT size FROM log_state").fetchone()
            if row is None or size is None or size[0] != n + add:
                sys.exit(f"the log does not hold {n:,} + {add:,} entries with a checkpoint at "
                         f"{n:,}: drop it or name another --audit-db")
            note = bytes(row[0])  # what the sink saved, or the last audit's --against file
            best = {"full": float("inf"), "since": float("inf")}
            for _ in range(rounds):
                for mode in ("full", "since"):
                    el, report = timed(engine, note if mode == "since" else None)
                    assert report.ok, report.problems[:5]
                    assert report.entries == (add if mode == "since" else n + add)
                    best[mode] = min(best[mode], el)
                    print(f"  audit {mode}: {el:.2f} s", flush=True)
        finally:
            engine.dispose()
        full, since = best["full"], best["since"]
        return [[f"audit {n + add:,} entries: the whole log (full audit)", (n + add) / full,
                 f"{full:.2f} s", "x1.000"],
                [f"audit --since checkpoint {n:,}: {add:,} entries rechecked, stored tree "
                 "checked against it", add / since, f"{since:.2f} s",
                 f"x{since / full:.3f} of the full audit"]]

    if keep is None:
        with scratch_database("ledger_sincebench") as url:
            return run(url, True)
    name = f"{keep}_plus{add}"
    url, exists = kept_database(name)
    if not exists:
        upgrade(url)
    print(("reusing" if exists else "building") + f" the log in database {name}")
    return run(url, not exists)


class RecomputingReader:
    """The proofs' reader before stored subtree hashes (main before issue 17's tiles
    work): tiles only (full ones from the process-wide cache), every subtree recomputed."""

    def __init__(self, cur: Any) -> None:
        from ledger.log.store import PgTileReader

        self.inner = PgTileReader(cur)

    def read_tiles(self, tiles: Any) -> Any:
        return self.inner.read_tiles(tiles)


def _before_inclusion(session: Any, index: int) -> None:
    """``ledger.log.proofs.inclusion`` as it was (3 queries, recomputed subtrees, no
    check against the signed root): the same-run "before"."""
    from ledger.core.tiles import inclusion_proof_from_tiles
    from ledger.db.session import raw_cursor
    from ledger.log.store import entry_at, latest_checkpoint

    with raw_cursor(session) as cur:
        cp = latest_checkpoint(cur)
        assert cp is not None
        assert entry_at(cur, index) is not None
        inclusion_proof_from_tiles(index, cp.tree_size, RecomputingReader(cur))


def proofs_benchmark(n: int, keep: str, samples: int, http_samples: int,
                     export: bool, export_rounds: int = 2) -> list[list[object]]:
    """Proof latency at ``n`` entries (in-process and over HTTP) and a whole-log export,
    on the kept log ``keep`` (built by :func:`audit_log` when missing; upgraded to
    head, which fills ``tile_nodes`` for a log built before migration 0014). Same-run
    baselines: a point SELECT of one log entry over the same connection; the proofs as
    they were before (recomputed subtrees); HTTP GETs of ``/healthz`` (FastAPI's own
    cost, no database) and ``/v1/log/checkpoint`` (two SELECTs, on the same fast path as
    the proofs); ``COPY`` of the same DSSE column(s) to a file. In-process proofs are
    timed twice: in a fresh process (the tile cache filling as it goes) and with every
    full tile kept (a long-running process); the HTTP server is first sent a proof in
    every full tile (its steady state)."""
    from ledger.core.keys import generate_private_key
    from ledger.db.session import raw_cursor, session_scope, upgrade
    from ledger.log import proofs
    from ledger.log.export import Selection, write_bundle
    from ledger.log.store import SUBTREES
    from ledger.replay.records import Signer
    from tests.conftest import provision
    from tests.helpers import run_server

    rows: list[list[object]] = []
    with audit_log(n, keep) as engine:
        url = engine.url.render_as_string(hide_password=False)
        pg_url = url.replace("postgresql+psycopg://", "postgresql://")
        t = time.perf_counter()
        upgrade(url)
        with psycopg.connect(pg_url) as conn:
            nodes = conn.execute("SELECT count(*) FROM tile_nodes").fetchone()
        print(f"upgraded to head in {time.perf_counter() - t:.1f} s "
              f"({nodes[0] if nodes else 0:,} full tiles with stored subtree hashes)")
        rng = random.Random(17)
        lat: dict[str, list[float]] = {k: [] for k in (
            "select", "inclusion", "before", "consistency", "select kept", "inclusion kept",
            "consistency kept")}
        SUBTREES.forget_all()
        with session_scope(engine) as s, raw_cursor(s) as cur:

            def point_select(i: int) -> None:
                cur.execute("SELECT entry FROM log_entries WHERE idx = %s", (i,))
                cur.fetchone()

            def timed(key: str, work: Any, arg: int) -> None:
                t = time.perf_counter()
                work(arg)
                lat[key].append(time.perf_counter() - t)

            # A fresh process: the tile cache fills as it goes (the first pass), then
            # with every full tile read once (a long-running API process, whose cache
            # holds 4,096 tiles: 1,048,576 entries), interleaved, so load changes hit
            # all alike.
            for _ in range(samples):
                timed("select", point_select, rng.randrange(n))
                timed("inclusion", lambda i: proofs.inclusion(s, i), rng.randrange(n))
                timed("before", lambda i: _before_inclusion(s, i), rng.randrange(n))
                timed("consistency", lambda m: proofs.consistency(s, m, None),
                      rng.randrange(1, n))
            for tile in range(n >> 8):
                proofs.inclusion(s, tile << 8)
            for _ in range(samples):
                timed("select kept", point_select, rng.randrange(n))
                timed("inclusion kept", lambda i: proofs.inclusion(s, i), rng.randrange(n))
                timed("consistency kept", lambda m: proofs.consistency(s, m, None),
                      rng.randrange(1, n))
        print("in-process done", flush=True)
        for key, label, baseline in (
                ("select", "baseline: point SELECT of one log entry", "select"),
                ("before", "inclusion proof before (recomputed subtrees)", "select"),
                ("inclusion", "inclusion proof, in-process (verified), fresh process",
                 "select"),
                ("consistency", "consistency proof, in-process (verified), fresh process",
                 "select"),
                ("select kept", "baseline: point SELECT, second pass", "select kept"),
                ("inclusion kept", "inclusion proof, in-process (verified), every full "
                 "tile kept", "select kept"),
                ("consistency kept", "consistency proof, in-process (verified), every "
                 "full tile kept", "select kept")):
            base = pct(lat[baseline], 50)
            rows.append([f"{label}, {n:,} entries", f"{pct(lat[key], 50) * 1e3:.3f} ms",
                         f"{pct(lat[key], 99) * 1e3:.3f} ms",
                         f"x{pct(lat[key], 50) / base:.2f} of the SELECT"])

        print(table(["measurement", "p50", "p99", "vs same-run baseline"], rows), flush=True)
        with psycopg.connect(pg_url) as conn:  # a kept log: last run's API keys go
            conn.execute("UPDATE api_keys SET revoked_at = now() "
                         "WHERE name LIKE 'test-%%' AND revoked_at IS NULL")
        keys, _ = provision(url)
        with run_server(url, extra_env={"LEDGER_LOG_NAME": AUDIT_ORIGIN,
                                        "LEDGER_METRICS_PORT": "0"}) as server, \
                httpx.Client(base_url=server.base_url,
                             headers={"Authorization": f"Bearer {keys['reviewer']}"}) as http:
            # Two clients, interleaved: httpx, and the standard library's http.client on a
            # keep-alive connection (~0.1 ms of client CPU a request against httpx's ~1 ms
            # here: closer to the server's own latency, which the target is about).
            lean = HTTPConnection("127.0.0.1", urlsplit(server.base_url).port,
                                              timeout=30)
            auth = {"Authorization": f"Bearer {keys['reviewer']}"}
            http_lat: dict[tuple[str, str], list[float]] = {}
            for tile in range(n >> 8):  # a server in its steady state: every full tile kept
                lean.request("GET", f"/v1/log/proof?index={tile << 8}", headers=auth)
                assert lean.getresponse().read()
            for _ in range(http_samples):
                for name, path, param in (("healthz", "/healthz", None),
                                          ("checkpoint", "/v1/log/checkpoint", None),
                                          ("inclusion", "/v1/log/proof", "index"),
                                          ("consistency", "/v1/log/consistency", "from")):
                    params = {param: rng.randrange(1, n)} if param else {}
                    t = time.perf_counter()
                    r = http.get(path, params=params)
                    http_lat.setdefault(("httpx", name), []).append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text
                    target = path + (f"?{param}={params[param]}" if param else "")
                    t = time.perf_counter()
                    lean.request("GET", target, headers=auth)
                    answer = lean.getresponse()
                    body = answer.read()
                    http_lat.setdefault(("http.client", name), []).append(
                        time.perf_counter() - t)
                    assert answer.status == 200, body[:300]
            lean.close()
        for client in ("httpx", "http.client"):
            hbase = pct(http_lat[(client, "checkpoint")], 50)
            for name, label in (("healthz", "baseline: GET /healthz (FastAPI, no database)"),
                                ("checkpoint", "baseline: GET /v1/log/checkpoint (fast path, "
                                 "two SELECTs)"),
                                ("inclusion", "GET /v1/log/proof (inclusion)"),
                                ("consistency", "GET /v1/log/consistency")):
                lat_ = http_lat[(client, name)]
                rows.append([f"{label}, HTTP, 1 connection, {client}",
                             f"{pct(lat_, 50) * 1e3:.3f} ms", f"{pct(lat_, 99) * 1e3:.3f} ms",
                             f"x{pct(lat_, 50) / hbase:.2f} of the checkpoint GET"])
        if export:
            rows += export_benchmark(engine, pg_url, Signer(
                generate_private_key(), "ledger", "ledger-service"), Selection(), write_bundle,
                export_rounds)
    return rows


EXPORT_COPY = ("COPY (SELECT dsse FROM admin_events UNION ALL SELECT dsse FROM envelopes "
               "UNION ALL SELECT dsse FROM verdicts UNION ALL SELECT dsse FROM dispute_events) "
               "TO STDOUT")


def export_benchmark(engine: Any, pg_url: str, signer: Any, selection: Any,
                     write_bundle: Any, rounds: int = 2) -> list[list[object]]:
    """Whole-log ``ledger export`` (what the CLI does: every line written to a file)
    against COPY of the same DSSE columns of every record table to a file, alternating,
    best of ``rounds``."""
    out = Path(tempfile.mkdtemp(prefix="ledger-exportbench-"))
    best = {"copy": float("inf"), "copy binary": float("inf"), "export": float("inf")}
    sizes: dict[str, int] = {}
    records = 0
    try:
        for _ in range(rounds):
            for mode in ("copy", "copy binary"):
                path = out / f"{mode}.out"
                t = time.perf_counter()
                with psycopg.connect(pg_url) as conn, conn.cursor() as cur, \
                        path.open("wb") as fh:
                    sql = EXPORT_COPY + (" (FORMAT BINARY)" if mode == "copy binary" else "")
                    with cur.copy(sql) as copy:
                        for block in copy:
                            fh.write(block)
                best[mode] = min(best[mode], time.perf_counter() - t)
                sizes[mode] = path.stat().st_size
                path.unlink()
                print(f"  {mode}: {best[mode]:.1f} s", flush=True)
            path = out / "bundle.jsonl"
            t = time.perf_counter()
            with path.open("wb") as fh:  # what `ledger export` does
                records = write_bundle(engine, selection, fh, signer)
            best["export"] = min(best["export"], time.perf_counter() - t)
            sizes["export"] = path.stat().st_size
            print(f"  export: {best['export']:.1f} s, {records:,} records", flush=True)
            path.unlink()
    finally:
        for p in out.iterdir():
            p.unlink()
        out.rmdir()
    rows: list[list[object]] = []
    for mode, label in (("copy", "baseline: COPY of the DSSE columns to a file (text)"),
                        ("copy binary", "baseline: the same COPY, binary format"),
                        ("export", "whole-log export to a file (proofs verified)")):
        rows.append([f"{label}, {records:,} records, {sizes[mode] / 1e6:,.0f} MB",
                     f"{records / best[mode]:,.0f} records/s", f"{best[mode]:.1f} s",
                     f"x{best['copy'] / best[mode]:.2f} of the text COPY, "
                     f"x{best['copy binary'] / best[mode]:.2f} of the binary"])
    return rows


def sigs_label(label: str) -> bool:
    return "signatures" in label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--bundle", type=int, default=5000, help="envelopes in the verify bundle")
    ap.add_argument("--audit-entries", type=int, default=1_000_000)
    ap.add_argument("--audit-signatures", action="store_true",
                    help="also time both audits with --signatures")
    ap.add_argument("--only-audit", action="store_true", help="run only the audit comparison")
    ap.add_argument("--audit-db", metavar="NAME",
                    help="keep the audit's log in this database and reuse it on later runs")
    ap.add_argument("--audit-since", type=int, metavar="ADD", default=0,
                    help="also time `ledger audit --since` after ADD entries appended to the "
                         "audit's log, against the full audit of the same log")
    ap.add_argument("--only-incremental", action="store_true",
                    help="run only the --audit-since comparison")
    ap.add_argument("--only-proofs", action="store_true",
                    help="run only the proof latency and export comparison, on the audit's "
                         "log (--audit-db, --audit-entries)")
    ap.add_argument("--http-samples", type=int, default=2000)
    ap.add_argument("--export-rounds", type=int, default=2)
    ap.add_argument("--no-export", action="store_true",
                    help="with --only-proofs: skip the whole-log export")
    args = ap.parse_args()
    if args.only_proofs:
        if not args.audit_db:
            sys.exit("--only-proofs needs --audit-db NAME (a log kept between runs)")
        print(f"machine: {machine()}")
        rows = proofs_benchmark(args.audit_entries, args.audit_db, args.samples,
                                args.http_samples, not args.no_export, args.export_rounds)
        print(table(["measurement", "p50 / rate", "p99 / time", "vs same-run baseline"], rows))
        return
    if args.only_incremental:
        print(f"machine: {machine()}")
        rows = incremental_benchmark(args.audit_entries, args.audit_since or 10_000,
                                     args.audit_db)
        print(table(["measurement", "entries per second", "time", "vs full audit"], rows))
        return
    if args.only_audit:
        print(f"machine: {machine()}")
        rows = audit_benchmark(args.audit_entries, args.audit_signatures, args.audit_db)
        print(table(["measurement", "entries per second", "time", "vs envelope-only"], rows))
        if args.audit_since:
            rows = incremental_benchmark(args.audit_entries, args.audit_since, args.audit_db)
            print(table(["measurement", "entries per second", "time", "vs full audit"], rows))
        return

    from ledger.core.keys import generate_private_key, private_pem
    from ledger.core.merkle import leaf_hash, root_hash
    from ledger.db.session import make_engine, session_scope
    from ledger.log import proofs
    from ledger.log.integrator import integrate_all
    from ledger.log.signer import LogSigner
    from ledger.services import ingest
    from ledger.settings import Settings
    from tests.conftest import provision
    from tests.helpers import run_server, signed, statement

    print(f"machine: {machine()}")
    rows: list[list[object]] = []
    tmp = Path(tempfile.mkdtemp(prefix="ledger-logbench-"))
    key_file = tmp / "log.pem"
    log_key = generate_private_key()
    key_file.write_bytes(private_pem(log_key))
    signer = LogSigner("bench.example/log", log_key)
    with scratch_database("ledger_logbench") as url:
        pg_url = url.replace("postgresql+psycopg://", "postgresql://")
        t = time.perf_counter()
        sequence_synthetic(pg_url, args.entries)
        print(f"sequenced {args.entries:,} synthetic entries in {time.perf_counter() - t:.1f} s")
        engine = make_engine(Settings(database_url=url), pool_size=2)
        with session_scope(engine) as s:
            signer.ensure_registered(s)
        t = time.perf_counter()
        published = integrate_all(engine, signer, max_entries=20_000)
        integ = time.perf_counter() - t
        rows.append(["integrate (Postgres, 20k/batch, signed checkpoint each)",
                     args.entries / integ, f"{len(published)} checkpoints", ""])
        # baseline: the root from all leaves, in memory
        with psycopg.connect(pg_url) as conn:
            leaves = [bytes(r[0]) for r in conn.execute("SELECT leaf_hash FROM log_entries "
                                                        "ORDER BY idx")]
        t = time.perf_counter()
        root = root_hash(leaves)
        base = time.perf_counter() - t
        assert root == published[-1].root_hash, "integrated root differs from recomputation"
        rows.append(["baseline: root from all leaves in memory", args.entries / base,
                     f"{base * 1000:.0f} ms", ""])
        del leaves

        rng = random.Random(7)
        size = args.entries
        inc_lat, cons_lat = [], []
        with session_scope(engine) as s:
            for _ in range(args.samples):
                i = rng.randrange(size)
                t = time.perf_counter()
                proofs.inclusion(s, i)
                inc_lat.append(time.perf_counter() - t)
            for _ in range(args.samples):
                m = rng.randrange(1, size)
                t = time.perf_counter()
                proofs.consistency(s, m, None)
                cons_lat.append(time.perf_counter() - t)
        rows.append(["inclusion proof, in-process", "", f"p50 {pct(inc_lat, 50) * 1e3:.2f} ms",
                     f"p99 {pct(inc_lat, 99) * 1e3:.2f} ms"])
        rows.append(["consistency proof, in-process", "",
                     f"p50 {pct(cons_lat, 50) * 1e3:.2f} ms",
                     f"p99 {pct(cons_lat, 99) * 1e3:.2f} ms"])

        keys, producer = provision(url)
        with run_server(url, extra_env={"LEDGER_LOG_NAME": signer.origin,
                                        "LEDGER_METRICS_PORT": "0"}) as server, \
                httpx.Client(base_url=server.base_url,  # /v1/log/proof needs a reading role
                             headers={"Authorization": f"Bearer {keys['reviewer']}"}) as http:
            for name, path, param in (("inclusion", "/v1/log/proof", "index"),
                                      ("consistency", "/v1/log/consistency", "from")):
                lat = []
                for _ in range(args.samples):
                    value = rng.randrange(1, size)
                    t = time.perf_counter()
                    r = http.get(path, params={param: value})
                    lat.append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text
                rows.append([f"{name} proof over HTTP (1 connection)", "",
                             f"p50 {pct(lat, 50) * 1e3:.2f} ms",
                             f"p99 {pct(lat, 99) * 1e3:.2f} ms"])

        # offline verification of bundles of real signed envelopes, two sizes
        settings = Settings(database_url=url, log_name=signer.origin)
        env = {**os.environ, "LEDGER_DATABASE_URL": url, "LEDGER_LOG_NAME": signer.origin}
        for prompt_len, output_len, model in ((512, 128, "5a" * 32), (32, 8, "5b" * 32)):
            with session_scope(engine) as s:
                for start in range(0, args.bundle, 500):
                    items = [signed(statement(prompt_len=prompt_len, output_len=output_len,
                                              model_sha256=model), producer)
                             for _ in range(min(500, args.bundle - start))]
                    assert all(r.status == 201 for r in ingest.ingest(s, items, settings))
            integrate_all(engine, signer)
            bundle = tmp / f"bundle-{prompt_len}.jsonl"
            subprocess.run([sys.executable, "-m", "ledger.cli.main", "export", "--out",
                            str(bundle), "--model-sha256", model],
                           env=env, check=True, capture_output=True)
            vkey = json.loads(bundle.read_bytes().split(b"\n", 1)[0])["log_keys"][0]
            for jobs in (1, 0):
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "ledger.cli.main", "verify", str(bundle),
                                "--log-key", vkey, "--jobs", str(jobs)], env=env, check=True,
                               capture_output=True)
                el = time.perf_counter() - t
                label = "1 process" if jobs == 1 else f"{os.cpu_count()} processes"
                rows.append([f"offline verify, {args.bundle:,} envelopes "
                             f"({prompt_len}/{output_len} tokens), {label}", args.bundle / el,
                             f"{bundle.stat().st_size / 1e6:.0f} MB bundle", "incl. start-up"])
        engine.dispose()
        del keys
    audit_rows = audit_benchmark(args.audit_entries, args.audit_signatures, args.audit_db)
    print()
    print(f"log of {args.entries:,} entries; {args.samples} samples per latency")
    print(table(["measurement", "per second", "", ""], rows))
    print(table(["measurement", "entries per second", "time", "vs envelope-only"], audit_rows))
    if args.audit_since:
        rows = incremental_benchmark(args.audit_entries, args.audit_since, args.audit_db)
        print(table(["measurement", "entries per second", "time", "vs full audit"], rows))
    del leaf_hash


if __name__ == "__main__":
    main()
