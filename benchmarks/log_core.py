"""Micro-benchmark of the pure transparency-log core (no database): ``ledger.core.tiles``,
``ledger.core.merkle`` and ``ledger.core.note`` on an in-memory tiled tree.

Prints one table: integration throughput for batches of 1, 100 and 10,000 leaves onto a
1,000,000-leaf tree (tile assembly and storing the tiles included), inclusion and
consistency proof generation from tiles at 1,000,000 leaves (p50/p99), verification rates,
and the baseline measured in the same run: recomputing the root from all 1,000,000 leaf
hashes. ``benchmarks/log.py`` measures the same against Postgres.

    .venv/bin/python benchmarks/log_core.py [--size 1000000] [--seconds 2]

Numbers from one run are in docs/transparency-log.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.merkle import leaf_hash, root_hash, verify_consistency, verify_inclusion
from ledger.core.note import Checkpoint, NoteVerifier, open_checkpoint, sign_checkpoint
from ledger.core.tiles import (
    MemoryTileStore,
    consistency_proof_from_tiles,
    inclusion_proof_from_tiles,
    integrate,
    root_from_tiles,
)


def percentiles(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49], cuts[98]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per integrate row")
    parser.add_argument("--samples", type=int, default=2000, help="proofs per latency row")
    args = parser.parse_args()
    n = args.size
    rng = random.Random(1)
    rows: list[tuple[str, str, str]] = []

    t0 = time.perf_counter()
    leaves = [leaf_hash(b"benchmark entry %d" % i) for i in range(n)]
    t_leaf = time.perf_counter() - t0
    rows.append((f"leaf hashing, {n:,} entries", f"{n / t_leaf:,.0f} entries/s", ""))

    t_base = min(timed(lambda: root_hash(leaves)) for _ in range(3))  # best of 3
    rows.append((f"BASELINE: root from all {n:,} leaf hashes", f"{t_base * 1e3:,.0f} ms", "1.0x"))

    store = MemoryTileStore()
    t0 = time.perf_counter()
    result = integrate(0, leaves, store)
    store.write_tiles(result.tiles)
    t_all = time.perf_counter() - t0
    assert result.root == root_hash(leaves)
    rows.append(
        (
            f"integrate {n:,} leaves in one batch",
            f"{n / t_all:,.0f} leaves/s",
            f"{t_base / t_all:.2f}x",
        )
    )
    t_root = min(timed(lambda: root_from_tiles(n, store)) for _ in range(20))
    rows.append(
        ("root from tiles at full size", f"{t_root * 1e3:.2f} ms", f"{t_base / t_root:,.0f}x")
    )

    extra = [leaf_hash(b"more %d" % i) for i in range(200_000)]
    base_tiles = dict(store._tiles)  # the 1M-leaf state, restored for each batch size
    for batch in (1, 100, 10_000):
        bench = MemoryTileStore()
        bench._tiles = dict(base_tiles)
        size, done, calls, pos = n, 0, 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            if pos + batch > len(extra):
                pos = 0
                bench._tiles = dict(base_tiles)
                size = n
            r = integrate(size, extra[pos : pos + batch], bench)
            bench.write_tiles(r.tiles)
            size, done, calls, pos = r.size, done + batch, calls + 1, pos + batch
        elapsed = time.perf_counter() - t0
        per_call = elapsed / calls
        rows.append(
            (
                f"integrate batches of {batch:,} onto {n:,}",
                f"{done / elapsed:,.0f} leaves/s ({per_call * 1e3:.2f} ms/batch)",
                f"{t_base / per_call:,.0f}x",
            )
        )

    root = result.root

    def latency_row(
        label: str, make: Callable[[int], list[bytes]], lo: int
    ) -> list[tuple[int, list[bytes]]]:
        """Wall-clock p50/p99, and p99 of the thread's CPU time (which leaves out time
        the scheduler gave to other processes on a shared machine)."""
        made, wall, cpu = [], [], []
        for _ in range(args.samples):
            x = rng.randrange(lo, n)
            t0, c0 = time.perf_counter(), time.thread_time()
            proof = make(x)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            made.append((x, proof))
        p50, p99 = percentiles(wall)
        rows.append(
            (
                label,
                f"p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms (CPU p99 "
                f"{percentiles(cpu)[1] * 1e3:.3f} ms)",
                f"{t_base / p99:,.0f}x",
            )
        )
        return made

    incl = latency_row(
        f"inclusion proof from tiles at {n:,}",
        lambda i: inclusion_proof_from_tiles(i, n, store),
        0,
    )
    cons = latency_row(
        f"consistency proof from tiles to {n:,}",
        lambda m: consistency_proof_from_tiles(m, n, store),
        1,
    )

    t0 = time.perf_counter()
    for i, proof in incl:
        verify_inclusion(leaves[i], i, n, proof, root)
    rows.append(("verify_inclusion", f"{len(incl) / (time.perf_counter() - t0):,.0f} proofs/s", ""))
    old_roots = {m: root_from_tiles(m, store) for m, _ in cons}
    t0 = time.perf_counter()
    for m, proof in cons:
        verify_consistency(m, n, proof, old_roots[m], root)
    rows.append(
        ("verify_consistency", f"{len(cons) / (time.perf_counter() - t0):,.0f} proofs/s", "")
    )

    key = Ed25519PrivateKey.from_private_bytes(bytes(32))
    verifier = NoteVerifier.from_public_key("bench.example/log", key.public_key())
    cp = Checkpoint("bench.example/log", n, root)
    t0 = time.perf_counter()
    for _ in range(500):
        note = sign_checkpoint(cp, "bench.example/log", key)
    t_sign = (time.perf_counter() - t0) / 500
    t0 = time.perf_counter()
    for _ in range(500):
        open_checkpoint(note, [verifier], origin="bench.example/log")
    t_open = (time.perf_counter() - t0) / 500
    rows.append(("sign / open a checkpoint", f"{t_sign * 1e6:.0f} us / {t_open * 1e6:.0f} us", ""))

    print(f"# ledger.core transparency log, {n:,} leaves")
    print(
        f"# {platform.python_implementation()} {platform.python_version()} on "
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs "
        f"({platform.processor() or 'unknown CPU'}); one core used"
    )
    print("# ratio = baseline time / this row's time per operation (higher is better)")
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    print(f"| {'measurement':<{width}} | {'result':<{vwidth}} | {'ratio':>8} |")
    print(f"|{'-' * (width + 2)}|{'-' * (vwidth + 2)}|{'-' * 10}|")
    for name, value, ratio in rows:
        print(f"| {name:<{width}} | {value:<{vwidth}} | {ratio:>8} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
