"""Soak: ingest at half the measured capacity for 30 minutes while disputes flow.

Real processes throughout (``tests/replay/stack.py``): a scratch PostgreSQL database,
a private redis-server, ``ledger serve`` (with the integrator), ``ledger beat`` and one
``ledger worker`` for tiny-demo. The clients behave like gateways: batches of 100
envelopes (512 prompt / 128 output tokens, signed with the stack's producer key), 503 and
429 are retried after ``Retry-After``, connection errors and timeouts are retried with the
same bytes (same request_ids: idempotency makes that safe), and an envelope counts as
acknowledged once its item came back 200 or 201.

1. capacity: pre-signed batches (signed before the clock starts, in separate processes)
   posted closed-loop from ``--clients`` connections for ``--capacity-seconds``;
2. soak: ``--minutes`` at half that rate (or ``--rate``), open loop: batch k is due at
   ``t0 + k * batch / rate`` whether or not earlier ones have been answered; envelopes are
   signed ahead of the schedule by ``--signers`` processes, off the request path. A dispute
   is opened every ``--dispute-every`` seconds on an envelope recorded by the reference
   engine, which the worker replays into a signed verdict.

Each minute: envelopes sent and acknowledged, batch latency p50/p99 (from the scheduled
send to the last item acknowledged, retries included, so a stall is not hidden by the
open-loop schedule), p99 of single HTTP attempts, 503s and retries, dispute open ->
verdict p99, integration lag, and the RSS (VmRSS, children included) of the API, beat,
worker, redis-server and the scratch database's PostgreSQL backends (summed). At the end:
sent / acknowledged / stored / duplicates / lost, verdicts per dispute, ``ledger audit``,
and RSS growth from the end of minute 3 (warm-up) to the end.

    python benchmarks/soak.py [--minutes 30] [--rate ENVELOPES_PER_S] [--json OUT]

Exit status 1 if an acknowledged envelope is lost or duplicated, an envelope was never
acknowledged (a batch is given up ``GIVE_UP_S`` after its scheduled time), a dispute did
not get exactly one verdict, a process of the stack exited, or the audit fails.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, pct, scratch_database, table

WARMUP_MINUTES = 3
GIVE_UP_S = 600  # a batch still unacknowledged this long after its schedule is given up
PROCESSES = ("api", "beat", "worker", "redis", "postgres", "postgres_anon")


# --- envelopes, signed off the request path ---------------------------------------------

def batch_name(prefix: str, k: int) -> str:
    return f"{prefix}-{k:06d}"


def request_ids(prefix: str, k: int, batch: int) -> list[str]:
    return [f"{batch_name(prefix, k)}-{j:03d}" for j in range(batch)]


def sign_batches(producer_pem: bytes, pool: Path, prefix: str, ks: range, batch: int,
                 consumed: Any = None, ahead: int = 0) -> None:
    """Write batch bodies ``pool/<prefix>-<k>.json`` for k in ``ks`` (in a child process).
    With ``consumed``, stay at most ``ahead`` batches in front of the sender.

    One statement per batch (512 prompt / 128 output tokens, fresh logits digests and
    recorded_at); each envelope is that canonical payload with its own request_id put in
    (same length, so still canonical) and its own Ed25519 signature. Building the statement
    is most of the cost, so this keeps signing at ~0.17 ms an envelope instead of ~0.8 ms:
    on 2 cores, full per-envelope signing at the soak rate took more CPU than the API did
    and made the schedule slip."""
    from ledger.core import dsse
    from ledger.core.canonical import canonical_json
    from ledger.core.keys import load_private_pem
    from ledger.producer import envelope_to_json
    from tests.helpers import statement

    key = load_private_pem(producer_pem)
    for k in ks:
        while consumed is not None and k >= consumed.value + ahead:
            time.sleep(0.05)
        rids = request_ids(prefix, k, batch)
        payload = canonical_json(statement(rids[0], prompt_len=512, output_len=128))
        assert payload.count(rids[0].encode()) == 2, "request_id must appear exactly twice"
        envs = [envelope_to_json(dsse.sign_envelope(
            payload.replace(rids[0].encode(), rid.encode()), (key,))) for rid in rids]
        part = pool / f".{batch_name(prefix, k)}.part"
        part.write_bytes(json.dumps({"envelopes": envs}).encode())
        part.rename(pool / f"{batch_name(prefix, k)}.json")


def start_signers(n: int, producer_pem: bytes, pool: Path, prefix: str, batches: int,
                  batch: int, consumed: Any = None, ahead: int = 0) -> list[Any]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=sign_batches, daemon=True,
                         args=(producer_pem, pool, prefix, range(i, batches, n), batch,
                               consumed, ahead)) for i in range(n)]
    for p in procs:
        p.start()
    return procs


# --- a gateway that retries -------------------------------------------------------------

@dataclass
class Minute:
    """Client-side numbers of one minute (sends by send time, the rest by answer time)."""
    sent: int = 0
    acked: int = 0
    batch_s: list[float] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    shed: int = 0            # 503 / 429 answers, retried after Retry-After
    transport_errors: int = 0
    server_errors: int = 0   # other 5xx, retried
    rejected: int = 0        # 4xx items: not retried (must stay 0)
    late: int = 0            # batches sent > 1 s after their scheduled time (client lag)


class Gateway:
    def __init__(self, base_url: str, api_key: str, pool: Path, prefix: str, batch: int,
                 stop: threading.Event) -> None:
        self.base_url, self.api_key, self.pool = base_url, api_key, pool
        self.prefix, self.batch, self.stop = prefix, batch, stop
        self.lock = threading.Lock()
        self.acked: dict[str, int] = {}              # request_id -> log_index
        self.conflicting_acks: list[tuple[str, int, int]] = []
        self.sent_ids = 0
        self.minutes: dict[int, Minute] = {}
        self.t0 = time.monotonic()
        self.problems: list[str] = []
        self._local = threading.local()

    def minute(self, at: float | None = None) -> Minute:
        m = int(((time.monotonic() if at is None else at) - self.t0) // 60)
        return self.minutes.setdefault(m, Minute())

    def _client(self) -> httpx.Client:
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = httpx.Client(
                base_url=self.base_url, timeout=60,
                headers={"Authorization": f"Bearer {self.api_key}",
                         "Content-Type": "application/json"})
        return c

    def _note(self, text: str) -> None:
        with self.lock:
            if len(self.problems) < 50:
                self.problems.append(text)

    def deliver(self, k: int, scheduled: float) -> None:
        """Post batch k until every item is acknowledged (or rejected, or we stop)."""
        path = self.pool / f"{batch_name(self.prefix, k)}.json"
        body = path.read_bytes()
        rids = request_ids(self.prefix, k, self.batch)
        pending = list(range(len(rids)))
        envelopes: list[Any] | None = None
        client = self._client()
        if time.monotonic() - scheduled > 1:
            with self.lock:
                self.minute().late += 1
        with self.lock:
            self.sent_ids += len(rids)
            self.minute().sent += len(rids)
        attempt = 0
        while pending and not self.stop.is_set() and time.monotonic() - scheduled < GIVE_UP_S:
            attempt += 1
            t = time.monotonic()
            try:
                r = client.post("/v1/envelopes/batch", content=body)
            except httpx.TransportError as exc:
                with self.lock:
                    self.minute().transport_errors += 1
                self._note(f"batch {k}: {type(exc).__name__}: {exc}")
                time.sleep(backoff(attempt))
                continue
            done = time.monotonic()
            with self.lock:
                self.minute(done).request_s.append(done - t)
            if r.status_code in (429, 503):
                with self.lock:
                    self.minute(done).shed += 1
                time.sleep(retry_after(r.headers.get("retry-after"), attempt))
                continue
            if r.status_code >= 500:
                with self.lock:
                    self.minute(done).server_errors += 1
                self._note(f"batch {k}: HTTP {r.status_code} {r.text[:300]}")
                time.sleep(backoff(attempt))
                continue
            if r.status_code != 200:
                with self.lock:
                    self.minute(done).rejected += len(pending)
                self._note(f"batch {k}: HTTP {r.status_code} {r.text[:300]}")
                break
            results = r.json()["results"]
            still = []
            with self.lock:
                for pos, res in zip(pending, results, strict=True):
                    rid = rids[pos]
                    if res["request_id"] != rid:
                        self.problems.append(f"{rid}: answered for {res['request_id']}")
                    if res["status"] in (200, 201):
                        idx = int(res["log_index"])
                        before = self.acked.setdefault(rid, idx)
                        if before != idx:
                            self.conflicting_acks.append((rid, before, idx))
                        self.minute(done).acked += 1
                    elif res["status"] >= 500:
                        still.append(pos)
                    else:
                        self.minute(done).rejected += 1
                        if len(self.problems) < 50:
                            self.problems.append(f"{rid}: {res['status']} {res.get('problem')}")
            pending = still
            if pending:
                envelopes = envelopes or json.loads(body)["envelopes"]
                body = json.dumps({"envelopes": [envelopes[p] for p in pending]}).encode()
        if not pending:
            with self.lock:
                self.minute().batch_s.append(time.monotonic() - scheduled)
            path.unlink()


def backoff(attempt: int) -> float:
    return min(5.0, 0.2 * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def retry_after(header: str | None, attempt: int) -> float:
    try:
        return max(0.0, float(header)) if header is not None else backoff(attempt)
    except ValueError:
        return backoff(attempt)


# --- measurements of the processes and the database ------------------------------------

def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """``field`` (VmRSS, RssAnon) of ``pid`` plus all its descendants, in kB (0 if gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _status_kb(p, field)
        todo.extend(children.get(p, []))
    return total


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def sample_rss(pids: dict[str, int], conn: psycopg.Connection[Any], db: str,
               ours: set[int]) -> dict[str, float]:
    """VmRSS in MB per process; postgres = the scratch database's backends summed, except
    the connections of this script (``ours``). Backends count the shared buffers they
    touched, so ``postgres_anon`` (RssAnon: private memory) is recorded as well."""
    out: dict[str, float] = {name: rss_kb(pid) / 1024 for name, pid in pids.items()}
    backends = [r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s", (db,)) if r[0] not in ours]
    out["postgres"] = sum(_status_kb(p, "VmRSS") for p in backends) / 1024
    out["postgres_anon"] = sum(_status_kb(p, "RssAnon") for p in backends) / 1024
    out["pg_backends"] = len(backends)
    return out


def integration_lag(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT (SELECT size FROM log_state) - (SELECT size FROM log_tree)"
                       ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


# --- disputes --------------------------------------------------------------------------

class Disputer(threading.Thread):
    """Open a dispute every ``every`` seconds on the next recorded envelope, retrying."""

    def __init__(self, base_url: str, api_key: str, request_ids: list[str], every: float,
                 stop: threading.Event) -> None:
        super().__init__(daemon=True, name="disputer")
        self.client = httpx.Client(base_url=base_url, timeout=30,
                                   headers={"Authorization": f"Bearer {api_key}"})
        self.rids, self.every, self.stop = request_ids, every, stop
        self.opened: dict[str, str] = {}   # dispute id -> request_id
        self.retries = 0
        self.problems: list[str] = []

    def run(self) -> None:
        t0 = time.monotonic()
        for i, rid in enumerate(self.rids):
            if self.stop.wait(max(0.0, t0 + i * self.every - time.monotonic())):
                return
            attempt = 0
            while not self.stop.is_set():
                attempt += 1
                try:
                    r = self.client.post("/v1/disputes", headers={"Idempotency-Key": f"soak-{rid}"},
                                         json={"request_id": rid, "reason": "soak"})
                except httpx.TransportError as exc:
                    self.retries += 1
                    self.problems.append(f"dispute {rid}: {exc!r}")
                    time.sleep(backoff(attempt))
                    continue
                if r.status_code in (429, 503) or r.status_code >= 500:
                    self.retries += 1
                    if r.status_code >= 500 and r.status_code != 503:
                        self.problems.append(f"dispute {rid}: {r.status_code} {r.text[:200]}")
                    time.sleep(retry_after(r.headers.get("retry-after"), attempt))
                    continue
                if r.status_code in (200, 201):
                    self.opened[r.json()["id"]] = rid
                else:
                    self.problems.append(f"dispute {rid}: {r.status_code} {r.text[:200]}")
                break


def verdicts_between(conn: psycopg.Connection[Any], since: datetime, until: datetime
                     ) -> list[float]:
    """Open -> first verdict event, seconds, for verdicts logged in [since, until)."""
    rows = conn.execute(
        "SELECT extract(epoch FROM v.at - d.opened_at) FROM disputes d JOIN LATERAL "
        "(SELECT min(at) AS at FROM dispute_events e WHERE e.dispute_id = d.id "
        " AND e.kind = 'verdict') v ON true WHERE v.at >= %s AND v.at < %s",
        (since, until)).fetchall()
    return [float(r[0]) for r in rows]


# --- the run ---------------------------------------------------------------------------

def count_envelopes(conn: psycopg.Connection[Any], gateways: list[Gateway]
                    ) -> dict[str, Any]:
    """sent / acknowledged / stored / duplicates / lost over every client envelope."""
    acked: dict[str, int] = {}
    for gw in gateways:
        acked.update(gw.acked)
    stored: dict[str, int] = {}
    rows_stored = 0
    with conn.transaction(), conn.cursor(name="stored") as cur:
        cur.execute("SELECT request_id, log_index FROM envelopes WHERE request_id LIKE %s "
                    "OR request_id LIKE %s", ("cap-%", "soak-%"))
        for rid, idx in cur:
            rows_stored += 1
            stored.setdefault(rid, int(idx))
    duplicate_rows = rows_stored - len(stored)
    moved = sum(1 for rid, idx in acked.items() if rid in stored and stored[rid] != idx)
    conflicting = sum(len(gw.conflicting_acks) for gw in gateways)
    entries = conn.execute(
        "SELECT count(*), count(DISTINCT log_index) FROM envelopes").fetchone()
    assert entries is not None
    sent = sum(gw.sent_ids for gw in gateways)
    return {
        "sent": sent,
        "acknowledged": len(acked),
        "unacknowledged": sent - len(acked),
        "stored": rows_stored,
        "duplicates": duplicate_rows + moved + conflicting + (entries[0] - entries[1]),
        "lost": sum(1 for rid in acked if rid not in stored),
        "stored_unacknowledged": sum(1 for rid in stored if rid not in acked),
        "rejected": sum(m.rejected for gw in gateways for m in gw.minutes.values()),
    }


def count_verdicts(conn: psycopg.Connection[Any], opened: int) -> dict[str, Any]:
    rows = conn.execute(
        "SELECT (SELECT count(*) FROM dispute_events e WHERE e.dispute_id = d.id "
        "        AND e.kind = 'verdict'), "
        "       (SELECT count(*) FROM verdicts v WHERE v.job_id = d.job_id "
        "        AND v.request_id = d.request_id) FROM disputes d").fetchall()
    outcomes = dict(conn.execute(
        "SELECT v.outcome, count(*) FROM disputes d JOIN verdicts v ON v.job_id = d.job_id "
        "GROUP BY v.outcome").fetchall())
    lat = [float(r[0]) for r in conn.execute(
        "SELECT extract(epoch FROM min(e.at) - d.opened_at) FROM disputes d JOIN "
        "dispute_events e ON e.dispute_id = d.id AND e.kind = 'verdict' GROUP BY d.id")]
    return {"opened": opened, "disputes": len(rows),
            "exactly_one_verdict": sum(1 for a, b in rows if a == 1 and b == 1),
            "no_verdict": sum(1 for a, b in rows if a == 0 or b == 0),
            "more_than_one": sum(1 for a, b in rows if a > 1 or b > 1),
            "outcomes": outcomes, "latency_p50_s": pct(sorted(lat), 50),
            "latency_p99_s": pct(sorted(lat), 99), "latency_max_s": max(lat, default=0.0)}


def run_audit(env: dict[str, str]) -> tuple[bool, str]:
    from tests.helpers import REPO

    proc = subprocess.run([sys.executable, "-m", "ledger.cli.main", "audit"], cwd=REPO,
                          env={**os.environ, **env, "COLUMNS": "100"}, capture_output=True,
                          text=True, timeout=3600)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def growth(rows: list[dict[str, Any]]) -> tuple[int, dict[str, float]]:
    """RSS growth per process, %, from the end of the warm-up minute to the end."""
    ref = rows[min(WARMUP_MINUTES, len(rows) - 1) - 1] if len(rows) > 1 else rows[0]
    end = rows[-1]
    return ref["minute"], {p: 100 * (end["rss_mb"][p] / ref["rss_mb"][p] - 1)
                           if ref["rss_mb"][p] else float("nan") for p in PROCESSES}


@contextmanager
def terminated_on_sigterm() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every process started here is stopped."""
    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)


def measure_capacity(args: argparse.Namespace, gw: Gateway, batches: int) -> dict[str, Any]:
    """Closed loop from ``args.clients`` threads over the pre-signed pool."""
    next_k = iter(range(batches))
    lock = threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + args.capacity_seconds

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                k = next(next_k, None)
            if k is None:
                return
            gw.deliver(k, time.monotonic())

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    m = [x for x in gw.minutes.values()]
    acked = sum(x.acked for x in m)
    lat = sorted(s for x in m for s in x.batch_s)
    return {"envelopes_per_s": acked / wall, "seconds": wall, "acknowledged": acked,
            "pool_exhausted": acked >= batches * args.batch,
            "batch_p50_ms": pct(lat, 50) * 1000, "batch_p99_ms": pct(lat, 99) * 1000,
            "shed": sum(x.shed for x in m)}


def report(args: argparse.Namespace, host: str, conn: psycopg.Connection[Any],
           capacity: dict[str, Any], rate: float, gw: Gateway, cap_gw: Gateway,
           disputer: Disputer, rows: list[dict[str, Any]], headers: list[str],
           row_cells: Callable[[dict[str, Any]], list[object]], env: dict[str, str]) -> bool:
    counts = count_envelopes(conn, [cap_gw, gw])
    verdicts = count_verdicts(conn, len(disputer.opened))
    t_audit = time.monotonic()
    audit_ok, audit_out = run_audit(env)
    t_audit = time.monotonic() - t_audit
    size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    counts["database_mb"] = round(size[0] / 2**20) if size else -1
    ref_minute, grow = growth(rows)
    soak_lat = sorted(s for m in gw.minutes.values() for s in m.batch_s)
    soak_acked = sum(m.acked for m in gw.minutes.values())
    print()
    print(f"machine: {host}")
    print(f"capacity {capacity['envelopes_per_s']:,.1f} envelopes/s "
          f"({capacity['seconds']:.0f} s, {args.clients} clients); soak at {rate:,.1f}/s "
          f"for {args.minutes} min, batches of {args.batch}, a dispute every "
          f"{args.dispute_every:g} s, one tiny-demo worker")
    print(table(headers, [row_cells(r) for r in rows]))
    print(f"soak overall: {soak_acked / (args.minutes * 60):,.1f} acknowledged/s, batch p50 "
          f"{pct(soak_lat, 50) * 1000:.0f} ms, p99 {pct(soak_lat, 99) * 1000:.0f} ms, "
          f"max {max(soak_lat, default=0) * 1000:.0f} ms")
    print()
    print(table(["envelopes (capacity + soak)", "count"], list(counts.items())))
    print(table(["disputes", "value"], list(verdicts.items())))
    print(table(["process", f"RSS MB end of min {ref_minute}", "RSS MB end", "growth %"],
                [[p, rows[ref_minute - 1]["rss_mb"][p], rows[-1]["rss_mb"][p],
                  f"{grow[p]:+.1f}"] for p in PROCESSES]))
    print(f"ledger audit: {'OK' if audit_ok else 'FAILED'} ({t_audit:.0f} s)")
    print("\n".join(audit_out.splitlines()[-12:]))
    problems = cap_gw.problems + gw.problems + disputer.problems
    if problems:
        print(f"client notes ({len(problems)}, first 10):")
        print("\n".join(problems[:10]))
    exited = rows[-1]["exited"] if rows else {}
    if exited:
        print(f"processes that exited during the soak (name: exit status): {exited}")
    ok = (counts["lost"] == 0 and counts["duplicates"] == 0 and audit_ok
          and counts["unacknowledged"] == 0 and not exited
          and verdicts["exactly_one_verdict"] == verdicts["disputes"] == verdicts["opened"])
    print("PASS" if ok else "FAIL")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": host, "args": vars(args), "capacity": capacity, "rate": rate,
            "minutes": rows, "counts": counts, "disputes": verdicts,
            "rss_growth_pct": {"from_minute": ref_minute, **grow}, "audit_ok": audit_ok,
            "client_notes": problems[:50]}, indent=1, default=str))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=int, default=30)
    ap.add_argument("--rate", type=float, help="envelopes/s for the soak (default: half "
                    "the measured capacity)")
    ap.add_argument("--batch", type=int, default=100, help="envelopes per request")
    ap.add_argument("--clients", type=int, default=4, help="connections, capacity phase")
    ap.add_argument("--capacity-seconds", type=float, default=60)
    ap.add_argument("--capacity-envelopes", type=int, default=100_000,
                    help="pre-signed pool for the capacity phase")
    ap.add_argument("--signers", type=int, default=2, help="signing processes")
    ap.add_argument("--dispute-every", type=float, default=2.0, help="seconds")
    ap.add_argument("--json", type=Path, help="write the per-minute data here")
    args = ap.parse_args()

    from ledger.core.keys import private_pem
    from tests.replay.conftest import record
    from tests.replay.stack import replay_stack
    from workers.engine import load_engine

    host = machine()
    print(f"machine: {host}")
    tmp = Path(tempfile.mkdtemp(prefix="ledger-soak-"))
    pool = tmp / "pool"
    pool.mkdir()
    signers: list[Any] = []
    stop = threading.Event()
    ok = False
    try:
        with terminated_on_sigterm(), scratch_database("ledger_soak") as url, \
                replay_stack(url, tmp) as stack:
            dbname = url.rsplit("/", 1)[1]
            pg_url = url.replace("+psycopg", "")
            conn = psycopg.connect(pg_url, autocommit=True)
            pem = private_pem(stack.producer)
            cap_batches = math.ceil(args.capacity_envelopes / args.batch)
            signers = start_signers(args.signers, pem, pool, "cap", cap_batches, args.batch)

            n_disputes = int(args.minutes * 60 / args.dispute_every) + 2
            print(f"recording {n_disputes} envelopes with the reference engine; pre-signing "
                  f"{cap_batches * args.batch:,} envelopes (512/128 tokens) ...", flush=True)
            recs = record(load_engine("tiny-demo"), stack.producer, n_disputes, seed=7,
                          prefix="soakdispute", max_tokens=12)
            with stack.client("ingester") as c:
                for i in range(0, len(recs), 200):
                    r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 60},
                               json={"envelopes": [x.envelope for x in recs[i:i + 200]]})
                    assert r.status_code == 200 and r.json()["created"] == len(
                        recs[i:i + 200]), r.text[:500]
            worker = stack.worker("worker-a.pem")
            with stack.client("reviewer") as c:
                stack.wait_for(lambda: any(w["live"] for w in c.get("/v1/workers").json()),
                               180, "the worker")
            for p in signers:
                p.join()
            assert all(p.exitcode == 0 for p in signers), "a signer failed"
            procs = {"api": stack.procs[0], "beat": stack.procs[1], "worker": worker,
                     "redis": stack.redis.proc}
            pids = {name: p.pid for name, p in procs.items() if p is not None}

            # 1. capacity
            cap_gw = Gateway(stack.api_url, stack.keys["ingester"], pool, "cap", args.batch,
                             stop)
            print(f"measuring ingest capacity for {args.capacity_seconds:.0f} s "
                  f"({args.clients} clients, batches of {args.batch}) ...", flush=True)
            capacity = measure_capacity(args, cap_gw, cap_batches)
            print(f"capacity: {capacity['envelopes_per_s']:,.0f} envelopes/s over "
                  f"{capacity['seconds']:.0f} s (batch p50 {capacity['batch_p50_ms']:.0f} ms, "
                  f"p99 {capacity['batch_p99_ms']:.0f} ms, {capacity['shed']} shed)"
                  + (" - pool exhausted" if capacity["pool_exhausted"] else ""), flush=True)
            wait_until(lambda: integration_lag(conn) == 0, 300, "integration")
            for f in pool.glob("cap-*.json"):
                f.unlink()

            # 2. soak
            rate = args.rate or capacity["envelopes_per_s"] / 2
            interval = args.batch / rate
            n_batches = max(1, round(args.minutes * 60 / interval))
            consumed = mp.get_context("spawn").Value("q", 0)
            ahead = max(4, math.ceil(30 / interval))
            signers = start_signers(args.signers, pem, pool, "soak", n_batches, args.batch,
                                    consumed, ahead)
            wait_until(lambda: len(list(pool.glob("soak-*.json"))) >= min(ahead, n_batches),
                       300, "the signers")
            print(f"soak: {rate:,.1f} envelopes/s (a batch of {args.batch} every "
                  f"{interval:.3f} s) for {args.minutes} min, a dispute every "
                  f"{args.dispute_every:g} s", flush=True)
            gw = Gateway(stack.api_url, stack.keys["ingester"], pool, "soak", args.batch, stop)
            dispute_stop = threading.Event()
            disputer = Disputer(stack.api_url, stack.keys["reviewer"],
                                [r.request_id for r in recs], args.dispute_every, dispute_stop)
            rows: list[dict[str, Any]] = []
            headers = ["min", "sent/s", "acked/s", "p50 batch ms", "p99 batch ms",
                       "p99 request ms", "503", "retry", "late", "verdicts", "p99 dispute s",
                       "integ lag", "api MB", "beat MB", "worker MB", "redis MB", "pg MB (n)",
                       "pg anon MB"]

            def row_cells(r: dict[str, Any]) -> list[object]:
                return [r["minute"], r["sent"] / 60, r["acked"] / 60, r["batch_p50_ms"],
                        r["batch_p99_ms"], r["request_p99_ms"], r["shed"], r["retries"],
                        r["late"], r["verdicts"], r["dispute_p99_s"], r["integration_lag"],
                        r["rss_mb"]["api"], r["rss_mb"]["beat"], r["rss_mb"]["worker"],
                        r["rss_mb"]["redis"],
                        f"{r['rss_mb']['postgres']:.1f} ({r['rss_mb']['pg_backends']})",
                        r["rss_mb"]["postgres_anon"]]

            def monitor() -> None:
                mconn = psycopg.connect(pg_url, autocommit=True)
                since = datetime.now(UTC)
                for m in range(args.minutes):
                    if stop.wait(max(0.0, gw.t0 + 60 * (m + 1) - time.monotonic())):
                        return
                    until = datetime.now(UTC)
                    rss = sample_rss(pids, mconn, dbname,
                                     {conn.info.backend_pid, mconn.info.backend_pid})
                    lag = integration_lag(mconn)
                    dlat = verdicts_between(mconn, since, until)
                    since = until
                    time.sleep(1)  # answers for this minute that are still being counted
                    with gw.lock:
                        x = gw.minutes.get(m, Minute())
                        batch_s, request_s = list(x.batch_s), list(x.request_s)
                    row = {"minute": m + 1, "sent": x.sent, "acked": x.acked,
                           "batch_p50_ms": pct(batch_s, 50) * 1000,
                           "batch_p99_ms": pct(batch_s, 99) * 1000,
                           "request_p99_ms": pct(request_s, 99) * 1000, "shed": x.shed,
                           "retries": x.shed + x.transport_errors + x.server_errors,
                           "transport_errors": x.transport_errors,
                           "server_errors": x.server_errors, "rejected": x.rejected,
                           "late": x.late, "verdicts": len(dlat),
                           "dispute_p50_s": pct(dlat, 50), "dispute_p99_s": pct(dlat, 99),
                           "integration_lag": lag, "rss_mb": rss,
                           "exited": {n: p.poll() for n, p in procs.items()
                                      if p is not None and p.poll() is not None}}
                    rows.append(row)
                    if row["exited"]:
                        print(f"process exited (name: exit status): {row['exited']}", flush=True)
                    if m == 0:
                        print(table(headers, [row_cells(row)]), flush=True)
                    else:
                        print(table(headers, [row_cells(row)]).splitlines()[-1], flush=True)
                mconn.close()

            mon = threading.Thread(target=monitor, daemon=True, name="monitor")
            gw.t0 = time.monotonic()
            disputer.start()
            mon.start()
            with ThreadPoolExecutor(32, thread_name_prefix="gateway") as senders:
                try:
                    for k in range(n_batches):
                        due = gw.t0 + k * interval
                        time.sleep(max(0.0, due - time.monotonic()))
                        path = pool / f"{batch_name('soak', k)}.json"
                        while not path.exists():
                            time.sleep(0.01)
                        senders.submit(gw.deliver, k, due)
                        consumed.value = k + 1
                except BaseException:
                    stop.set()
                    senders.shutdown(wait=False, cancel_futures=True)
                    raise
                print("schedule done; waiting for the last answers ...", flush=True)
            mon.join()
            dispute_stop.set()
            disputer.join()
            wait_until(lambda: conn.execute(
                "SELECT count(*) FROM disputes d WHERE EXISTS (SELECT 1 FROM dispute_events e "
                "WHERE e.dispute_id = d.id AND e.kind = 'verdict')").fetchone()[0] >= len(
                    disputer.opened), 600, "the last verdicts")
            wait_until(lambda: integration_lag(conn) == 0, 600, "integration")
            ok = report(args, host, conn, capacity, rate, gw, cap_gw, disputer, rows,
                        headers, row_cells, stack.env)
            stop.set()
            conn.close()
    finally:
        stop.set()
        stop_all(signers)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
