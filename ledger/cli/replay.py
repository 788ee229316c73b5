"""`ledger worker` and `ledger beat`."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ledger.cli.common import DatabaseUrlOption, console, settings_with


def worker_command(
    models: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045 - typer
        "--models", help="A directory of model directories, a model directory, or tiny-demo "
                         "(repeatable); required unless --vendor.")] = None,
    vendor: bool = typer.Option(
        False, "--vendor", help="A vendor worker: re-verify vendor records (tier semantic) "
        "of LEDGER_VENDOR_NAME at LEDGER_VENDOR_BASE_URL with the key in "
        "LEDGER_VENDOR_API_KEY_FILE; no models, no engine (docs/semantic.md)."),
    engine: str = typer.Option("reference", help="reference | vllm"),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    max_batch: int = typer.Option(32, help="Requests replayed together."),
    key: Optional[Path] = typer.Option(None, help="Worker signing key (PEM); default "  # noqa: UP045
                                       "LEDGER_WORKER_KEY_FILE."),
    register_key: bool = typer.Option(False, help="Register the key as a worker key if it "
                                      "is not (development; an admin does it otherwise)."),
    threads: int = typer.Option(1, "--threads", min=1, help="torch intra-op threads on CPU "
                                "(part of the fingerprint; as `ledger fingerprint --threads`)."),
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG | INFO | WARNING | "
                                  "ERROR."),
    old_loglevel: Optional[str] = typer.Option(None, "--loglevel", hidden=True),  # noqa: UP045
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
    insecure_dev: bool = typer.Option(
        False, "--insecure-dev", help="Development only: start as a superuser or the "
        "schema owner, and without a trust policy, trusting the log and producer keys of the "
        "database itself (an insider can forge)."),
) -> None:
    """Replay worker: computes its fingerprint, hashes its models, self-checks batch
    invariance, then consumes only replay.<fingerprint_id>. Refuses to start as a database
    superuser or the schema owner, or without a worker key."""
    if vendor and models:
        raise typer.BadParameter("--models does not apply to a vendor worker",
                                 param_hint="--models")
    if not vendor and not models:
        raise typer.BadParameter("give at least one --models (or --vendor)",
                                 param_hint="--models")
    loglevel = (old_loglevel or log_level).upper()  # --loglevel: the old spelling
    logging.basicConfig(level=loglevel, format="%(asctime)s %(name)s %(message)s")
    from ledger.core.errors import LedgerError
    from ledger.db.privileges import enforce
    from ledger.db.session import make_engine

    settings = settings_with(database_url)
    if insecure_dev:
        settings = settings.model_copy(update={"insecure_dev": True})
    check_engine = make_engine(settings, pool_size=1)
    try:
        enforce(settings, check_engine, "worker", worker_key=key, register_key=register_key)
    finally:
        check_engine.dispose()
    if vendor:
        _vendor_worker(settings, key, register_key, insecure_dev, loglevel)
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    from workers.celery_worker import build_worker, serve
    from workers.engine.selfcheck import SelfCheckFailed
    from workers.replay import NoTrustPolicy

    bars = Progress(TextColumn("hashing {task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True)

    def hashing(name: str, total: int) -> Any:
        task = bars.add_task(name, total=total)
        return lambda n: bars.advance(task, n)

    try:
        with bars:
            worker = build_worker(settings, models=list(models or []), engine_name=engine,
                                  device=device, dtype=dtype, max_batch=max_batch, key_file=key,
                                  threads=threads, register_key=register_key,
                                  insecure_dev=insecure_dev, hashing_progress=hashing)
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


def _vendor_worker(settings: Any, key: Path | None, register_key: bool, insecure_dev: bool,
                   loglevel: str) -> None:
    from ledger.core.errors import LedgerError
    from workers.celery_worker import build_vendor_worker, serve
    from workers.replay import NoTrustPolicy
    from workers.semantic import VendorWorkerConfigError

    try:
        worker = build_vendor_worker(settings, key_file=key, register_key=register_key,
                                     insecure_dev=insecure_dev)
    except (NoTrustPolicy, VendorWorkerConfigError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    except LedgerError as exc:
        console.print(f"[red]{exc.message}[/red]")
        raise typer.Exit(2) from None
    console.print(f"vendor worker {worker.worker_id} for {worker.vendor} at {worker.base_url}")
    console.print(f"fingerprint {worker.fingerprint_id}")
    serve(worker, settings, loglevel=loglevel)


def beat_command(
    interval: float = typer.Option(2.0, help="Seconds between ticks."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
    log_level: str = typer.Option("INFO", "--log-level", help="DEBUG | INFO | WARNING | "
                                  "ERROR."),
    insecure_dev: bool = typer.Option(False, "--insecure-dev", help="Development only: "
                                      "start as a superuser or without the log key."),
) -> None:
    """The one scheduler: outbox sweeper, re-verification windows, fingerprint gates, and
    the integrator (LEDGER_LOG_KEY_FILE). A second beat waits for the first's lock.
    Refuses to start as a database superuser or the schema owner, or without the log key."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from ledger.db.privileges import enforce
    from ledger.db.session import make_engine
    from ledger.log.integrator import IntegratorThread
    from ledger.log.signer import LogSigner
    from ledger.log.sink import sink_from_settings
    from ledger.replay import beat
    from ledger.replay.broker import CeleryPublisher
    from ledger.replay.records import Signer

    settings = settings_with(database_url)
    if insecure_dev:
        settings = settings.model_copy(update={"insecure_dev": True})
    engine = make_engine(settings, pool_size=4)
    enforce(settings, engine, "beat")
    signer = Signer.from_file(settings.service_key_file, "ledger", "ledger-service")
    log_signer = LogSigner.from_settings(settings)
    if signer is None:
        console.print("[yellow]LEDGER_SERVICE_KEY_FILE is not set: jobs are routed and "
                      "published, but dispute events cannot be signed[/yellow]")
    for what, key in (("service", signer), ("log", log_signer)):
        if key is not None:
            _require_registered(engine, key, what)
    integrator = None
    if log_signer is not None:
        integrator = IntegratorThread(engine, log_signer,
                                      max_entries=settings.integrate_max_entries,
                                      interval_ms=settings.integrate_interval_ms,
                                      sink=sink_from_settings(settings.checkpoint_sink_dir),
                                      settings=settings)  # and LEDGER_WITNESSES' submitters
        integrator.start()
        console.print("beat integrates the log")
    console.print(f"beat ticking every {interval}s")

    def on_tick(counts: dict[str, int]) -> None:
        if any(counts.values()):
            logging.getLogger("ledger.beat").info("tick %s", counts)

    try:
        beat.run(engine, CeleryPublisher(settings), settings, signer, interval_s=interval,
                 on_tick=on_tick)
    finally:
        if integrator is not None:
            integrator.stop()


def _require_registered(engine: Any, key: Any, what: str) -> None:
    """The beat may not register keys (only the API's admin paths change signing_keys):
    a key that is not registered yet is registered where the role allows it (development
    as the owner), otherwise the beat refuses with the command that registers it."""
    from sqlalchemy.exc import ProgrammingError

    from ledger.db.session import session_scope

    try:
        with session_scope(engine) as session:
            key.ensure_registered(session)
    except ProgrammingError as exc:
        if getattr(exc.orig, "sqlstate", None) != "42501":  # insufficient_privilege
            raise
        setting = "LEDGER_LOG_KEY_FILE" if what == "log" else "LEDGER_SERVICE_KEY_FILE"
        purpose = "log" if what == "log" else "ledger"
        print(f"ledger beat: refusing to start: the {what} key ({setting}) is not registered; "
              f"an admin runs `ledger keys register FILE --purpose {purpose}`", file=sys.stderr,
              flush=True)
        raise SystemExit(2) from None


def register(app: typer.Typer) -> None:
    app.command("worker")(worker_command)
    app.command("beat")(beat_command)
