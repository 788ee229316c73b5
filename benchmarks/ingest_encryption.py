"""Ingest throughput: batch ingest over HTTP to `ledger serve` vs a psycopg COPY baseline.

Envelopes carry 512 prompt and 128 output tokens (with per-step logprobs and logits
digests), signed with Ed25519. Clients are separate processes, each with its own HTTP
connection, posting pre-built batch bodies. The baseline, measured in the same run on the
same PostgreSQL, COPYs the same DSSE bytes into a bare table from the same number of
connections, one transaction per batch.

    python benchmarks/ingest.py [--envelopes 20000] [--batch 100] [--clients 4] [--workers 2]
                                [--integrate]

With ``--integrate`` the servers also run the integrator (as in production), and the HTTP
figure counts an envelope only once it is in a signed checkpoint.

With ``--encryption`` a second server with a key-encryption key (``LEDGER_KEK_FILE``) runs
beside the first on the same database, and each round ingests fresh envelopes through
both, alternating: envelopes with a ``data_subject`` (one of 1,000) are stored encrypted
under per-subject data keys (docs/privacy.md). The table gives its ratio to the plain one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, pct, scratch_database, table


def make_bodies(n: int, batch: int, producer_pem: bytes, subjects: int = 0) -> list[bytes]:
    from ledger.core.keys import load_private_pem
    from ledger.producer import envelope_to_json, sign_statement
    from tests.helpers import statement

    key = load_private_pem(producer_pem)
    bodies = []
    for start in range(0, n, batch):
        extra = ({"data_subject": f"subject-{start // batch % subjects}"} if subjects
                 else {})
        envs = [envelope_to_json(sign_statement(statement(prompt_len=512, output_len=128,
                                                          **extra), key))
                for _ in range(min(batch, n - start))]
        bodies.append(json.dumps({"envelopes": envs}).encode())
    return bodies


def _http_client(args: tuple[str, str, list[bytes], mp.Queue]) -> None:
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


def run_parallel(target, jobs) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envelopes", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="`ledger serve` processes")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    ap.add_argument("--integrate", action="store_true",
                    help="run the integrator in the servers; time until integrated")
    ap.add_argument("--encryption", action="store_true",
                    help="also ingest through a server with LEDGER_KEK_FILE (same run)")
    ap.add_argument("--json", type=Path, help="also write results here")
    args = ap.parse_args()

    from ledger.core.keys import generate_private_key, private_pem
    from tests.conftest import provision
    from tests.helpers import run_server

    print(f"machine: {machine()}")
    print(f"building {args.envelopes} signed envelopes (512 prompt / 128 output tokens) ...")
    with scratch_database() as url:
        keys, producer = provision(url)
        bodies = make_bodies(args.envelopes, args.batch, private_pem(producer))
        dsse_rows = [[json.dumps(e, separators=(",", ":")).encode()
                      for e in json.loads(b)["envelopes"]] for b in bodies]
        mb = sum(len(b) for b in bodies) / 1e6
        print(f"{len(bodies)} batches, {mb:.1f} MB of request bodies")
        pg_url = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(pg_url, autocommit=True) as conn:
            # the baseline of the issue: a bare table with PostgreSQL's defaults (pglz);
            # and one with the storage envelopes.dsse uses (lz4), like for like
            conn.execute("CREATE TABLE bench_copy (id bigint, body bytea)")
            conn.execute("CREATE TABLE bench_copy_lz4 (id bigint, body bytea COMPRESSION lz4)")
        results: dict[str, list[tuple[float, list[float]]]] = {"http": [], "copy": [],
                                                               "copy_lz4": [], "http_enc": []}
        extra_env = {}
        if args.integrate:
            import tempfile

            key_file = Path(tempfile.mkdtemp()) / "log.pem"
            key_file.write_bytes(private_pem(generate_private_key()))
            extra_env = {"LEDGER_LOG_KEY_FILE": str(key_file)}
        import contextlib
        import tempfile

        kek_file = Path(tempfile.mkdtemp()) / "kek"
        kek_file.write_bytes(os.urandom(32).hex().encode())
        with run_server(url, workers=args.workers, extra_env=extra_env) as server, \
                (run_server(url, workers=args.workers,
                            extra_env={**extra_env, "LEDGER_KEK_FILE": str(kek_file)})
                 if args.encryption else contextlib.nullcontext()) as enc_server:
            for rnd in range(args.rounds):
                # fresh request IDs each round: re-sign with new IDs would be slow, so
                # the HTTP rounds after the first use a new database state via TRUNCATE-free
                # approach: we rebuild bodies per round (cheap relative to the run).
                if rnd:
                    bodies = make_bodies(args.envelopes, args.batch, private_pem(producer))
                shards = [bodies[i::args.clients] for i in range(args.clients)]
                t_start = time.perf_counter()
                wall, lats = run_parallel(_http_client,
                                          [(server.base_url, keys["ingester"], s) for s in shards])
                if args.integrate:
                    with psycopg.connect(pg_url, autocommit=True) as conn:
                        while True:
                            row = conn.execute("SELECT (SELECT size FROM log_tree), "
                                               "(SELECT size FROM log_state)").fetchone()
                            if row[0] == row[1]:
                                break
                            time.sleep(0.01)
                    wall = time.perf_counter() - t_start
                results["http"].append((wall, lats))
                if enc_server is not None:
                    enc_bodies = make_bodies(args.envelopes, args.batch, private_pem(producer),
                                             subjects=1000)
                    enc_shards = [enc_bodies[i::args.clients] for i in range(args.clients)]
                    results["http_enc"].append(run_parallel(
                        _http_client, [(enc_server.base_url, keys["ingester"], s)
                                       for s in enc_shards]))
                row_shards = [dsse_rows[i::args.clients] for i in range(args.clients)]
                offset = rnd * 10 * args.envelopes
                rates = []
                for key, table_name in (("copy", "bench_copy"), ("copy_lz4", "bench_copy_lz4")):
                    wall_c, lats_c = run_parallel(
                        _copy_client, [(pg_url, table_name, s, offset + i * args.envelopes)
                                       for i, s in enumerate(row_shards)])
                    results[key].append((wall_c, lats_c))
                    rates.append(args.envelopes / wall_c)
                enc = (f"http encrypted {args.envelopes / results['http_enc'][-1][0]:,.0f}/s, "
                       if enc_server is not None else "")
                print(f"round {rnd + 1}: http {args.envelopes / wall:,.0f}/s, {enc}"
                      f"copy {rates[0]:,.0f}/s, copy lz4 {rates[1]:,.0f}/s")
        with psycopg.connect(pg_url) as conn:
            stored = conn.execute("SELECT count(*), max(log_index) FROM envelopes").fetchone()
        servers = 2 if args.encryption else 1
        assert stored is not None and stored[0] == args.envelopes * args.rounds * servers
        assert stored[1] == stored[0] - 1, "log indices are not gap-free"

    def summary(name: str) -> tuple[float, float, float]:
        rates = sorted(args.envelopes / w for w, _ in results[name])
        lats = sorted(x for _, ls in results[name] for x in ls)
        return rates[len(rates) // 2], pct(lats, 50) * 1000, pct(lats, 99) * 1000

    http = summary("http")
    copy = summary("copy")
    lz4 = summary("copy_lz4")
    label = "ledger HTTP batch ingest" + (" + integration" if args.integrate else "")
    rows = [
        [label, http[0], http[1], http[2], f"{http[0] / copy[0]:.3f} / {http[0] / lz4[0]:.3f}"],
        *([["ledger HTTP batch ingest, encrypted at rest (LEDGER_KEK_FILE)",
            *summary("http_enc"), f"{summary('http_enc')[0] / http[0]:.3f} of plain HTTP"]]
          if args.encryption else []),
        ["baseline: psycopg COPY of same bytes, bare table", copy[0], copy[1], copy[2], "1"],
        ["baseline: same, bare table with lz4 (as envelopes)", lz4[0], lz4[1], lz4[2], "1"],
    ]
    print()
    print(f"envelopes={args.envelopes} batch={args.batch} clients={args.clients} "
          f"server workers={args.workers} rounds={args.rounds} (medians)")
    print(table(["method", "envelopes/s", "p50 batch ms", "p99 batch ms",
                 "ratio to COPY (bare / lz4)"], rows))
    if args.json:
        args.json.write_text(json.dumps({"http": http, "copy": copy, "copy_lz4": lz4,
                                         "args": vars(args)},
                                        default=str))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
