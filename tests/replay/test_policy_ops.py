"""Re-verification you can operate (issue 13): pause, resume and delete policies over
the REST API (recorded as admin actions), the drift gauge and gate-failure counter, the
signed webhook with retries (a local receiver checks every signature), and the gate's
summary filed under the NEW fingerprint. Real PostgreSQL, engine, HTTP."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import SecretStr
from sqlalchemy import func, select

from ledger.db.models import (
    AdminEvent,
    Alert,
    AuditEvent,
    ReplayJob,
    ReverificationRun,
)
from ledger.db.session import make_engine, session_scope
from ledger.log.registry import vouched_keys
from ledger.replay import alerts, gate, reverification
from tests.helpers import ApiServer
from tests.replay.conftest import Stack, record, tamper
from tests.replay.test_replay_inprocess import ingest_all

SECRET = "webhook-test-secret"


def _drifting_run(stack: Stack, tiny_engine: Any, threshold: float | None) -> uuid.UUID:
    """A policy run over 10 honest records and one altered: drift 1/11."""
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 10, seed=41, prefix="po")
    forged = tamper(recs[0], stack.producer, 1, "po-forged")
    ingest_all(stack, [r.envelope for r in recs] + [forged.envelope])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.register()
    start = datetime.now(UTC) - timedelta(minutes=30)
    from tests.replay.test_reverification import _policy

    _policy(stack, name="all", interval_seconds=3600, sample_rate=1.0,
            first_window_start=start, drift_alert_threshold=threshold)
    [run_id] = reverification.run_due(stack.db, stack.settings, stack.service,
                                      start + timedelta(hours=1))
    with session_scope(stack.db) as s:
        job_ids = [str(j) for j in s.scalars(select(ReplayJob.id).where(
            ReplayJob.run_id == run_id))]
    for jid in job_ids:
        assert worker.run_job(jid) == "done"
    return run_id


class Receiver:
    """A webhook endpoint that fails the first ``fail`` requests with 500."""

    def __init__(self, fail: int) -> None:
        self.fail, self.requests = fail, []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                want = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
                receiver.requests.append((body, hmac.compare_digest(
                    want, self.headers.get("X-Ledger-Signature", ""))))
                self.send_response(500 if len(receiver.requests) <= receiver.fail else 204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(fail=2)
    yield r
    r.close()


def test_drift_above_the_threshold_is_posted_signed_with_retries(
        stack: Stack, tiny_engine: Any, receiver: Receiver) -> None:
    run_id = _drifting_run(stack, tiny_engine, threshold=0.05)
    settings = stack.settings.model_copy(update={"webhook_url": receiver.url,
                                                 "webhook_secret": SecretStr(SECRET),
                                                 "webhook_retries": 3})
    assert alerts.record_due(stack.db) == 1
    assert alerts.record_due(stack.db) == 0  # once per run
    now = datetime.now(UTC)
    sent = [alerts.deliver_due(stack.db, settings, stack.service, now=now + timedelta(s))
            for s in (0, 0.1, 1, 2)]  # back-off 0.5 s, then 1 s
    assert sent == [0, 0, 1, 0], sent
    assert len(receiver.requests) == 3 and all(ok for _, ok in receiver.requests)
    assert len({body for body, _ in receiver.requests}) == 1  # the same bytes each time
    body = json.loads(receiver.requests[0][0])
    assert body["alert"] == "drift" and body["run_id"] == str(run_id)
    [group] = body["groups"]
    assert abs(group["drift_rate"] - 1 / 11) < 1e-9 and body["threshold"] == 0.05
    with session_scope(stack.db) as s:
        alert = s.scalar(select(Alert))
        assert alert is not None and alert.delivered_at is not None and alert.attempts == 3


def test_no_alert_below_the_threshold_and_an_ed25519_signature_without_secret(
        stack: Stack, tiny_engine: Any) -> None:
    _drifting_run(stack, tiny_engine, threshold=0.5)
    assert alerts.record_due(stack.db) == 0
    headers = alerts.sign_body(b'{"x":1}', stack.settings, stack.service)
    scheme, _, sig = headers["X-Ledger-Signature"].partition("=")
    import base64

    assert scheme == "ed25519" and headers["X-Ledger-Keyid"] == stack.service.keyid
    stack.service.key.public_key().verify(base64.b64decode(sig), b'{"x":1}')  # raises if bad


def test_drift_gauge_and_the_gate_summary_under_the_new_fingerprint(
        stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    run_id = _drifting_run(stack, tiny_engine, threshold=None)
    registry = CollectorRegistry()
    registry.register(alerts.DriftCollector(stack.db))
    text = generate_latest(registry).decode()
    with session_scope(stack.db) as s:
        rep = reverification.report(s, str(run_id))
    [group] = rep["drift"]
    line = (f'ledger_reverification_drift_rate{{fingerprint_id="{group["fingerprint_id"]}",'
            f'model_sha256="{group["model_sha256"]}"}} {1 / 11!r}')
    assert line in text, text
    assert "ledger_gate_failures_total 0.0" in text

    # a bf16 worker appears: the gate replays fp32 records on it
    bf16 = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"], dtype="bfloat16",
                        signer=stack.worker_signer)
    bf16.register()
    [gate_run] = gate.check_new_fingerprints(stack.db, stack.settings, stack.service)
    with session_scope(stack.db) as s:
        job_ids = [str(j) for j in s.scalars(select(ReplayJob.id).where(
            ReplayJob.run_id == gate_run))]
    for jid in job_ids:
        assert bf16.run_job(jid) == "done"
    with session_scope(stack.db) as s:
        rep = reverification.report(s, str(gate_run))
    assert rep["complete"]
    assert {g["fingerprint_id"] for g in rep["drift"]} == {bf16.fingerprint_id}  # the NEW one
    assert rep["gate"]["new_fingerprint"] == bf16.fingerprint_id
    summary = rep["summary"]
    assert summary["replays"] == rep["sampled"] and summary["steps_compared"] > 0
    assert summary["max_abs_logprob_diff"] >= summary["median_abs_logprob_diff"] >= 0
    assert summary["max_abs_logprob_diff"] > 0  # bf16 numerics differ from fp32
    # every diverged verdict has a position; a tolerance-tier reproduction may too
    positions = summary["first_divergence_positions"]
    assert len(positions) >= rep["counts"].get("diverged", 0)
    assert positions == sorted(positions) and all(p >= 0 for p in positions)
    with session_scope(stack.db) as s:  # the claim is a signed leaf the audit accounts for
        assert s.scalar(select(AdminEvent.kind).where(
            AdminEvent.target == str(gate_run))) == "gate.claimed"
        # (the stack's API and producer keys are provisioned without leaves)
        assert [m for _, m in vouched_keys(s, stack.trust)[1]
                if not m.startswith(("signing key", "API key"))] == []
    failed = not rep["gate"]["passed"]
    text = generate_latest(registry).decode()
    assert f"ledger_gate_failures_total {float(failed)}" in text, text


def test_pause_resume_and_delete_over_the_api(api: ApiServer) -> None:
    db = make_engine(url=api.db_url, pool_size=1)  # type: ignore[attr-defined]
    try:
        with api.client("admin") as c:
            start = (datetime.now(UTC) - timedelta(hours=3)).isoformat()
            r = c.post("/v1/reverification-policies", json={
                "name": f"ops-{uuid.uuid4().hex[:6]}", "interval_seconds": 3600,
                "sample_rate": 0.5, "first_window_start": start,
                "drift_alert_threshold": 0.1})
            assert r.status_code == 201, r.text
            pid = r.json()["id"]
            assert r.json()["drift_alert_threshold"] == 0.1
            paused = c.patch(f"/v1/reverification-policies/{pid}", json={"enabled": False})
            assert paused.status_code == 200 and paused.json()["enabled"] is False
            # paused: no windows
            assert reverification.run_due(db, api_settings(api), api_service(api)) == []
            resumed = c.patch(f"/v1/reverification-policies/{pid}", json={"enabled": True})
            assert resumed.json()["enabled"] is True
            made = reverification.run_due(db, api_settings(api), api_service(api))
            assert len(made) >= 2  # the windows that ended meanwhile
            bad = c.patch(f"/v1/reverification-policies/{pid}", json={"enabled": "maybe"})
            assert bad.status_code == 422
            assert c.delete(f"/v1/reverification-policies/{pid}").status_code == 204
            assert c.delete(f"/v1/reverification-policies/{pid}").status_code == 404
            listed = c.get("/v1/reverification-policies").json()["items"]
            assert pid not in {p["id"] for p in listed}
            # its runs and reports stay
            assert c.get(f"/v1/reverification-runs/{made[0]}").status_code == 200
        with api.client("reviewer") as c:
            assert c.patch(f"/v1/reverification-policies/{pid}",
                           json={"enabled": False}).status_code == 403
        with session_scope(db) as s:
            actions = [a for a in s.scalars(select(AuditEvent.action).where(
                AuditEvent.target == pid).order_by(AuditEvent.id))]
            assert actions == ["policy.create", "policy.pause", "policy.resume",
                               "policy.delete"], actions
            leaves = [e.kind for e in s.scalars(select(AdminEvent).where(
                AdminEvent.target == pid).order_by(AdminEvent.log_index))]
            assert leaves == ["policy.created", "policy.paused", "policy.resumed",
                              "policy.deleted"], leaves
            assert s.scalar(select(func.count()).select_from(ReverificationRun).where(
                ReverificationRun.id.in_(made), ReverificationRun.policy_id.is_(None))) == len(made)
    finally:
        db.dispose()


def api_service(api: ApiServer) -> Any:
    from ledger.replay.records import Signer

    return Signer.from_file(api.service_key_file, "ledger",  # type: ignore[attr-defined]
                            "ledger-service")


def api_settings(api: ApiServer) -> Any:
    from ledger.settings import Settings

    return Settings(database_url=api.db_url)  # type: ignore[attr-defined]
