"""Entry point of the ``ledger`` command.

Each group of commands lives in its own module and registers itself here. Modules that
need torch (the engine) import it lazily inside their commands, so ``ledger --help`` and
every ledger/API command run without torch installed.
"""

from __future__ import annotations

import sys

import typer

from ledger.cli import admin as admin_cli
from ledger.cli import capture as capture_cli
from ledger.cli import check as check_cli
from ledger.cli import demo as demo_cli
from ledger.cli import engine as engine_cli
from ledger.cli import log as log_cli
from ledger.cli import matrix as matrix_cli
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
matrix_cli.register(app)
replay_cli.register(app)
witness_cli.register(app)
trust_cli.register(app)
check_cli.register(app)


def _hint_for(exc: BaseException) -> tuple[str, str] | None:
    """(one-line error, hint) for an exception a user's input or environment caused, or
    None for a bug (which keeps its traceback)."""
    import errno

    import httpx
    from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

    from ledger.core.errors import LedgerError
    from ledger.settings import get_settings

    if isinstance(exc, OperationalError):
        from sqlalchemy import make_url

        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        url = make_url(get_settings().database_url).render_as_string(hide_password=True)
        return (f"cannot use the database ({reason})",
                f"set LEDGER_DATABASE_URL or --database-url (now {url}); commands that "
                "have --api can use the REST API instead")
    if isinstance(exc, ProgrammingError) and getattr(exc.orig, "sqlstate", "") == "42P01":
        return ("the database has no ledger schema", "run `ledger db upgrade`")
    if isinstance(exc, ProgrammingError) and getattr(exc.orig, "sqlstate", "") == "42501":
        return (f"permission denied: {str(exc.orig).splitlines()[0]}",
                "this login's role may not do that: run it as the component or admin "
                "login that may (docs/deployment.md, \"Database roles\")")
    if isinstance(exc, DBAPIError):
        return (f"the database refused: {str(exc.orig).strip().splitlines()[0]}",
                "check the arguments (`--help`)")
    if isinstance(exc, httpx.HTTPError):
        return (f"cannot reach the ledger API ({exc})", "set LEDGER_API_URL and LEDGER_API_KEY")
    if isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError |
                  PermissionError):
        return (f"{exc.strerror}: {exc.filename}", "check the path")
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE,):
        return (f"{exc.strerror}", "pick another --port")
    if isinstance(exc, LedgerError):
        return (exc.message, "see `--help`, and docs/ for the format")
    return None


def run(argv: list[str] | None = None) -> int:
    """Run the ``ledger`` command line; returns the exit code. A user error (bad
    arguments, a missing file, an unreachable database or API) is one line plus a hint on
    standard error with exit code 2, never a traceback."""
    from typer._click import exceptions as click  # typer vendors click from 0.2x on

    err = sys.stderr
    try:
        code = app(args=argv, prog_name="ledger", standalone_mode=False)
    except click.NoArgsIsHelpError as exc:
        exc.show()
        return 2
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "ledger"
        print(f"error: {exc.format_message()}; hint: see `{where} --help`", file=err)
        return 2
    except click.ClickException as exc:
        print(f"error: {exc.format_message()}", file=err)
        return exc.exit_code
    except typer.Abort:
        print("aborted", file=err)
        return 130
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except Exception as exc:
        known = _hint_for(exc)
        if known is None:
            raise
        message, hint = known
        print(f"error: {' '.join(message.split())}; hint: {hint}", file=err)
        return 2
    return code if isinstance(code, int) else 0


def main() -> None:  # pragma: no cover - console script shim
    raise SystemExit(run())


if __name__ == "__main__":  # pragma: no cover
    main()
