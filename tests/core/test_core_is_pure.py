"""ledger/core does no I/O: it imports no database, HTTP or web framework, and reads no
environment (STYLE.md habit 1 and 11). Checked twice: by reading every module's source
(a direct import or an ``os.environ``/``os.getenv`` anywhere), and by importing the whole
package in a fresh interpreter (an indirect import through another ledger module)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ledger.core

FORBIDDEN = ("sqlalchemy", "fastapi", "starlette", "httpx", "psycopg", "psycopg_pool")
CORE = Path(ledger.core.__file__).parent


def impurities(source: str) -> list[str]:
    """What in ``source`` reaches outside the core: forbidden imports, environment reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "os":
                names += [f"os.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            names = [f"os.{node.attr}"]
        for name in names:
            if name.split(".")[0] in FORBIDDEN or name in ("os.environ", "os.getenv",
                                                            "os.putenv"):
                found.append(f"line {node.lineno}: {name}")
    return found


def test_the_scanner_finds_what_it_looks_for() -> None:
    source = ("import os\nimport httpx\nfrom sqlalchemy.orm import Session\n"
              "from os import environ\nx = os.environ['A']\ny = os.getenv('B')\n"
              "from ledger.core import merkle\nz = os.path.join('a')\n")
    assert impurities(source) == ["line 2: httpx", "line 3: sqlalchemy.orm",
                                  "line 4: os.environ", "line 5: os.environ",
                                  "line 6: os.getenv"]


def test_core_sources_import_no_io_library_and_read_no_environment() -> None:
    modules = sorted(CORE.rglob("*.py"))
    assert len(modules) > 10
    found = {str(p.relative_to(CORE)): impurities(p.read_text()) for p in modules}
    assert {k: v for k, v in found.items() if v} == {}


def test_importing_the_whole_core_loads_no_io_library() -> None:
    code = ("import importlib, pkgutil, sys, ledger.core\n"
            "for m in pkgutil.walk_packages(ledger.core.__path__, 'ledger.core.'):\n"
            "    importlib.import_module(m.name)\n"
            f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({FORBIDDEN!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
