"""Shared helpers for the benchmark scripts: throwaway databases, the machine line."""

from __future__ import annotations

import os
import platform
import statistics
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psycopg

ADMIN_PG = os.environ.get("LEDGER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def scratch_database(prefix: str = "ledger_bench") -> Iterator[str]:
    """A fresh database migrated to head; yields its SQLAlchemy URL; dropped afterwards."""
    from ledger.db.session import upgrade

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = ADMIN_PG.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    url = f"{base}/{name}"
    try:
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(ADMIN_PG, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with psycopg.connect(ADMIN_PG) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    pg = row[0] if row else "?"
    return (f"{platform.node()}: {os.cpu_count()} cores ({cpu}), Python "
            f"{platform.python_version()}, PostgreSQL {pg}")


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if q < 100 \
        else max(values)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
