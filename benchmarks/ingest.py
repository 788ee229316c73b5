"""Ingest throughput over HTTP to `ledger serve`, each figure next to a same-run baseline.

Two measurements, each at every client count given (default 4 and 16):

- **single**: every client posts one envelope per request (``POST /v1/envelopes``), the way a
  gateway fleet that records each request as it ends does. Baseline: the same DSSE bytes,
  one single-row ``INSERT`` + ``COMMIT`` per envelope into a bare table, from as many
  connections as there are clients.
- **batch**: every client posts batches (``POST /v1/envelopes/batch``). Baseline: psycopg
  ``COPY`` (binary) of the same DSSE bytes into a bare table from as many connections, one
  transaction per batch (and into a table whose bytea uses lz4, as ``envelopes.dsse`` does).

Envelopes carry 512 prompt and 128 output tokens (with per-step logprobs and logits
digests; ~18 KB), signed with Ed25519, fresh request IDs for every run. Clients are
separate processes with one HTTP connection (or one database connection) each. The ledger
and its baseline alternate within a round, rounds repeat; medians and ranges are printed.

    python benchmarks/ingest.py [--mode both|single|batch] [--clients 4,16]
                                [--single-envelopes 3000] [--envelopes 10000] [--batch 100]
                                [--workers 2] [--rounds 3] [--integrate]

With ``--integrate`` the servers also run the integrator (as in production), and the HTTP
batch figure counts an envelope only once it is in a signed checkpoint.

With ``--encryption`` a second server with a key-encryption key (``LEDGER_KEK_FILE``) runs
beside the first on the same database, and each batch round also ingests fresh envelopes
with a ``data_subject`` (one of 1,000) through it: stored encrypted under per-subject data
keys (docs/privacy.md). The table gives its ratio to the plain batch figure (issue 18).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, pct, scratch_database, table


def _sign_chunk(args: tuple[bytes, int, int]) -> list[bytes]:
    from ledger.core.keys import load_private_pem
    from ledger.producer import envelope_to_json, sign_statement
    from tests.helpers import statement

    producer_pem, n, subjects = args
    key = load_private_pem(producer_pem)

    def extra(i: int) -> dict[str, str]:
        return {"data_subject": f"subject-{i % subjects}"} if subjects else {}

    return [json.dumps(envelope_to_json(sign_statement(
        statement(prompt_len=512, output_len=128, **extra(i)), key)),
        separators=(",", ":")).encode() for i in range(n)]


def make_envelopes(n: int, producer_pem: bytes, subjects: int = 0) -> list[bytes]:
    """``n`` signed envelopes (JSON bytes, fresh request IDs), built on every core; with
    ``subjects``, each names one of that many data subjects."""
    chunks = [(producer_pem, min(500, n - i), subjects) for i in range(0, n, 500)]
    with mp.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        return [e for part in pool.map(_sign_chunk, chunks) for e in part]


def batch_bodies(envelopes: list[bytes], batch: int) -> list[bytes]:
    return [b'{"envelopes":[' + b",".join(envelopes[i:i + batch]) + b"]}"
            for i in range(0, len(envelopes), batch)]


# --- clients (one process each) -----------------------------------------------------------

def _http_single(args: tuple[str, str, list[bytes], mp.Queue]) -> None:
    base, api_key, bodies, out = args
    lat = []
    with httpx.Client(base_url=base, timeout=120,
                      headers={"Authorization": f"Bearer {api_key}",
                               "Content-Type": "application/json"}) as c:
        for body in bodies:
            t = time.perf_counter()
            r = c.post("/v1/envelopes", content=body)
            lat.append(time.perf_counter() - t)
            if r.status_code != 201:
                raise SystemExit(f"ingest failed: {r.status_code} {r.text[:300]}")
    out.put(lat)


def _lean_single(args: tuple[str, str, list[bytes], mp.Queue]) -> None:
    """The same requests from the standard library's ``http.client`` on one keep-alive
    connection: ~0.2 ms of client CPU per request against httpx's ~2 ms, closer to what the
    INSERT baseline's libpq client costs on the cores the server shares here."""
    import http.client
    from urllib.parse import urlsplit

    base, api_key, bodies, out = args
    where = urlsplit(base)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    lat = []
    try:
        for body in bodies:
            t = time.perf_counter()
            conn.request("POST", "/v1/envelopes", body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            lat.append(time.perf_counter() - t)
            if r.status != 201:
                raise SystemExit(f"ingest failed: {r.status} {data[:300]!r}")
    finally:
        conn.close()
    out.put(lat)


def _http_batch(args: tuple[str, str, list[bytes], mp.Queue]) -> None:
    base, api_key, bodies, out = args
    lat = []
    with httpx.Client(base_url=base, timeout=120,
                      headers={"Authorization": f"Bearer {api_key}",
                               "Content-Type": "application/json"}) as c:
        for body in bodies:
            t = time.perf_counter()
            r = c.post("/v1/envelopes/batch", content=body)
            lat.append(time.perf_counter() - t)
            if r.status_code != 200 or r.json()["created"] == 0:
                raise SystemExit(f"ingest failed: {r.status_code} {r.text[:300]}")
    out.put(lat)


def _insert_client(args: tuple[str, str, list[bytes], int, mp.Queue]) -> None:
    url, table_name, rows, offset, out = args
    lat = []
    with psycopg.connect(url) as conn:
        for i, body in enumerate(rows):
            t = time.perf_counter()
            conn.execute(f"INSERT INTO {table_name} (id, body) VALUES (%s, %s)",
                         (offset + i, body))
            conn.commit()
            lat.append(time.perf_counter() - t)
    out.put(lat)


def _copy_client(args: tuple[str, str, list[list[bytes]], int, mp.Queue]) -> None:
    url, table_name, batches, offset, out = args
    lat = []
    with psycopg.connect(url) as conn:
        i = offset
        for rows in batches:
            t = time.perf_counter()
            with conn.cursor() as cur, cur.copy(
                    f"COPY {table_name} (id, body) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(["int8", "bytea"])
                for body in rows:
                    copy.write_row((i, body))
                    i += 1
            conn.commit()
            lat.append(time.perf_counter() - t)
    out.put(lat)


def run_parallel(target: Callable[..., None], jobs: Sequence[tuple[Any, ...]]
                 ) -> tuple[float, list[float]]:
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=((*job, q),)) for job in jobs]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    lats = []
    for _ in procs:
        lats.extend(q.get())
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"client failed with exit code {p.exitcode}")
    return time.perf_counter() - t0, lats


