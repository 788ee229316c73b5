"""Every `ledger` command answers a user error with one line and a hint, exit code 2, no
traceback (issue 13): unknown options on every subcommand, a database that is not there,
a bad date, a missing file. In-process through ``ledger.cli.main.run`` (what the console
script calls), plus one real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from ledger.cli.main import app, run
from tests.helpers import REPO

NO_DB = "postgresql+psycopg://postgres@127.0.0.1:1/none"


def _leaves(cmd: object, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    subs = getattr(cmd, "commands", None)
    if not subs:
        return [path]
    return [leaf for name, sub in subs.items() for leaf in _leaves(sub, (*path, name))]


LEAVES = _leaves(typer.main.get_command(app))


def _one_line_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    code = run(args)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 2, (args, code, text[-2000:])
    assert "Traceback" not in text, text[-2000:]
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "; hint: " in errors[0], (args, captured.err[-2000:])
    return errors[0]


def test_every_subcommand_is_covered() -> None:
    assert len(LEAVES) >= 25
    assert ("apikey", "list") in LEAVES and ("apikey", "revoke") in LEAVES
    assert ("check",) in LEAVES


@pytest.mark.parametrize("leaf", LEAVES, ids=" ".join)
def test_unknown_option(capsys: pytest.CaptureFixture[str], leaf: tuple[str, ...]) -> None:
    line = _one_line_error(capsys, [*leaf, "--no-such-option"])
    assert "--no-such-option" in line and "--help" in line


@pytest.fixture
def pub(tmp_path: Path) -> Path:
    from ledger.core.keys import generate_private_key, public_pem

    path = tmp_path / "k.pub"
    path.write_bytes(public_pem(generate_private_key()))
    return path


MISSING_DB = [
    ["db", "upgrade"],
    ["db", "create-login", "--component", "api", "--name", "x"],
    ["keys", "register", "{pub}", "--purpose", "worker", "--name", "x"],
    ["keys", "revoke", "abc", "--reason", "r"],
    ["apikey", "create", "--role", "admin", "--name", "x"],
    ["apikey", "list"],
    ["apikey", "revoke", "00000000-0000-0000-0000-000000000000"],
    ["audit"],
    ["export", "--out", "{tmp}/b.jsonl", "--recorded-after", "2026-12-01"],
]


@pytest.mark.parametrize("args", MISSING_DB, ids=lambda a: " ".join(a[:2]))
def test_missing_database(capsys: pytest.CaptureFixture[str], args: list[str], pub: Path,
                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ledger.settings import get_settings

    monkeypatch.setenv("LEDGER_DATABASE_URL", NO_DB)
    monkeypatch.delenv("LEDGER_SERVICE_KEY_FILE", raising=False)
    get_settings.cache_clear()
    try:
        filled = [a.format(pub=pub, tmp=tmp_path) for a in args]
        line = _one_line_error(capsys, filled)
    finally:
        get_settings.cache_clear()
    assert "LEDGER_DATABASE_URL" in line or "LEDGER_SERVICE_KEY_FILE" in line, line
    assert "cannot use the database" in line or "signing key" in line, line


BAD_INPUT = [
    (["export", "--out", "{tmp}/b", "--recorded-after", "1 December"], "--recorded-after"),
    (["verify", "{tmp}/missing.jsonl"], "missing.jsonl"),
    (["keys", "register", "{tmp}/missing.pem", "--purpose", "worker", "--name", "x"],
     "missing.pem"),
    (["audit", "--against", "{tmp}/missing-checkpoint"], "missing-checkpoint"),
    (["engine", "run", "--model", "tiny-demo", "--input", "{tmp}/missing.jsonl", "--output",
      "{tmp}/o.jsonl"], "missing.jsonl"),
    (["artifact", "hash", "{tmp}/missing-dir"], "missing-dir"),
    (["engine", "serve", "--model", "{tmp}/no-model", "--port", "1"], "no-model"),
    (["engine", "serve", "--model", "tiny-demo", "--port", "1", "--max-batch", "100000000",
      "--warm-up-len", "2048"], "--warm-up-len"),
    (["proxy", "--upstream", "http://127.0.0.1:1", "--key", "{tmp}/missing.pem",
      "--fingerprint", "{tmp}/missing.json", "--artifacts", "{tmp}/missing.json"], "missing"),
    (["trust", "init", "--out", "{tmp}/t.toml", "--log-key", "{tmp}/missing.pem"],
     "missing.pem"),
    (["check", "nonsense"], "nonsense"),
    (["keys"], None),
]


@pytest.mark.parametrize("args,named", BAD_INPUT, ids=lambda a: " ".join(a[:2])
                         if isinstance(a, list) else str(a))
def test_bad_input(capsys: pytest.CaptureFixture[str], args: list[str], named: str | None,
                   tmp_path: Path) -> None:
    filled = [a.format(tmp=tmp_path) for a in args]
    if named is None:  # a group alone prints its help, exit 2
        assert run(filled) == 2
        assert "Traceback" not in capsys.readouterr().err
        return
    line = _one_line_error(capsys, filled)
    assert named in line, line


def test_the_console_script_path_has_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ledger.cli.main", "keys", "register",
                           str(tmp_path / "k.pem"), "--purpose", "worker", "--name", "x"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "LEDGER_DATABASE_URL": NO_DB})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("error: ") == 1 and "hint: " in proc.stderr
