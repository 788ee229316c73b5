"""The wheel carries every package and data file the code needs (pyproject lists packages
by hand because migrations/ installs as ledger.migrations)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    tomllib = None  # type: ignore[assignment]


def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {".".join(p.parent.relative_to(REPO).parts)
             for top in ("ledger", "workers") for p in (REPO / top).rglob("__init__.py")
             if "__pycache__" not in p.parts}
    found |= {"ledger.migrations", "ledger.migrations.versions"}
    assert found - listed == set(), f"add to pyproject.toml: {sorted(found - listed)}"


@pytest.mark.slow
def test_wheel_holds_migrations_schema_and_tiny_demo(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path), str(REPO)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("inference_ledger-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for must in ("ledger/migrations/env.py", "ledger/migrations/script.py.mako",
                 "ledger/migrations/versions/0001_core.py",
                 "ledger/schemas/envelope-v1.schema.json",
                 "workers/engine/tiny_demo/model.safetensors", "ledger/capture/proxy.py",
                 "workers/serve/app.py", "ledger/replay/jobs.py", "ledger/py.typed"):
        assert must in names, must
