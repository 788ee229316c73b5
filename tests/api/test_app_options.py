"""Options of the app as built: FastAPI's native OpenTelemetry only when asked for
(``LEDGER_OTEL``), since when on it asks the global providers on every request; the
garbage collector tuned while the app serves, and put back after."""

from __future__ import annotations

import gc

import pytest
from fastapi.testclient import TestClient

from ledger.api.app import create_app
from ledger.core.collector import YOUNG_COLLECTION_EVERY, collecting_less
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


def test_the_collector_is_tuned_while_serving(db_url: str) -> None:
    before = gc.get_threshold()
    assert before[0] != YOUNG_COLLECTION_EVERY
    app = create_app(Settings(database_url=db_url, api_key_pepper=TEST_PEPPER,
                              metrics_port=0))
    try:
        with TestClient(app) as client:
            assert client.get("/healthz").status_code == 200
            assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, *before[1:])
            assert gc.get_freeze_count() > 0
    finally:
        app.state.engine.dispose()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_overlapping_lifespans_restore_the_collector_when_the_last_leaves() -> None:
    before = gc.get_threshold()
    first, second = collecting_less(), collecting_less()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # not in reverse order
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_EVERY
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
