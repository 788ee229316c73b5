"""The ``ledger`` command line (Typer + rich)."""
