"""Transparency-log benchmark on PostgreSQL.

1. integration throughput: N synthetic entries (default 1,000,000) sequenced with COPY,
   then folded into the tree by the integrator (batches of 20,000, a signed checkpoint per
   batch); baseline in the same run: recomputing the root from all leaf hashes in memory;
2. inclusion and consistency proof latency at that size, in-process (from the tiles in
   Postgres) and over HTTP (`ledger serve`), p50/p99 over random indices;
3. offline verification rate of an exported bundle of real signed envelopes (512 prompt /
   128 output tokens) with `ledger verify`.

The end-to-end ingest figure with integration on is `benchmarks/ingest.py --integrate`.

    python benchmarks/log.py [--entries 1000000] [--samples 2000] [--bundle 5000]
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
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, pct, scratch_database, table


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--bundle", type=int, default=5000, help="envelopes in the verify bundle")
    args = ap.parse_args()

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
    print()
    print(f"log of {args.entries:,} entries; {args.samples} samples per latency")
    print(table(["measurement", "per second", "", ""], rows))
    del leaf_hash


if __name__ == "__main__":
    main()
