"""Server CPU per ingest request: `ledger serve --workers 1`, CPU time of its process tree.

Throughput on a shared machine moves with the other jobs; the CPU the server spends per
request (user + system, all its threads) moves much less, so this is the figure to
compare code changes by (issue 17: the ingest path is CPU-bound). Prints ms of server CPU
per single-envelope POST and per batch item, and with ``--py-spy FILE`` records a
py-spy profile (``--format raw``, collapsed stacks) of the single-envelope phase.

    python benchmarks/ingest_cpu.py --single 600 --batch-items 2000 --clients 8

With ``--compare DIR`` (another checkout, e.g. ``git archive HEAD~1 | tar -x -C DIR``) a
second server runs DIR's code on the same database, and ``--rounds`` single-envelope
phases alternate between the two (order flipped each round): code changes compared on
the same machine, at the same time. Each phase also prints the PostgreSQL CPU it cost
(the benchmark database's backends that stay connected) and the database sessions it
opened.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, scratch_database
from benchmarks.ingest import (
    _http_batch,
    _http_single,
    _lean_single,
    batch_bodies,
    make_envelopes,
    run_parallel,
)


def tree_cpu(pid: int) -> float:
    """User + system seconds of ``pid`` and its children."""
    return sum(tree_cpu_split(pid))


def tree_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) seconds of ``pid`` and its children."""
    root = psutil.Process(pid)
    user = system = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        user, system = user + t.user, system + t.system
    return user, system


def pg_cpu(pg_url: str, dbname: str) -> tuple[float, int]:
    """(CPU seconds of the backends now connected to ``dbname``, sessions opened on it so
    far, this call's own not counted): deltas between two calls are a phase's PostgreSQL
    cost. A backend that exited between the calls is not counted (its sessions are)."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,))]
        row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s",
                           (dbname,)).fetchone()
    cpu = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        cpu += t.user + t.system
    return cpu, int(row[0]) - 1 if row else 0


def compare(args: argparse.Namespace, url: str, keys: dict[str, str], pem: bytes) -> None:
    """Alternate single-envelope phases between this tree's server and ``args.compare``'s."""
    from tests.helpers import run_server

    pg_url = url.replace("postgresql+psycopg://", "postgresql://")
    dbname = url.rsplit("/", 1)[1]
    trees = {"this": Path(__file__).resolve().parent.parent, "compare": args.compare}
    got: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in trees}
    with run_server(url, workers=1, cwd=trees["this"]) as this, \
            run_server(url, workers=1, cwd=trees["compare"],
                       extra_env={"PYTHONPATH": str(trees["compare"])}) as other:
        servers = {"this": this, "compare": other}
        for server in servers.values():  # warm up: imports, pools, caches
            run_parallel(_http_single, [(server.base_url, keys["ingester"],
                                         make_envelopes(50, pem))])
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for name in order:
                server = servers[name]
                envs = make_envelopes(args.single, pem)
                c0, (p0, s0) = tree_cpu(server.process.pid), pg_cpu(pg_url, dbname)
                wall, _ = run_parallel(_lean_single, [
                    (server.base_url, keys["ingester"], envs[i::args.clients])
                    for i in range(args.clients)])
                c1, (p1, s1) = tree_cpu(server.process.pid), pg_cpu(pg_url, dbname)
                n = args.single
                got[name].append((1000 * (c1 - c0) / n, 1000 * (p1 - p0) / n,
                                  (s1 - s0) / n, n / wall))
                print(f"round {rnd + 1} {name:8}: {n / wall:6,.0f}/s, server CPU "
                      f"{got[name][-1][0]:.3f} ms/POST, PostgreSQL CPU {got[name][-1][1]:.3f} "
                      f"ms/POST, sessions opened {s1 - s0}", flush=True)
    ratios = sorted(a[0] / b[0] for a, b in zip(got["this"], got["compare"], strict=True))
    print("server CPU per POST, this / compare, per round (paired, sorted): " +
          ", ".join(f"{r:.3f}" for r in ratios) + f"; median {ratios[len(ratios) // 2]:.3f}")
    for name, rows in got.items():
        cols = list(zip(*rows, strict=True))
        med = [sorted(c)[len(c) // 2] for c in cols]
        print(f"{name:8} (medians over {len(rows)} rounds): server {med[0]:.3f} ms/POST "
              f"({min(cols[0]):.3f}-{max(cols[0]):.3f}), PostgreSQL {med[1]:.3f} "
              f"({min(cols[1]):.3f}-{max(cols[1]):.3f}), sessions/POST {med[2]:.4f}, "
              f"{med[3]:,.0f}/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--single", type=int, default=600, help="single-envelope POSTs")
    ap.add_argument("--batch-items", type=int, default=2000, help="envelopes in batches")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--py-spy", type=Path, help="record the single phase to this file")
    ap.add_argument("--py-spy-rate", type=int, default=200, help="samples per second")
    ap.add_argument("--py-spy-gil", action=argparse.BooleanOptionalAction, default=True,
                    help="sample only the thread holding the GIL (--no-py-spy-gil: all)")
    ap.add_argument("--compare", type=Path,
                    help="another checkout: alternate single phases between its server "
                         "and this tree's (http.client clients)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (--compare)")
    args = ap.parse_args()

    from ledger.core.keys import private_pem
    from tests.conftest import provision
    from tests.helpers import run_server

    print(f"machine: {machine()}")
    with scratch_database("bench_ingest_cpu") as url:
        keys, producer = provision(url)
        pem = private_pem(producer)
        if args.compare:
            compare(args, url, keys, pem)
            return
        singles = make_envelopes(args.single + 50, pem)
        batches = batch_bodies(make_envelopes(args.batch_items, pem), args.batch)
        with run_server(url, workers=1) as server:
            pid = server.process.pid
            # warm up: imports, pools, caches
            run_parallel(_http_single, [(server.base_url, keys["ingester"], singles[:50])])
            spy = None
            if args.py_spy:
                spy = subprocess.Popen(
                    [shutil.which("py-spy") or "py-spy", "record", "--subprocesses",
                     "--format", "raw", "--rate", str(args.py_spy_rate),
                     *(["--gil"] if args.py_spy_gil else []),
                     "-o", str(args.py_spy), "--pid", str(pid)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            u0, s0 = tree_cpu_split(pid)
            wall, _ = run_parallel(_http_single, [
                (server.base_url, keys["ingester"], singles[50 + i::args.clients])
                for i in range(args.clients)])
            u1, s1 = tree_cpu_split(pid)
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            n = args.single
            print(f"single: {n} POSTs, {args.clients} clients, {n / wall:,.0f}/s, "
                  f"server CPU {1000 * (u1 + s1 - u0 - s0) / n:.2f} ms per request "
                  f"(user {1000 * (u1 - u0) / n:.2f}, system {1000 * (s1 - s0) / n:.2f})")
            if batches:
                c0 = tree_cpu(pid)
                wall, _ = run_parallel(_http_batch, [
                    (server.base_url, keys["ingester"], batches[i::args.clients])
                    for i in range(args.clients)])
                c1 = tree_cpu(pid)
                n = args.batch_items
                print(f"batch: {n} envelopes in batches of {args.batch}, {n / wall:,.0f}/s, "
                      f"server CPU {1000 * (c1 - c0) / n:.3f} ms per item")


if __name__ == "__main__":
    main()
