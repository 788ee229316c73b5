"""Helpers shared by CLI commands: console, settings overrides, private-key files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from ledger.settings import Settings, get_settings

console = Console(stderr=True)
out = Console()


def settings_with(database_url: str | None = None) -> Settings:
    settings = get_settings()
    if database_url:
        settings = settings.model_copy(update={"database_url": database_url})
    return settings


def fail(message: str, hint: str) -> typer.Exit:
    """A user error: one line with a hint on standard error; raise the result (exit 2)."""
    print(f"error: {' '.join(message.split())}; hint: {hint}", file=sys.stderr, flush=True)
    return typer.Exit(2)


def write_private_file(path: Path, data: bytes, *, force: bool = False) -> None:
    """Create ``path`` with mode 0600 (never readable by others, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise fail(f"{path} exists", "pass --force to overwrite") from None
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(data)


DatabaseUrlOption = typer.Option(None, "--database-url", envvar="LEDGER_DATABASE_URL",
                                 help="SQLAlchemy URL; defaults to LEDGER_DATABASE_URL.")
