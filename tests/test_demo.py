"""`ledger demo` (the main job) on its embedded PostgreSQL: exit 0 with the three expected
outcomes, twice in a row on the same data folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import REPO


def test_demo_runs_twice_with_the_expected_outcomes() -> None:
    # Not under tmp_path: the embedded server runs as another user (as root) and needs to
    # traverse the path, and pytest (each xdist worker) resets /tmp/pytest-of-USER to 0700.
    base = Path(tempfile.mkdtemp(prefix="ledger-demo-"))
    try:
        _demo_twice(base / "demo")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _demo_twice(data: Path) -> None:
    for run in (1, 2):
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "ledger.cli.main", "demo", "--data-dir", str(data),
             "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**os.environ, "COLUMNS": "160"})
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, f"run {run}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        out = proc.stdout
        assert "reproduced" in out and "bitwise" in out
        assert "diverged" in out and "awaiting_worker" in out
        assert "audit OK" in out and "offline verify OK" in out
        assert elapsed < 120, f"run {run} took {elapsed:.0f} s"
        # what to use next: the API and console URLs, the database, a key per role
        api = re.search(r"^API: +(http://127\.0\.0\.1:\d+)", out, re.M)
        assert api and f"console:          {api.group(1)}/console" in out, out[-3000:]
        assert re.search(r"^database: +LEDGER_DATABASE_URL=postgresql\+psycopg://\S+", out,
                         re.M), out[-3000:]
        for role in ("ingester", "reviewer", "auditor", "admin"):
            assert re.search(rf"^{role} API key: +lk_\S+$", out, re.M), (role, out[-3000:])
        # README: "records 26 requests ... 27 envelopes"
        assert re.search(r"27 envelopes stored \(26 recorded requests and 1 altered", " ".join(
            out.split())), out[-3000:]
    assert (data / "bundle.jsonl").stat().st_size > 0
    assert list((data / "checkpoints").glob("checkpoint.*"))
