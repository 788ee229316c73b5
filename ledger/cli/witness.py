"""`ledger witness keygen|serve|submit`: run a C2SP tlog-witness, or push checkpoints to
the configured witnesses from a process that is not the API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ledger.cli.common import DatabaseUrlOption, console, out, settings_with, write_private_file

witness_app = typer.Typer(help="A C2SP tlog-witness that cosigns this (or any) log's "
                               "checkpoints, and the log's side of the protocol.",
                          no_args_is_help=True)


@witness_app.command("keygen")
def keygen_command(
    name: Annotated[str, typer.Option(help="The witness's name (a schema-less URL, e.g. "
                                           "witness.example/w1).")],
    out_path: Annotated[Path, typer.Option("--out", help="Signer key file (mode 0600).")],
    force: bool = typer.Option(False, help="Overwrite an existing file."),
) -> None:
    """Make a cosignature/v1 key: the signer key goes to a 0600 file, the verifier key
    (type 0x04 vkey, for LEDGER_WITNESSES and trust policies) to stdout and FILE.vkey."""
    from ledger.core.cosignature import generate_witness_key

    skey, vkey = generate_witness_key(name)
    write_private_file(out_path, (skey + "\n").encode(), force=force)
    out_path.with_name(out_path.name + ".vkey").write_text(vkey + "\n")
    console.print(f"signer key: {out_path} (0600)")
    out.print(vkey, highlight=False, soft_wrap=True)


def _log_keys(keys: list[str], files: list[Path]) -> list[str]:
    found = list(keys)
    for path in files:
        found += [line.strip() for line in path.read_text().splitlines()
                  if line.strip() and not line.startswith("#")]
    return found


@witness_app.command("serve")
def serve_command(
    key_file: Annotated[Path, typer.Option(help="The witness signer key (from `ledger "
                                                "witness keygen`).")],
    state: Annotated[Path, typer.Option(help="The witness's own state file (created if "
                                             "missing; never the log's database).")],
    log_key: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        help="A log verifier key (Go note vkey; its name is the log's origin); repeatable.")
    ] = None,
    log_keys_file: Annotated[Optional[list[Path]], typer.Option(  # noqa: UP045
        help="A file of log verifier keys, one per line; repeatable.")] = None,
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(7380, help="TCP port."),
    log_level: str = typer.Option("warning", help="uvicorn log level."),
) -> None:
    """Serve POST /add-checkpoint (C2SP tlog-witness) for the logs whose keys are given."""
    import uvicorn

    from ledger.core.cosignature import parse_witness_signer_key
    from ledger.core.errors import LedgerError
    from ledger.core.note import parse_verifier_key
    from ledger.witness.app import create_witness_app
    from ledger.witness.service import Witness, WitnessConfig
    from ledger.witness.state import WitnessState

    try:
        signer = parse_witness_signer_key(key_file.read_text())
        keys = [parse_verifier_key(k) for k in _log_keys(log_key or [], log_keys_file or [])]
        if not keys:
            raise typer.BadParameter("give at least one --log-key")
        config = WitnessConfig.from_keys(signer, keys,
                                         evidence_dir=state.with_name(state.name + ".evidence"))
        witness = Witness(config, WitnessState(state))
    except (OSError, LedgerError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    console.print(f"witness {signer.key.verifier_key} for {', '.join(sorted(config.logs))}")
    # one process: the state lock serialises requests (a second process would also wait
    # on the state file's flock, but gains nothing)
    uvicorn.run(create_witness_app(witness), host=host, port=port, log_level=log_level,
                access_log=False, timeout_graceful_shutdown=5)


@witness_app.command("submit")
def submit_command(
    once: bool = typer.Option(False, help="One round per witness, then exit (1 if any "
                                          "failed)."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """Push the newest checkpoint to every witness in LEDGER_WITNESSES and store their
    cosignatures (what the API's integrator thread does; for deployments that integrate
    with `ledger integrate`)."""
    import time

    from ledger.db.session import make_engine
    from ledger.log.witnessing import WitnessLoop

    settings = settings_with(database_url)
    engine = make_engine(settings, pool_size=2)
    loop = WitnessLoop.from_settings(settings, engine)
    if loop is None:
        console.print("[red]LEDGER_WITNESSES names no witness[/red]")
        raise typer.Exit(2)
    try:
        if once:
            rounds = loop.run_once()
            for status in rounds:
                out.print(str(status), highlight=False, soft_wrap=True)
            if any(r.failed for r in rounds):
                raise typer.Exit(1)
            return
        loop.start()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        loop.stop()
        engine.dispose()


def register(app: typer.Typer) -> None:
    app.add_typer(witness_app, name="witness")
