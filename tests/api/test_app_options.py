"""Options of the app as built: FastAPI's native OpenTelemetry only when asked for
(``LEDGER_OTEL``), since when on it asks the global providers on every request."""

from __future__ import annotations

import pytest

from ledger.api.app import create_app
from ledger.settings import Settings
from tests.helpers import TEST_PEPPER


@pytest.mark.parametrize("otel", [False, True])
def test_native_telemetry_only_when_asked_for(db_url: str, otel: bool) -> None:
    app = create_app(Settings(database_url=db_url, api_key_pepper=TEST_PEPPER, otel=otel,
                              metrics_port=0))
    try:
        config = app._telemetry  # FastAPI's own: what NativeTelemetry.enabled() reads
        assert (config["tracing"], config["metrics"], config["logs"]) == (otel,) * 3
        if not otel:  # answered from the configuration alone, no provider looked up
            assert app._native_telemetry.enabled() is False
    finally:
        app.state.engine.dispose()
