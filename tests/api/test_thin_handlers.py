"""The REST layer stays thin (issue #14): no function under ledger/api is longer than 40
lines (decorators included), and none holds a query: ``select(`` or SQL text lives in the
services, ledger/replay and ledger/log/store.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ledger.api

API = Path(ledger.api.__file__).parent
MAX_LINES = 40
SQL = re.compile(r"\bselect\(|\b(SELECT|INSERT INTO|UPDATE|DELETE FROM)\s+\w")


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - first + 1
            if length > limit:
                out.append((node.name, length))
    return out


def test_the_checks_see_what_they_look_for() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(45))
    assert long_functions(f"@dec\ndef f() -> None:\n{body}\n") == [("f", 47)]
    assert long_functions("def g() -> None:\n    pass\n") == []
    assert SQL.search("stmt = select(Dispute)") and SQL.search('"SELECT size FROM log"')
    assert not SQL.search("a selection of envelopes; update the docs")


def test_no_api_function_is_longer_than_40_lines() -> None:
    found = {str(p.relative_to(API)): long_functions(p.read_text())
             for p in sorted(API.rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_no_query_under_ledger_api() -> None:
    hits = [f"{p.relative_to(API)}:{n}: {line.strip()}"
            for p in sorted(API.rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if SQL.search(line)]
    assert hits == []
