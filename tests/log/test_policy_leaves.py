"""Re-verification cannot be silenced in the database: every policy change made through the
service (create, pause, resume, delete) and every window the beat claims is a signed
admin_event leaf, and ``ledger audit --trust`` reports each row of
``reverification_policies`` and ``reverification_runs`` that the leaves do not account for
(an insider with the superuser pausing, loosening, deleting or pre-claiming). Real
PostgreSQL; the tampering is done as the superuser would, triggers off."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

from ledger.core.bundle import verify_bundle
from ledger.core.keys import generate_private_key
from ledger.db.models import AdminEvent, ReverificationPolicy, ReverificationRun
from ledger.db.session import session_scope
from ledger.log.audit import audit
from ledger.log.export import Selection, bundle_lines
from ledger.log.integrator import integrate_all
from ledger.log.registry import vouched_keys
from ledger.log.signer import LogSigner
from ledger.replay import reverification
from ledger.replay.records import Signer
from ledger.services import policies
from ledger.services.apikeys import Principal
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import run_server
from tests.log.test_registry import ORIGIN, policy_for, superuser

ADMIN = Principal(key_id="00000000-0000-0000-0000-000000000001", name="alice", role="admin")
FIELDS = {"interval_seconds": 3600, "sample_rate": 1.0, "drift_alert_threshold": 0.1}


@pytest.fixture
def signers(engine: Engine) -> tuple[Signer, LogSigner]:
    service = Signer(generate_private_key(), "ledger", "ledger-service")
    log = LogSigner(ORIGIN, generate_private_key())
    with session_scope(engine) as s:
        service.ensure_registered(s)
        log.ensure_registered(s, service)
    return service, log


def _policy(engine: Engine, service: Signer, name: str, start: datetime) -> str:
    with session_scope(engine) as s:
        policy, _ = policies.create_policy(s, ADMIN, service, {"name": name, **FIELDS}, start)
        return str(policy.id)


def test_policy_changes_and_claims_are_leaves_that_verify_offline(
        engine: Engine, db_url: str, signers: tuple[Signer, LogSigner]) -> None:
    service, log = signers
    start = datetime.now(UTC) - timedelta(hours=2, minutes=30)
    pid = _policy(engine, service, "nightly", start)
    gone = _policy(engine, service, "old", start)
    with session_scope(engine) as s:
        again, outcome = policies.create_policy(s, ADMIN, service,
                                                {"name": "nightly", **FIELDS}, start)
        assert outcome is policies.CreateOutcome.EXISTING and str(again.id) == pid
        policies.set_enabled(s, ADMIN, service, pid, False)
        policies.set_enabled(s, ADMIN, service, pid, False)  # already paused: no leaf
        policies.set_enabled(s, ADMIN, service, pid, True)
        policies.delete(s, ADMIN, service, gone)
    settings = Settings(database_url=db_url, log_name=ORIGIN)
    assert reverification.run_due(engine, settings, None) == []  # no service key, no claim
    made = reverification.run_due(engine, settings, service)
    assert len(made) == 2  # the two windows that have ended
    with session_scope(engine) as s:
        events = [(e.kind, e.target) for e in s.scalars(select(AdminEvent).where(
            AdminEvent.kind.like("policy.%")).order_by(AdminEvent.log_index))]
        assert events == [("policy.created", pid), ("policy.created", gone),
                          ("policy.paused", pid), ("policy.resumed", pid),
                          ("policy.deleted", gone),
                          ("policy.window_claimed", str(made[0])),
                          ("policy.window_claimed", str(made[1]))]
        _, problems = vouched_keys(s, policy_for(service, log))
    assert problems == []
    integrate_all(engine, log)
    bundle = b"".join(bundle_lines(engine, Selection(), signer=service))
    summary = verify_bundle(bundle, trust=policy_for(service, log))
    assert summary.by_kind["admin_event"] >= len(events)
    assert audit(engine, ORIGIN, signatures=True, trust=policy_for(service, log)).ok


def test_the_audit_reports_every_row_the_leaves_do_not_account_for(
        engine: Engine, db_url: str, signers: tuple[Signer, LogSigner]) -> None:
    service, log = signers
    trust = policy_for(service, log)
    start = datetime.now(UTC) - timedelta(hours=1, minutes=30)
    paused, loosened, dropped, deleted = (
        _policy(engine, service, n, start) for n in ("paused", "loosened", "dropped", "gone"))
    with session_scope(engine) as s:
        policies.delete(s, ADMIN, service, deleted)
        deleted_at = s.scalar(select(AdminEvent.body).where(
            AdminEvent.target == deleted, AdminEvent.kind == "policy.deleted"))
        assert deleted_at is not None
    made = reverification.run_due(engine, Settings(database_url=db_url, log_name=ORIGIN),
                                  service)
    with session_scope(engine) as s:
        runs = {str(r.policy_id): str(r.id) for r in s.scalars(select(ReverificationRun))}
        assert set(runs.values()) == {str(m) for m in made}
        leaf_of = {e.target: e.log_index for e in s.scalars(select(AdminEvent))}
        assert vouched_keys(s, trust)[1] == []
    forged_policy = uuid.uuid4()
    forged_run, forged_gate = uuid.uuid4(), uuid.uuid4()
    future = start + timedelta(hours=5)
    superuser(
        db_url,
        # silence a policy, loosen another, drop a third: none of it through the service
        ("UPDATE reverification_policies SET enabled = false WHERE id = %s", (paused,)),
        ("UPDATE reverification_policies SET sample_rate = 0.0001, interval_seconds = 864000 "
         "WHERE id = %s", (loosened,)),
        ("DELETE FROM reverification_runs WHERE policy_id = %s", (dropped,)),
        ("DELETE FROM reverification_policies WHERE id = %s", (dropped,)),
        # a window claimed ahead of time, so that it is never sampled
        ("INSERT INTO reverification_runs (id, policy_id, kind, window_start, window_end, "
         "sampled) VALUES (%s, %s, 'policy', %s, %s, 0)",
         (forged_run, paused, future, future + timedelta(hours=1))),
        # a claimed window's row removed, another's count edited
        ("DELETE FROM reverification_runs WHERE id = %s", (runs[paused],)),
        ("UPDATE reverification_runs SET sampled = sampled + 5 WHERE id = %s",
         (runs[loosened],)),
        # a fingerprint gate claimed ahead of time, so that it never runs
        ("INSERT INTO reverification_runs (id, kind, window_start, window_end, sampled, "
         "details) VALUES (%s, 'gate', now(), now(), 0, %s)",
         (forged_gate, '{"new_fingerprint": "fp-new", "model_sha256": "m"}')),
        # a policy inserted without the service key, a deleted one put back
        ("INSERT INTO reverification_policies (id, name, interval_seconds, sample_rate, "
         "created_by, first_window_start) VALUES (%s, 'forged', 60, 1.0, 'mallory', now())",
         (forged_policy,)),
        ("INSERT INTO reverification_policies (id, name, interval_seconds, sample_rate, "
         "created_by, first_window_start, enabled) VALUES (%s, 'gone', 3600, 1.0, 'alice', "
         "%s, true)", (deleted, deleted_at["policy"]["first_window_start"])),
    )
    with session_scope(engine) as s:
        _, problems = vouched_keys(s, trust)
    text = "\n".join(f"{i}: {m}" for i, m in problems)
    expected = [
        (leaf_of[paused], f"re-verification policy {paused} ('paused'): enabled is False in "
                          "the table, True in the leaf"),
        (leaf_of[loosened], "sample_rate is 0.0001 in the table"),
        (leaf_of[loosened], "interval_seconds is 864000 in the table, 3600 in the leaf"),
        (leaf_of[dropped], f"creates re-verification policy {dropped} ('dropped'), which "
                           "reverification_policies lacks and no leaf deleted"),
        (None, f"re-verification run {forged_run} has no window-claim leaf"),
        (leaf_of[runs[paused]], f"claims re-verification run {runs[paused]}, which "
                                "reverification_runs lacks"),
        (leaf_of[runs[loosened]], "sampled is"),
        (None, f"re-verification policy {forged_policy} ('forged') has no creation leaf"),
        (None, f"fingerprint gate {forged_gate} has no claim leaf"),
        (leaf_of[deleted], f"re-verification policy {deleted} ('gone') was deleted by the "
                           "leaf"),
    ]
    for index, words in expected:
        assert any(i == index and words in m for i, m in problems), (words, text)
    # the CLI's audit mode that checks the registry says so, naming the first bad index
    report = audit(engine, ORIGIN, signatures=True, trust=trust)
    assert not report.ok
    assert any(p.startswith("registry: re-verification policy") for p in report.problems)
    with session_scope(engine) as s:  # the paused policy's row was the insider's doing
        assert s.get(ReverificationPolicy, uuid.UUID(paused)).enabled is False  # type: ignore[union-attr]


def test_the_api_refuses_policy_changes_without_the_service_key(db_url: str,
                                                                tmp_path: Path) -> None:
    api_keys, _ = provision(db_url)
    with run_server(db_url, log_dir=tmp_path) as server:
        h = {"Authorization": f"Bearer {api_keys['admin']}"}
        r = httpx.post(server.base_url + "/v1/reverification-policies", headers=h, timeout=30,
                       json={"name": "p", "interval_seconds": 60, "sample_rate": 1.0})
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert "LEDGER_SERVICE_KEY_FILE" in r.json()["detail"]
