"""Replay throughput on CPU with tiny-demo, end to end through real processes.

1. disputes per minute: disputes opened over the API, routed to `replay.<fp>` on Redis,
   replayed by one `ledger worker`, verdicts signed and logged (open -> verdict latency);
2. batched jobs of 32 envelopes against one envelope per job, in the same run: envelope
   verdicts per second through the same worker.

    python benchmarks/replay.py [--disputes 64] [--envelopes 128]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import machine, pct, scratch_database, table


def wait_all(pg_url: str, sql: str, params: tuple[object, ...], want: int,
             timeout: float = 900) -> float:
    start = time.perf_counter()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        while True:
            have = conn.execute(sql, params).fetchone()[0]
            if have >= want:
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                raise SystemExit(f"timed out: {have}/{want}")
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--disputes", type=int, default=64)
    ap.add_argument("--envelopes", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    from ledger.db.session import make_engine, session_scope
    from ledger.replay import jobs
    from ledger.replay.broker import CeleryPublisher
    from ledger.settings import Settings
    from tests.replay.conftest import record
    from tests.replay.stack import replay_stack
    from workers.engine import load_engine

    print(f"machine: {machine()}")
    engine = load_engine("tiny-demo")
    rows = []
    with scratch_database("ledger_replaybench") as url, \
            replay_stack(url, Path(tempfile.mkdtemp(prefix="ledger-replaybench-"))) as stack:
        pg_url = url.replace("+psycopg", "")
        total = args.disputes + 2 * args.envelopes
        recs = record(engine, stack.producer, total, seed=5, prefix="bench",
                      max_tokens=args.max_tokens)
        with stack.client("ingester") as c:
            for i in range(0, len(recs), 200):
                r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 60},
                           json={"envelopes": [x.envelope for x in recs[i:i + 200]]})
                assert r.status_code == 200, r.text
        stack.worker("worker-a.pem")
        stack.wait_for(lambda: stack.client("reviewer").get("/v1/workers").json()
                       and any(w["live"] for w in stack.client("reviewer").get(
                           "/v1/workers").json()), 120, "the worker")

        # 1. disputes per minute
        disputed = recs[:args.disputes]
        opened: dict[str, float] = {}
        t0 = time.perf_counter()

        def open_one(rid: str) -> None:
            with stack.client("reviewer") as c:
                r = c.post("/v1/disputes", json={"request_id": rid, "reason": "benchmark"})
                assert r.status_code == 201, r.text
                opened[r.json()["id"]] = time.perf_counter()

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(open_one, [r.request_id for r in disputed]))
        elapsed = wait_all(pg_url, "SELECT count(*) FROM disputes WHERE state = 'verdict'", (),
                           args.disputes)
        wall = time.perf_counter() - t0
        with psycopg.connect(pg_url) as conn:
            done_at = {str(r[0]): r[1] for r in conn.execute(
                "SELECT dispute_id, max(at) FROM dispute_events WHERE kind = 'verdict' "
                "GROUP BY dispute_id")}
            opened_at = {str(r[0]): r[1] for r in conn.execute(
                "SELECT id, opened_at FROM disputes")}
        lat = sorted((done_at[k] - opened_at[k]).total_seconds() for k in done_at)
        rows.append([f"{args.disputes} disputes, API -> Redis -> worker -> verdict",
                     args.disputes / wall * 60, f"p50 {pct(lat, 50):.2f} s",
                     f"p99 {pct(lat, 99):.2f} s"])
        del elapsed

        # 2. batched jobs of 32 vs one at a time
        settings = Settings(database_url=url, broker_url=stack.redis.url,
                            worker_dead_after_s=30)
        db = make_engine(settings, pool_size=2)
        with psycopg.connect(pg_url) as conn:
            idx = dict(conn.execute("SELECT request_id, log_index FROM envelopes").fetchall())
            fp = conn.execute("SELECT fingerprint_id FROM envelopes LIMIT 1").fetchone()[0]
        publisher = CeleryPublisher(settings)
        batched = recs[args.disputes:args.disputes + args.envelopes]
        singles = recs[args.disputes + args.envelopes:]
        for label, chunk, part in (("batched jobs of 32", 32, batched),
                                   ("one envelope per job", 1, singles)):
            with session_scope(db) as s:
                made = [jobs.create_job(s, fingerprint_id=fp, kind="reverification",
                                        items=[(idx[r.request_id], r.request_id, None)
                                               for r in part[i:i + chunk]],
                                        settings=settings).id
                        for i in range(0, len(part), chunk)]
            t0 = time.perf_counter()
            jobs.sweep(db, publisher, settings, None)
            wait_all(pg_url, "SELECT count(*) FROM verdicts WHERE job_id = ANY(%s)", (made,),
                     len(part))
            el = time.perf_counter() - t0
            rows.append([f"{len(part)} envelopes, {label}", len(part) / el * 60,
                         f"{len(part) / el:.1f} envelopes/s", ""])
        db.dispose()
    print()
    print(f"tiny-demo, CPU, {args.max_tokens} new tokens per request, one worker")
    print(table(["measurement", "per minute", "", ""], rows))


if __name__ == "__main__":
    main()