@dataclass
class Run:
    rate: float                # envelopes per second
    latencies: list[float]     # per request, seconds


def summary(runs: list[Run]) -> tuple[float, str, float, float]:
    """(median rate, "lo - hi" range, p50 ms, p99 ms) over the rounds."""
    rates = sorted(r.rate for r in runs)
    lats = sorted(x for r in runs for x in r.latencies)
    spread = f"{rates[0]:,.0f} - {rates[-1]:,.0f}"
    return rates[len(rates) // 2], spread, pct(lats, 50) * 1000, pct(lats, 99) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("both", "single", "batch"), default="both")
    ap.add_argument("--clients", default="4,16", help="client counts, comma-separated")
    ap.add_argument("--single-envelopes", type=int, default=3000,
                    help="envelopes per single-envelope run")
    ap.add_argument("--envelopes", type=int, default=10_000, help="envelopes per batch run")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2, help="`ledger serve` processes")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--integrate", action="store_true",
                    help="run the integrator in the servers; batch runs time until integrated")
    ap.add_argument("--encryption", action="store_true",
                    help="batch rounds also ingest through a server with LEDGER_KEK_FILE")
    ap.add_argument("--client", choices=("httpx", "http.client"), default="httpx",
                    help="the single-envelope clients' HTTP library (see _lean_single)")
    ap.add_argument("--json", type=Path, help="also write results here")
    args = ap.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]
    modes = ("single", "batch") if args.mode == "both" else (args.mode,)

    from ledger.core.keys import generate_private_key, private_pem
    from tests.conftest import provision
    from tests.helpers import run_server

    print(f"machine: {machine()}")
    results: dict[tuple[str, int], list[Run]] = {}
    with scratch_database("bench_seq_ingest") as url:
        keys, producer = provision(url)
        pem = private_pem(producer)
        pg_url = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(pg_url, autocommit=True) as conn:
            # the baselines: bare tables with PostgreSQL's defaults (pglz); and one
            # with the storage envelopes.dsse uses (lz4), like for like
            conn.execute("CREATE TABLE bench_insert (id bigint, body bytea)")
            conn.execute("CREATE TABLE bench_copy (id bigint, body bytea)")
            conn.execute("CREATE TABLE bench_copy_lz4 (id bigint, body bytea COMPRESSION lz4)")
        extra_env = {}
        if args.integrate:
            key_file = Path(tempfile.mkdtemp()) / "log.pem"
            key_file.write_bytes(private_pem(generate_private_key()))
            extra_env = {"LEDGER_LOG_KEY_FILE": str(key_file)}
        offset = 0
        total = 0
        kek_file = Path(tempfile.mkdtemp()) / "kek"
        kek_file.write_bytes(os.urandom(32).hex().encode())
        with run_server(url, workers=args.workers, extra_env=extra_env) as server, \
                (run_server(url, workers=args.workers,
                            extra_env={**extra_env, "LEDGER_KEK_FILE": str(kek_file)})
                 if args.encryption else contextlib.nullcontext()) as enc_server:
            for rnd in range(args.rounds):
                for clients in client_counts:
                    for mode in modes:
                        n = args.single_envelopes if mode == "single" else args.envelopes
                        t = time.perf_counter()
                        envs = make_envelopes(n, pem)
                        print(f"  (built {n} envelopes in {time.perf_counter() - t:.0f} s)")
                        if mode == "single":
                            shards = [envs[i::clients] for i in range(clients)]
                            ledger = run_parallel(
                                _lean_single if args.client == "http.client" else _http_single, [
                                (server.base_url, keys["ingester"], s) for s in shards])
                            base = run_parallel(_insert_client, [
                                (pg_url, "bench_insert", s, offset + i * n)
                                for i, s in enumerate(shards)])
                            runs = {"single": ledger, "insert": base}
                        else:
                            bodies = batch_bodies(envs, args.batch)
                            t_start = time.perf_counter()
                            wall, lats = run_parallel(_http_batch, [
                                (server.base_url, keys["ingester"], bodies[i::clients])
                                for i in range(clients)])
                            if args.integrate:
                                wait_integrated(pg_url)
                                wall = time.perf_counter() - t_start
                            rows = _rows(envs, args.batch)
                            runs = {"batch": (wall, lats)}
                            for key, table_name in (("copy", "bench_copy"),
                                                    ("copy_lz4", "bench_copy_lz4")):
                                runs[key] = run_parallel(_copy_client, [
                                    (pg_url, table_name, rows[i::clients], offset + i * n)
                                    for i in range(clients)])
                            if enc_server is not None:  # issue 18: same run, sealed
                                sealed = batch_bodies(make_envelopes(n, pem, 1000),
                                                      args.batch)
                                runs["batch_enc"] = run_parallel(_http_batch, [
                                    (enc_server.base_url, keys["ingester"], sealed[i::clients])
                                    for i in range(clients)])
                                total += n
                        offset += 100 * n
                        total += n
                        line = []
                        for key, (wall, lats) in runs.items():
                            results.setdefault((key, clients), []).append(Run(n / wall, lats))
                            line.append(f"{key} {n / wall:,.0f}/s")
                        print(f"round {rnd + 1}, {clients} clients: " + ", ".join(line),
                              flush=True)
        with psycopg.connect(pg_url) as conn:
            stored = conn.execute("SELECT count(*), max(log_index) FROM envelopes").fetchone()
        assert stored is not None and stored[0] == total, (stored, total)
        assert stored[1] == stored[0] - 1, "log indices are not gap-free"

    print()
    print(f"single={args.single_envelopes} batch runs={args.envelopes} x {args.batch} "
          f"server workers={args.workers} rounds={args.rounds} "
          f"integrate={args.integrate} (medians; range over rounds)")
    rows_out: list[list[object]] = []
    out_json: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    labels = {"single": "ledger POST /v1/envelopes (one per request)",
              "insert": "baseline: single-row INSERT+COMMIT, same bytes, bare table",
              "batch": "ledger POST /v1/envelopes/batch" +
                       (" + integration" if args.integrate else ""),
              "batch_enc": "ledger POST /v1/envelopes/batch, encrypted at rest (KEK)",
              "copy": "baseline: COPY of same bytes, bare table",
              "copy_lz4": "baseline: COPY, bare table with lz4 (as envelopes)"}
    baseline_of = {"single": "insert", "batch": "copy", "batch_enc": "batch"}
    for clients in client_counts:
        for key in ("single", "insert", "batch", "batch_enc", "copy", "copy_lz4"):
            if (key, clients) not in results:
                continue
            med, spread, p50, p99 = summary(results[(key, clients)])
            ratio = "1"
            if key in baseline_of:
                base_runs = results[(baseline_of[key], clients)]
                ratios = sorted(a.rate / b.rate for a, b in
                                zip(results[(key, clients)], base_runs, strict=True))
                ratio = f"{ratios[len(ratios) // 2]:.3f} ({ratios[0]:.3f} - {ratios[-1]:.3f})"
            rows_out.append([clients, labels[key], med, spread, p50, p99, ratio])
            out_json[f"{key}@{clients}"] = {"median": med, "range": spread, "p50_ms": p50,
                                            "p99_ms": p99, "ratio": ratio}
    print(table(["clients", "method", "envelopes/s", "range", "p50 ms/request",
                 "p99 ms/request", "ratio to same-run baseline (median, range)"], rows_out))
    if "single" in modes and len(client_counts) > 1:
        lo, hi = min(client_counts), max(client_counts)
        per_round = [b.rate / a.rate for a, b in zip(results[("single", lo)],
                                                      results[("single", hi)], strict=True)]
        print(f"single-envelope throughput at {hi} clients / at {lo}, per round: " +
              ", ".join(f"{x:.2f}" for x in per_round))
        out_json["single_scaling"] = per_round
    if args.json:
        args.json.write_text(json.dumps(out_json, default=str))


def _rows(envs: list[bytes], batch: int) -> list[list[bytes]]:
    """The DSSE bytes the ledger stores (compact JSON), per batch."""
    return [envs[i:i + batch] for i in range(0, len(envs), batch)]


def wait_integrated(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        while True:
            row = conn.execute("SELECT (SELECT size FROM log_tree), "
                               "(SELECT size FROM log_state)").fetchone()
            if row is not None and row[0] == row[1]:
                return
            time.sleep(0.01)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
