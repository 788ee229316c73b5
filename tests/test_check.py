"""`ledger check` and /readyz report every failing check by setting (real PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from ledger.core.keys import generate_private_key, private_pem
from ledger.db.session import make_engine
from ledger.services.checks import check, refusals
from ledger.settings import Settings


def test_readyz_reports_every_failing_check(db_url: str) -> None:
    from ledger.api.app import create_app

    # what the issue saw: `ledger serve` without LEDGER_LOG_KEY_FILE said ready
    settings = Settings(database_url=db_url, api_key_pepper="p", integrate_in_api=True,
                        metrics_port=0)
    engine = make_engine(settings, pool_size=2)
    try:
        with TestClient(create_app(settings, engine)) as client:
            r = client.get("/readyz")
        assert r.status_code == 503, r.text
        settings_named = {c["setting"] for c in r.json()["checks"]}
        # the missing log key, and the superuser login the tests' URL uses
        assert {"LEDGER_LOG_KEY_FILE", "LEDGER_DATABASE_URL"} <= settings_named, r.json()
        assert "LEDGER_LOG_KEY_FILE" in r.json()["detail"]
    finally:
        engine.dispose()


def test_check_names_a_bad_key_file_and_an_unregistered_worker_key(db_url: str,
                                                                   tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    settings = Settings(database_url=db_url, log_name="x/log", worker_key_file=junk,
                        insecure_dev=True)
    problems = check(settings, "worker", broker=False)
    assert any(p.setting == "LEDGER_WORKER_KEY_FILE" and "not an Ed25519" in p.message
               for p in problems), problems
    good = tmp_path / "worker.pem"
    good.write_bytes(private_pem(generate_private_key()))
    settings = settings.model_copy(update={"worker_key_file": good})
    refused = refusals(check(settings, "worker", broker=False), insecure_dev=True)
    assert [p.setting for p in refused] == ["LEDGER_WORKER_KEY_FILE"], refused
    assert "ledger keys register" in refused[0].message


def test_check_reports_an_unreachable_broker_and_database() -> None:
    settings = Settings(database_url="postgresql+psycopg://postgres@127.0.0.1:1/none",
                        broker_url="redis://127.0.0.1:1/0", log_name="x/log")
    problems = check(settings, "beat")
    by_setting = {p.setting: p for p in problems}
    assert by_setting["LEDGER_DATABASE_URL"].kind == "transient"
    assert by_setting["LEDGER_BROKER_URL"].kind == "transient"
    assert "LEDGER_LOG_KEY_FILE" in by_setting
