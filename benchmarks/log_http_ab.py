"""The log's read routes over HTTP, two code trees side by side on one log.

Two ``ledger serve`` processes on the same database (a log kept by ``benchmarks/log.py
--only-proofs --audit-db NAME``): one from ``--before`` (a tree with ``ledger/``, e.g.
``git archive <commit> ledger | tar -x -C DIR``), one from this checkout. Each is sent a
proof in every full tile first (the steady state), then ``GET /healthz``,
``/v1/log/checkpoint``, ``/v1/log/proof`` and ``/v1/log/consistency`` in rounds, the same
target to both servers one after the other (so load changes hit both alike), over
keep-alive ``http.client`` connections; p50/p99 per route and server CPU per request.

    python benchmarks/log_http_ab.py --before DIR --db NAME [--entries 1000000] [--rounds 1500]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from contextlib import ExitStack
from http.client import HTTPConnection
from pathlib import Path
from urllib.parse import urlsplit

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ADMIN_PG, machine, pct, table

AUDIT_ORIGIN = "bench.example/audit"  # benchmarks/log.py's audit log


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    import tests.helpers as helpers
    from tests.conftest import provision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a tree holding ledger/")
    ap.add_argument("--db", required=True, help="database of a kept audit log")
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=1500)
    args = ap.parse_args()
    pg = ADMIN_PG.rsplit("/", 1)[0] + f"/{args.db}"
    url = pg.replace("postgresql://", "postgresql+psycopg://", 1)
    with psycopg.connect(pg) as conn:  # a kept log: last run's API keys go
        conn.execute("UPDATE api_keys SET revoked_at = now() "
                     "WHERE name LIKE 'test-%%' AND revoked_at IS NULL")
    keys, _ = provision(url)
    auth = {"Authorization": f"Bearer {keys['reviewer']}"}
    n = args.entries
    trees = {"before": args.before.resolve(), "after": Path(__file__).resolve().parent.parent}
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}")
    with ExitStack() as stack:
        servers = {}
        for name, root in trees.items():
            helpers.REPO = root  # `python -m ledger.cli.main` runs in the tree's root
            srv = stack.enter_context(helpers.run_server(url, extra_env={
                "LEDGER_LOG_NAME": AUDIT_ORIGIN, "LEDGER_METRICS_PORT": "0",
                "PYTHONPATH": str(root)}))
            servers[name] = (srv, HTTPConnection("127.0.0.1", urlsplit(srv.base_url).port,
                                                 timeout=30))

        def get(conn: HTTPConnection, target: str) -> None:
            conn.request("GET", target, headers=auth)
            answer = conn.getresponse()
            body = answer.read()
            assert answer.status == 200, body[:300]

        for tile in range(n >> 8):
            for _, conn in servers.values():
                get(conn, f"/v1/log/proof?index={tile << 8}")
        rng = random.Random(11)
        routes = (("/healthz", lambda: "/healthz"),
                  ("/v1/log/checkpoint", lambda: "/v1/log/checkpoint"),
                  ("/v1/log/proof", lambda: f"/v1/log/proof?index={rng.randrange(n)}"),
                  ("/v1/log/consistency",
                   lambda: f"/v1/log/consistency?from={rng.randrange(1, n)}"))
        lat: dict[tuple[str, str], list[float]] = {}
        start = {name: _cpu_s(srv.process.pid) for name, (srv, _) in servers.items()}
        for _ in range(args.rounds):
            for route, make in routes:
                target = make()
                for name, (_, conn) in servers.items():
                    t = time.perf_counter()
                    get(conn, target)
                    lat.setdefault((name, route), []).append(time.perf_counter() - t)
        used = {name: _cpu_s(srv.process.pid) - start[name]
                for name, (srv, _) in servers.items()}
    print(f"load average {os.getloadavg()[0]:.2f}")
    rows: list[list[object]] = []
    for route, _ in routes:
        b, a = lat[("before", route)], lat[("after", route)]
        rows.append([route, f"{pct(b, 50) * 1e3:.3f} / {pct(b, 99) * 1e3:.3f} ms",
                     f"{pct(a, 50) * 1e3:.3f} / {pct(a, 99) * 1e3:.3f} ms",
                     f"x{pct(a, 50) / pct(b, 50):.2f}"])
    count = args.rounds * len(routes)
    rows.append(["server CPU per request (mean of the four)",
                 f"{used['before'] / count * 1e6:.0f} us",
                 f"{used['after'] / count * 1e6:.0f} us",
                 f"x{used['after'] / used['before']:.2f}"])
    print(table(["route", "before p50 / p99", "after p50 / p99", "after / before (p50)"],
                rows))


if __name__ == "__main__":
    main()
