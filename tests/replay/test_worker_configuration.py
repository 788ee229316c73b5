"""A worker never signs a verdict caused by its own configuration (issue 13): `ledger
check worker` names the setting, `ledger worker` refuses to start on it, and a running
worker that is misconfigured hands the job back (an ``error`` attempt, no verdict).
Real PostgreSQL, real engine, the real CLI in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from ledger.core.keys import private_pem
from ledger.db.models import JobAttempt, ReplayJob, Verdict
from ledger.db.session import session_scope
from ledger.settings import Settings
from tests.helpers import REPO, login_url, shared_broker_url
from tests.replay.conftest import ORIGIN, Stack, record
from tests.replay.test_replay_inprocess import ingest_all, open_dispute


def _env(stack: Stack, key: Path, **extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    return {**clean, "COLUMNS": "200",
            "LEDGER_DATABASE_URL": login_url(stack.settings.database_url, "worker"),
            "LEDGER_TRUST_POLICY_FILE": str(stack.settings.trust_policy_file),
            "LEDGER_WORKER_KEY_FILE": str(key), **extra}


def _ledger(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


def test_check_worker_and_worker_refuse_an_unset_log_name(stack: Stack, tiny_engine: Any,
                                                          tmp_path: Path) -> None:
    ingest_all(stack, [r.envelope for r in record(tiny_engine, stack.producer, 2, seed=3)])
    key = tmp_path / "worker.pem"
    key.write_bytes(private_pem(stack.worker_signer.key))

    bad = _ledger("check", "worker", env=_env(stack, key))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    named = [ln for ln in bad.stdout.splitlines() if "LEDGER_LOG_NAME" in ln]
    assert any(ORIGIN in ln and "checkpoints" in ln for ln in named), bad.stdout
    assert "Traceback" not in bad.stdout + bad.stderr

    good = _ledger("check", "worker", env=_env(stack, key, LEDGER_LOG_NAME=ORIGIN))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "ledger check worker: OK" in good.stdout

    worker = _ledger("worker", "--models", "tiny-demo", env=_env(stack, key))
    assert worker.returncode == 2, worker.stdout + worker.stderr
    refusals = [ln for ln in worker.stderr.splitlines() if "refusing to start" in ln]
    assert refusals and all("LEDGER_LOG_NAME" in ln for ln in refusals), worker.stderr
    assert "Traceback" not in worker.stderr


def test_a_misconfigured_worker_hands_the_job_back_without_a_verdict(
        stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 2, seed=4)
    ingest_all(stack, [r.envelope for r in recs])
    # what the issue saw: LEDGER_LOG_NAME unset, so the example default is used
    wrong = Settings(database_url=stack.settings.database_url, worker_dead_after_s=30,
                     trust_policy_file=stack.settings.trust_policy_file)
    assert wrong.log_name != ORIGIN
    worker = ReplayWorker(wrong, stack.db, models=["tiny-demo"], signer=stack.worker_signer,
                          trust=stack.trust)
    worker.register()
    _, job_id = open_dispute(stack, recs[0].request_id)
    assert worker.run_job(job_id) == "misconfigured"
    assert worker.run_job(job_id) == "misconfigured"  # redelivered: still no verdict
    with session_scope(stack.db) as s:
        job = s.get(ReplayJob, uuid.UUID(job_id))
        assert job is not None and job.state == "queued" and job.attempts == 0
        assert "LEDGER_LOG_NAME" in (job.state_reason or "")
        attempts = list(s.scalars(select(JobAttempt).where(JobAttempt.job_id == job.id)))
        assert [a.outcome for a in attempts] == ["error", "error"]
        assert all("LEDGER_LOG_NAME" in (a.detail or "") for a in attempts)
        assert s.scalar(select(func.count()).select_from(Verdict)) == 0

    # the same job, once the worker is configured right, gets its verdict
    fixed = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                         signer=stack.worker_signer)
    fixed.register()
    assert fixed.run_job(job_id) == "done"
    with session_scope(stack.db) as s:
        outcomes = list(s.scalars(select(Verdict.outcome)))
    assert outcomes == ["reproduced"]


def test_fingerprint_command_prints_what_a_started_worker_prints(stack: Stack,
                                                                 tmp_path: Path) -> None:
    """Default options on both sides, the same environment (no OMP_NUM_THREADS games)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LEDGER_") and k != "OMP_NUM_THREADS"}
    printed = _ledger("fingerprint", env=env)
    assert printed.returncode == 0, printed.stderr
    expected = json.loads(printed.stdout)["fingerprint_id"]

    key = tmp_path / "worker.pem"
    key.write_bytes(private_pem(stack.worker_signer.key))
    log = tmp_path / "worker.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ledger.cli.main", "worker", "--models", "tiny-demo",
             "--log-level", "WARNING"], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
            env={**env, **_env(stack, key, LEDGER_LOG_NAME=ORIGIN),
                 "LEDGER_BROKER_URL": shared_broker_url(), "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 240
        started = None
        while time.monotonic() < deadline and proc.poll() is None:
            lines = [ln.split() for ln in log.read_text().splitlines()]
            started = next((ln[1] for ln in lines if len(ln) == 2 and ln[0] == "fingerprint"),
                           None)
            if started:
                break
            time.sleep(0.3)
        assert started == expected, log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(30)


def test_awaiting_reason_names_the_command_and_is_refreshed_when_a_worker_registers(
        stack: Stack) -> None:
    from ledger.db.models import Dispute
    from ledger.replay import beat
    from workers.engine import load_engine
    from workers.replay import ReplayWorker

    bf16 = load_engine("tiny-demo", dtype="bfloat16")
    recs = record(bf16, stack.producer, 1, seed=5)
    ingest_all(stack, [r.envelope for r in recs])
    dispute_id, _ = open_dispute(stack, recs[0].request_id)
    with session_scope(stack.db) as s:
        d = s.get(Dispute, uuid.UUID(dispute_id))
        assert d is not None and d.state == "awaiting_worker"
        assert "`ledger fingerprint --dtype bfloat16`" in (d.state_reason or "")
        assert "`ledger worker --models DIR --dtype bfloat16`" in (d.state_reason or "")
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"], dtype="bfloat16",
                          signer=stack.worker_signer)
    # a running beat whose next tick is a minute away routes the dispute as soon as the
    # worker registers (it is notified), with a signed event
    ticks: list[dict[str, int]] = []
    stop = threading.Event()
    beat_thread = threading.Thread(target=beat.run, args=(
        stack.db, None, stack.settings, stack.service), kwargs={
        "interval_s": 60.0, "stop": stop, "on_tick": ticks.append}, daemon=True)
    beat_thread.start()
    try:
        deadline = time.monotonic() + 30
        while not ticks:
            assert time.monotonic() < deadline, "the beat did not tick"
            time.sleep(0.05)
        registered = time.monotonic()
        worker.register()
        while True:
            with session_scope(stack.db) as s:
                d = s.get(Dispute, uuid.UUID(dispute_id))
                assert d is not None
                if d.state == "queued":
                    break
            assert time.monotonic() - registered < 20, "the dispute was not routed"
            time.sleep(0.1)
        assert d.state_reason is None and len(ticks) >= 2
    finally:
        stop.set()
        beat_thread.join(30)
    assert not beat_thread.is_alive()
