"""ASGI entry point for uvicorn: ``ledger.api.main:app`` (settings from LEDGER_* vars)."""

from ledger.api.app import create_app

app = create_app()
