"""`ledger check [serve|beat|worker|proxy]`: validate a component's configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ledger.cli.common import DatabaseUrlOption, console, out, settings_with


def check_command(
    component: str = typer.Argument("serve", help="serve | beat | worker | proxy"),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045 - typer
    key: Optional[Path] = typer.Option(None, help="worker: its signing key (default "  # noqa: UP045
                                       "LEDGER_WORKER_KEY_FILE)."),
    engine: str = typer.Option("reference", help="worker: reference | vllm."),
    device: str = typer.Option("cpu", help="worker: cpu | cuda."),
    dtype: str = typer.Option("float32", help="worker: float32 | bfloat16 | float16."),
    threads: int = typer.Option(1, min=1, help="worker: torch CPU threads."),
    insecure_dev: bool = typer.Option(False, "--insecure-dev", help="Check as the "
                                      "component would run with --insecure-dev."),
) -> None:
    """Check what COMPONENT needs: the database reachable and migrated, its login, keys
    present and registered, the log name, the pepper, the broker, and for a worker its
    trust policy and fingerprint. One line per problem naming the setting; exit 1 if any.
    `ledger serve`, `beat` and `worker` run the same checks at start-up."""
    from ledger.services.checks import COMPONENTS, check

    if component not in COMPONENTS:
        console.print(f"[red]error:[/red] unknown component {component!r}; hint: one of "
                      f"{', '.join(COMPONENTS)}")
        raise typer.Exit(2)
    settings = settings_with(database_url)
    if insecure_dev:
        settings = settings.model_copy(update={"insecure_dev": True})
    problems = check(settings, component, worker_key=key)
    failing = [p for p in problems if p.counts(settings.insecure_dev)]
    for p in problems:
        tag = "ok (insecure dev)" if p not in failing else p.kind
        out.print(f"{tag:>9}  {p.line()}", markup=False, highlight=False, soft_wrap=True)
    if component == "worker":
        _fingerprint(settings, engine, device, dtype, threads)
    if failing:
        out.print(f"ledger check {component}: {len(failing)} problem(s)", style="red")
        raise typer.Exit(1)
    out.print(f"ledger check {component}: OK", style="green")


def _fingerprint(settings: object, engine: str, device: str, dtype: str, threads: int) -> None:
    """The fingerprint this worker would have, and how many jobs wait for it."""
    try:
        from ledger.core.fingerprint import fingerprint_id
        from workers.engine import node_runtime

        fp = fingerprint_id(node_runtime(engine, device=device, dtype=dtype, threads=threads))
    except (ImportError, ValueError, RuntimeError) as exc:
        out.print(f"   advice  fingerprint: cannot compute it here ({exc})", markup=False)
        return
    waiting = _waiting_jobs(settings, fp)
    out.print(f"     info  fingerprint {fp}"
              + (f": {waiting} job(s) wait for it" if waiting is not None else ""),
              markup=False)


def _waiting_jobs(settings: object, fp: str) -> int | None:
    from sqlalchemy import func, select
    from sqlalchemy.exc import SQLAlchemyError

    from ledger.db.models import ReplayJob
    from ledger.db.session import make_engine

    db = make_engine(settings, pool_size=1)  # type: ignore[arg-type]
    try:
        with db.connect() as conn:
            return int(conn.execute(select(func.count()).where(
                ReplayJob.fingerprint_id == fp,
                ReplayJob.state.in_(("queued", "awaiting_worker")))).scalar() or 0)
    except SQLAlchemyError:
        return None
    finally:
        db.dispose()


def register(app: typer.Typer) -> None:
    app.command("check")(check_command)
