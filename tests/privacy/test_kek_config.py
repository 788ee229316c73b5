"""`ledger check` and start-up checks of the key-encryption key (LEDGER_KEK_FILE)."""

from __future__ import annotations

import os
from pathlib import Path

from ledger.services.checks import check
from ledger.settings import Settings
from tests.privacy.conftest import Log


def _kek_lines(log: Log, **kw: object) -> list[str]:
    settings = Settings(database_url=log.db_url, insecure_dev=True, **kw)  # type: ignore[arg-type]
    return [p.line() for p in check(settings, "serve", engine=log.engine, broker=False)
            if p.setting == "LEDGER_KEK_FILE"]


def test_kek_file_checked(log: Log, tmp_path: Path) -> None:
    assert _kek_lines(log, kek_file=log.kek_file) == []
    short = tmp_path / "short"
    short.write_text("abcd\n")
    assert any("32 raw bytes or 64 hex" in line for line in _kek_lines(log, kek_file=short))
    assert any("cannot be read" in line
               for line in _kek_lines(log, kek_file=tmp_path / "missing"))
    other = tmp_path / "other"
    other.write_text(os.urandom(32).hex())
    assert any("did not wrap the database's data keys" in line
               for line in _kek_lines(log, kek_file=other))
    assert any("holds envelopes encrypted at rest" in line for line in _kek_lines(log))
