"""Longer runs of the fault suite (tests/faults), for manual use.

The CI versions send 10,000 envelopes through an API that is SIGKILLed and 4,000 through a
PostgreSQL restart; ``--scale 10`` makes that 100,000 and 40,000, and ``--repeat`` runs
the whole suite several times in a row (each run kills and restarts processes again).

    python benchmarks/faults.py --scale 10 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    env = {**os.environ, "LEDGER_FAULT_SCALE": str(args.scale)}
    for run in range(1, args.repeat + 1):
        started = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/faults",
                              "-p", "no:cacheprovider"], cwd=REPO, env=env)
        print(f"run {run}/{args.repeat}: exit {rc} in {time.perf_counter() - started:.0f} s")
        if rc:
            sys.exit(rc)


if __name__ == "__main__":
    main()
