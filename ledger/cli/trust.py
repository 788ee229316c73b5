"""`ledger trust init`: write the trust policy that audit, verify and workers believe."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ledger.cli.common import console, fail, settings_with

trust_app = typer.Typer(help="Trust policies: the keys checks believe, kept outside the "
                        "database.", no_args_is_help=True)


def _public_key(path: Path) -> bytes:
    from ledger.core import keys as corekeys

    data = path.read_bytes()
    if b"PRIVATE KEY" in data:
        return corekeys.public_raw(corekeys.load_private_pem(data))
    return corekeys.parse_public_key(data.decode())


@trust_app.command("init")
def trust_init(
    out_path: Annotated[Path, typer.Option("--out", help="Policy file to write (TOML).")],
    log_key: Annotated[Optional[list[Path]], typer.Option(  # noqa: UP045
        help="The log's key (public or private PEM/base64); repeatable. Default: "
             "LEDGER_LOG_KEY_FILE.")] = None,
    service_key: Annotated[Optional[list[Path]], typer.Option(  # noqa: UP045
        help="The ledger's service key (public or private); repeatable. Default: "
             "LEDGER_SERVICE_KEY_FILE.")] = None,
    witness: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        help="A witness's cosignature verifier key (name+id+base64); repeatable.")] = None,
    quorum: int = typer.Option(0, help="Distinct witnesses that must cosign a checkpoint."),
    origin: Optional[str] = typer.Option(None, help="The log's name; default "  # noqa: UP045
                                         "LEDGER_LOG_NAME."),
    force: bool = typer.Option(False, help="Overwrite an existing file."),
) -> None:
    """Write a trust policy from the key files. Only public keys go into it; hand it to
    auditors (`ledger verify --trust`) and workers (LEDGER_TRUST_POLICY_FILE)."""
    from ledger.core.errors import LedgerError
    from ledger.core.trust import format_trust_policy, parse_witness_key

    settings = settings_with(None)
    logs = log_key or ([settings.log_key_file] if settings.log_key_file else [])
    services = service_key or ([settings.service_key_file] if settings.service_key_file
                               else [])
    if not logs:
        raise fail("no log key", "--log-key FILE or LEDGER_LOG_KEY_FILE")
    if out_path.exists() and not force:
        raise fail(f"{out_path} exists", "pass --force to overwrite")
    try:
        text = format_trust_policy(origin or settings.log_name,
                                   [_public_key(Path(p)) for p in logs],
                                   [_public_key(Path(p)) for p in services],
                                   [parse_witness_key(w) for w in witness or []], quorum)
    except (LedgerError, OSError, ValueError) as exc:
        raise fail(str(getattr(exc, "message", None) or exc),
                   "pass key files from `ledger keys generate` (public or private PEM)"
                   ) from None
    out_path.write_text(text)
    console.print(f"[green]wrote {out_path}[/green]")


def register(app: typer.Typer) -> None:
    app.add_typer(trust_app, name="trust")
