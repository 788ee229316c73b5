"""Alerts from re-verification: drift above a policy's threshold and failed fingerprint
gates, as a signed webhook (``LEDGER_WEBHOOK_URL``) and as Prometheus metrics.

Each tick ``ledger beat`` looks at the runs of the last day that are complete, records an
``alerts`` row for each that calls for one (unique per run, so a restart or a second look
sends nothing twice) and POSTs every undelivered alert, retrying with exponential back-off
up to ``LEDGER_WEBHOOK_RETRIES`` times. The body is JSON; its signature, over the exact
bytes, is ``X-Ledger-Signature: sha256=<hex HMAC-SHA256 with LEDGER_WEBHOOK_SECRET>`` or,
without a secret, ``ed25519=<base64>`` by the service key (keyid in ``X-Ledger-Keyid``).

:class:`DriftCollector` serves, from the database, the drift rate of the latest complete
run per (fingerprint, model) and the number of failed gates on ``ledger serve``'s
``/metrics`` listener.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy import Engine, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.db.models import Alert, ReverificationPolicy, ReverificationRun
from ledger.db.session import session_scope
from ledger.replay import reverification
from ledger.replay.records import Signer
from ledger.settings import Settings

if TYPE_CHECKING:
    from ledger.replay.trusted import RecordChecker

log = logging.getLogger("ledger.alerts")
LOOKBACK = timedelta(days=1)
METRICS_LOOKBACK = timedelta(days=7)  # drift of runs older than this is not served
FIRST_BACKOFF_S = 0.5


def _alert_for(run: ReverificationRun, report: dict[str, Any],
               policy: ReverificationPolicy | None) -> tuple[str, dict[str, Any]] | None:
    if not report["complete"]:
        return None
    if run.kind == "gate":
        if report["gate"]["passed"]:
            return None
        return "gate_failed", {"alert": "gate_failed", "run_id": str(run.id),
                               **report["gate"], "counts": report["counts"],
                               "summary": report["summary"],
                               "model_sha256": run.details.get("model_sha256")}
    if policy is None or policy.drift_alert_threshold is None:
        return None
    threshold = policy.drift_alert_threshold
    over = [g for g in report["drift"]
            if g["drift_rate"] is not None and g["drift_rate"] > threshold]
    if not over:
        return None
    return "drift", {"alert": "drift", "run_id": str(run.id), "policy": policy.name,
                     "policy_id": str(policy.id), "threshold": threshold, "groups": over,
                     "window_start": run.window_start.isoformat(),
                     "window_end": run.window_end.isoformat(),
                     "diverged": report["diverged"][:20]}


def record_due(engine: Engine, now: datetime | None = None,
               settings: Settings | None = None) -> int:
    """Record an alert for every recent complete run that calls for one; returns how many
    were new. ``settings``: whose trust policy a gate's signed matrix report is checked
    against."""
    now = now or datetime.now(UTC)
    checker = _checker(settings)
    made = 0
    with session_scope(engine) as session:
        seen = set(session.scalars(select(Alert.ref)))
        runs = list(session.scalars(select(ReverificationRun).where(
            ReverificationRun.created_at >= now - LOOKBACK)))
        for run in runs:
            if str(run.id) in seen:
                continue
            policy = session.get(ReverificationPolicy, run.policy_id) if run.policy_id else None
            if run.kind == "policy" and (policy is None or policy.drift_alert_threshold is None):
                continue
            found = _alert_for(run, reverification.report(session, str(run.id), checker),
                               policy)
            if found is None:
                continue
            kind, body = found
            inserted = session.execute(pg_insert(Alert).values(
                kind=kind, ref=str(run.id), body=body).on_conflict_do_nothing()
                .returning(Alert.id)).first()
            made += inserted is not None
    return made


def sign_body(body: bytes, settings: Settings, signer: Signer | None) -> dict[str, str]:
    """The signature headers of a webhook body (HMAC with the secret, else Ed25519)."""
    if settings.webhook_secret is not None:
        mac = hmac.new(settings.webhook_secret.get_secret_value().encode(), body,
                       hashlib.sha256).hexdigest()
        return {"X-Ledger-Signature": f"sha256={mac}"}
    if signer is None:
        return {}
    signature = signer.key.sign(body)
    return {"X-Ledger-Signature": "ed25519=" + base64.b64encode(signature).decode(),
            "X-Ledger-Keyid": signer.keyid}


def deliver_due(engine: Engine, settings: Settings, signer: Signer | None,
                now: datetime | None = None) -> int:
    """POST every undelivered alert whose next attempt is due; returns how many got
    through. A failure (no 2xx, a connection error) is retried after 0.5 s, 1 s, 2 s, ...
    until ``webhook_retries`` retries are spent."""
    if not settings.webhook_url:
        return 0
    now = now or datetime.now(UTC)
    sent = 0
    with session_scope(engine) as session:
        due = list(session.scalars(select(Alert).where(
            Alert.delivered_at.is_(None), Alert.attempts <= settings.webhook_retries,
            Alert.next_attempt_at <= now).order_by(Alert.id).with_for_update(skip_locked=True)))
        for alert in due:
            body = json.dumps(alert.body, sort_keys=True, separators=(",", ":")).encode()
            headers = {"Content-Type": "application/json", "X-Ledger-Alert": alert.kind,
                       **sign_body(body, settings, signer)}
            alert.attempts += 1
            try:
                resp = httpx.post(settings.webhook_url, content=body, headers=headers,
                                  timeout=settings.webhook_timeout_s)
                ok, error = resp.is_success, f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"
            if ok:
                alert.delivered_at, alert.last_error = datetime.now(UTC), None
                sent += 1
            else:
                alert.last_error = error
                alert.next_attempt_at = now + timedelta(
                    seconds=FIRST_BACKOFF_S * 2 ** (alert.attempts - 1))
                log.warning("alert %s (%s) not delivered (attempt %d): %s", alert.id,
                            alert.kind, alert.attempts, error)
    return sent


def tick(engine: Engine, settings: Settings, signer: Signer | None) -> dict[str, int]:
    if not settings.webhook_url:
        return {}
    return {"alerts": record_due(engine, settings=settings),
            "alerts_sent": deliver_due(engine, settings, signer)}


class DriftCollector:
    """Prometheus collector (read at scrape time from the database):
    ``ledger_reverification_drift_rate{fingerprint_id, model_sha256}`` of the latest
    complete run, and ``ledger_gate_failures_total``, the gates that failed."""

    def __init__(self, engine: Engine, settings: Settings | None = None) -> None:
        self.engine = engine
        self.settings = settings

    def describe(self) -> list[Any]:
        return []  # collected lazily: no database access at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        drift = GaugeMetricFamily("ledger_reverification_drift_rate",
                                  "Diverged / (reproduced + diverged) in the latest complete "
                                  "re-verification run, per replay fingerprint and model.",
                                  labels=["fingerprint_id", "model_sha256"])
        failures = CounterMetricFamily("ledger_gate_failures",
                                       "Fingerprint gates whose golden sample did not all "
                                       "reproduce.")
        try:
            rates, failed = drift_rates(self.engine, self.settings)
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail on a DB blip
            log.warning("drift metrics unavailable: %s", exc)
            return
        for (fp, model), rate in sorted(rates.items()):
            drift.add_metric([fp, model], rate)
        failures.add_metric([], failed)
        yield drift
        yield failures


def _checker(settings: Settings | None) -> RecordChecker | None:
    from ledger.replay.matrix_runs import checker_for

    return None if settings is None else checker_for(settings)


def drift_rates(engine: Engine, settings: Settings | None = None
                ) -> tuple[dict[tuple[str, str], float], int]:
    """(fingerprint, model) -> drift rate of its latest complete run; failed gates."""
    checker = _checker(settings)
    rates: dict[tuple[str, str], float] = {}
    failed = 0
    since = datetime.now(UTC) - METRICS_LOOKBACK
    with session_scope(engine) as session:
        runs = list(session.scalars(select(ReverificationRun).where(
            (ReverificationRun.created_at >= since) | (ReverificationRun.kind == "gate"))
            .order_by(ReverificationRun.created_at)))
        for run in runs:
            report = reverification.report(session, str(run.id), checker)
            if not report["complete"]:
                continue
            if run.kind == "gate" and not report["gate"]["passed"]:
                failed += 1
            for group in report["drift"]:
                if group["drift_rate"] is not None:
                    rates[(group["fingerprint_id"], group["model_sha256"])] = group["drift_rate"]
    return rates, failed
