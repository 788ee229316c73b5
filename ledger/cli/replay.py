"""`ledger worker` and `ledger beat`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from ledger.cli.common import DatabaseUrlOption, console, settings_with


def worker_command(
    models: Annotated[list[str], typer.Option(
        "--models", help="A directory of model directories, a model directory, or tiny-demo "
                         "(repeatable).")],
    engine: str = typer.Option("reference", help="reference | vllm"),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    max_batch: int = typer.Option(32, help="Requests replayed together."),
    key: Optional[Path] = typer.Option(None, help="Worker signing key (PEM); default "  # noqa: UP045
                                       "LEDGER_WORKER_KEY_FILE."),
    register_key: bool = typer.Option(False, help="Register the key as a worker key if it "
                                      "is not (development; an admin does it otherwise)."),
    insecure_dev: bool = typer.Option(
        False, "--insecure-dev", help="Run without a trust policy, trusting the log and "
        "producer keys of the database itself (development only: an insider can forge)."),
    loglevel: str = typer.Option("INFO"),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """Replay worker: computes its fingerprint, hashes its models, self-checks batch
    invariance, then consumes only replay.<fingerprint_id>."""
    logging.basicConfig(level=loglevel, format="%(asctime)s %(name)s %(message)s")
    from ledger.core.errors import LedgerError
    from workers.celery_worker import build_worker, serve
    from workers.replay import NoTrustPolicy, SelfCheckFailed

    settings = settings_with(database_url)
    try:
        worker = build_worker(settings, models=models, engine_name=engine, device=device,
                              dtype=dtype, max_batch=max_batch, key_file=key,
                              register_key=register_key, insecure_dev=insecure_dev)
    except NoTrustPolicy as exc:
        typer.echo(str(exc), err=True)  # one line, unwrapped
        raise typer.Exit(2) from None
    except LedgerError as exc:  # a trust policy that does not parse
        console.print(f"[red]{exc.message}[/red]")
        raise typer.Exit(2) from None
    console.print(f"worker {worker.worker_id}")
    console.print(f"fingerprint {worker.fingerprint_id}")
    console.print(json.dumps(worker.runtime, sort_keys=True))
    for m in worker.models.values():
        console.print(f"model {m.name}: {m.model_sha256}")
    try:
        worker.self_check()
    except SelfCheckFailed as exc:
        console.print(f"[red]batch-invariance self-check failed, not consuming: {exc}[/red]")
        raise typer.Exit(3) from None
    console.print("batch-invariance self-check passed")
    serve(worker, settings, loglevel=loglevel)


def beat_command(
    interval: float = typer.Option(2.0, help="Seconds between ticks."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """The one scheduler: outbox sweeper, re-verification windows, fingerprint gates.
    A second beat waits for the first's lock."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from ledger.db.session import make_engine, session_scope
    from ledger.replay import beat
    from ledger.replay.broker import CeleryPublisher
    from ledger.replay.records import Signer

    settings = settings_with(database_url)
    engine = make_engine(settings, pool_size=3)
    signer = Signer.from_file(settings.service_key_file, "ledger", "ledger-service")
    if signer is None:
        console.print("[yellow]LEDGER_SERVICE_KEY_FILE is not set: jobs are routed and "
                      "published, but dispute events cannot be signed[/yellow]")
    else:
        with session_scope(engine) as session:
            signer.ensure_registered(session)
    console.print(f"beat ticking every {interval}s")

    def on_tick(counts: dict[str, int]) -> None:
        if any(counts.values()):
            logging.getLogger("ledger.beat").info("tick %s", counts)

    beat.run(engine, CeleryPublisher(settings), settings, signer, interval_s=interval,
             on_tick=on_tick)


def register(app: typer.Typer) -> None:
    app.command("worker")(worker_command)
    app.command("beat")(beat_command)
