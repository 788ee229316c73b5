"""`ledger demo`: the main job, on an embedded PostgreSQL, nothing to install."""

from __future__ import annotations

from pathlib import Path

import typer

from ledger.cli.common import console

EXPECTED = [("verdict", "reproduced"), ("verdict", "diverged"), ("awaiting_worker", "-")]


def demo_command(
    data_dir: Path = typer.Option(Path(".ledger-demo"), help="Data folder (embedded "
                                  "PostgreSQL, keys, checkpoints, the exported bundle)."),
    keep_running: bool = typer.Option(False, help="Leave the API up for exploring."),
    port: int = typer.Option(8000, help="Port for the API (another free one if taken)."),
    fresh: bool = typer.Option(False, help="Delete the data folder first (new keys too). "
                               "Without it the folder is reused and the database reset."),
) -> None:
    """Record requests with the reference engine, ingest signed envelopes, dispute three
    of them (honest, altered, no worker), audit the log and verify an export offline."""
    from ledger.demo import reset, run_demo

    if fresh:
        reset(data_dir)
    result = run_demo(data_dir, keep_running=keep_running, port=port)
    got = [(row["state"], row["outcome"]) for row in result.rows]
    if got != EXPECTED or not (result.audit_ok and result.verify_ok):
        console.print(f"[red]demo did not end as expected: {got}[/red]")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
