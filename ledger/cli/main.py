"""Entry point of the ``ledger`` command.

Each group of commands lives in its own module and registers itself here. Modules that
need torch (the engine) import it lazily inside their commands, so ``ledger --help`` and
every ledger/API command run without torch installed.
"""

from __future__ import annotations

import typer

from ledger.cli import admin as admin_cli
from ledger.cli import capture as capture_cli
from ledger.cli import check as check_cli
from ledger.cli import demo as demo_cli
from ledger.cli import engine as engine_cli
from ledger.cli import log as log_cli
from ledger.cli import replay as replay_cli
from ledger.cli import trust as trust_cli
from ledger.cli import witness as witness_cli

app = typer.Typer(
    name="ledger",
    help="inference-ledger: signed execution envelopes, a transparency log, bitwise replay.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

demo_cli.register(app)
admin_cli.register(app)
engine_cli.register(app)
capture_cli.register(app)
log_cli.register(app)
replay_cli.register(app)
witness_cli.register(app)
trust_cli.register(app)
check_cli.register(app)


def main() -> None:  # pragma: no cover - console script shim
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
