"""The replay worker believes its trust policy, not the database it reads (real
PostgreSQL, real engine, in-process worker).

The insider below has the database superuser: they insert their own ``log`` and
``producer`` rows into signing_keys, swap an envelope for one their producer key signed,
recompute the leaf, the tiles and every checkpoint and re-sign them with their log key.
`ledger audit` without external checkpoints cannot tell; a worker that took its keys from
the database would replay the forged record and sign a *diverged* verdict on the model.
With the policy the job is ``unverifiable``, with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select

from ledger.core.dsse import envelope_from_obj
from ledger.core.keys import generate_private_key, key_id, public_raw
from ledger.core.logentry import dsse_digest, log_entry_bytes
from ledger.core.merkle import leaf_hash
from ledger.db.models import Envelope, JobAttempt, ReplayJob, Verdict
from ledger.db.session import session_scope
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.replay import jobs as job_service
from ledger.settings import Settings
from tests.helpers import REPO, component_env
from tests.replay.conftest import ORIGIN, Stack, record, tamper
from tests.replay.test_replay_inprocess import ingest_all, open_dispute

EMPTY_ROOT = bytes.fromhex("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")


def as_superuser(stack: Stack, *sql: tuple[str, tuple[object, ...]]) -> None:
    url = stack.settings.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        conn.execute("SET session_replication_role = replica")
        for statement, params in sql:
            conn.execute(statement, params)


def resign_log(stack: Stack, forged_log: LogSigner) -> None:
    """Throw the checkpoints and tiles away and rebuild them signed by ``forged_log``."""
    as_superuser(stack, ("DELETE FROM checkpoints", ()), ("DELETE FROM tiles", ()),
                 ("UPDATE log_tree SET size = 0, root_hash = %s", (EMPTY_ROOT,)),
                 ("INSERT INTO signing_keys (keyid, public_key, purpose, name) "
                  "VALUES (%s, %s, 'log', %s)",
                  (key_id(forged_log.public_key), forged_log.public_key, ORIGIN)))
    integrate_all(stack.db, forged_log)


def verdict_of(stack: Stack, job_id: str) -> Verdict:
    with session_scope(stack.db) as s:
        v = s.scalar(select(Verdict).where(Verdict.job_id == uuid.UUID(job_id)))
        assert v is not None
        s.expunge(v)
        return v


def reverify(stack: Stack, request_id: str) -> str:
    with session_scope(stack.db) as s:
        env = s.scalar(select(Envelope).where(Envelope.request_id == request_id))
        assert env is not None
        job = job_service.create_job(s, fingerprint_id=env.fingerprint_id, kind="reverification",
                                     items=[(env.log_index, request_id, None)],
                                     settings=stack.settings)
        return str(job.id)


def test_forged_log_and_producer_keys_give_unverifiable_not_a_verdict(
        stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 4, seed=11)
    ingest_all(stack, [r.envelope for r in recs])
    target = recs[2]
    forged_producer = generate_private_key()
    forged = tamper(target, forged_producer, k=2, new_request_id=target.request_id)
    dsse_bytes = envelope_from_obj(forged.envelope).canonical_bytes()
    digest = dsse_digest(dsse_bytes)
    with session_scope(stack.db) as s:
        index = s.scalar(select(Envelope.log_index).where(
            Envelope.request_id == target.request_id))
    entry = log_entry_bytes("envelope", target.request_id, digest)
    fkid = key_id(public_raw(forged_producer))
    as_superuser(stack,
                 ("INSERT INTO signing_keys (keyid, public_key, purpose, name) "
                  "VALUES (%s, %s, 'producer', 'gateway')", (fkid, public_raw(forged_producer))),
                 ("UPDATE envelopes SET dsse = %s, dsse_sha256 = %s, keyids = %s "
                  "WHERE log_index = %s", (dsse_bytes, bytes.fromhex(digest), [fkid], index)),
                 ("UPDATE log_entries SET entry = %s, leaf_hash = %s WHERE idx = %s",
                  (entry, leaf_hash(entry), index)))
    resign_log(stack, LogSigner(ORIGIN, generate_private_key()))

    # What the database alone would have made of it: a verdict on the model.
    insecure = ReplayWorker(Settings(database_url=stack.settings.database_url, log_name=ORIGIN,
                                     worker_dead_after_s=30), stack.db, models=["tiny-demo"],
                            signer=stack.worker_signer, insecure_dev=True)
    insecure.register()
    job = reverify(stack, target.request_id)
    assert insecure.run_job(job) == "done"
    assert verdict_of(stack, job).outcome == "diverged"

    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.register()
    _, job = open_dispute(stack, target.request_id)
    assert worker.run_job(job) == "done"
    v = verdict_of(stack, job)
    assert v.outcome == "unverifiable" and v.tier is None
    assert f"producer key {fkid} is not vouched for" in v.details["reason"], v.details


def test_a_log_resigned_by_a_forged_key_is_unverifiable(stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 3, seed=12)
    ingest_all(stack, [r.envelope for r in recs])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.register()
    honest = reverify(stack, recs[0].request_id)
    assert worker.run_job(honest) == "done"
    assert verdict_of(stack, honest).outcome == "reproduced"  # the same job, untouched log

    resign_log(stack, LogSigner(ORIGIN, generate_private_key()))
    job = reverify(stack, recs[1].request_id)
    assert worker.run_job(job) == "done"
    v = verdict_of(stack, job)
    assert v.outcome == "unverifiable"
    assert v.details["reason"].startswith("not verifiably in the log:"), v.details
    assert "signature" in v.details["reason"] or "key" in v.details["reason"]


def test_an_unvouched_producer_key_is_unverifiable(stack: Stack, tiny_engine: Any) -> None:
    """A producer row inserted by the superuser (no registry leaf): ingest accepts what it
    signs (ingest reads the table), the worker does not."""
    from workers.replay import ReplayWorker

    rogue = generate_private_key()
    as_superuser(stack, ("INSERT INTO signing_keys (keyid, public_key, purpose, name) "
                         "VALUES (%s, %s, 'producer', 'rogue')",
                         (key_id(public_raw(rogue)), public_raw(rogue))))
    recs = record(tiny_engine, rogue, 1, seed=13, prefix="rogue")
    ingest_all(stack, [r.envelope for r in recs])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.register()
    job = reverify(stack, recs[0].request_id)
    assert worker.run_job(job) == "done"
    v = verdict_of(stack, job)
    assert v.outcome == "unverifiable"
    assert "is not vouched for by a registry leaf" in v.details["reason"]


def test_a_foreign_job_message_writes_nothing(stack: Stack, tiny_engine: Any) -> None:
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 1, seed=14)
    ingest_all(stack, [r.envelope for r in recs])
    worker = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"],
                          signer=stack.worker_signer)
    worker.register()
    with session_scope(stack.db) as s:
        index = s.scalar(select(Envelope.log_index))
        job = job_service.create_job(s, fingerprint_id="fp-0123456789abcdef",
                                     kind="reverification",
                                     items=[(index, recs[0].request_id, None)],
                                     settings=stack.settings)
        job_id = str(job.id)

    def snapshot() -> tuple[Any, ...]:
        with session_scope(stack.db) as s:
            j = s.get(ReplayJob, uuid.UUID(job_id))
            assert j is not None
            return (s.scalar(select(func.count()).select_from(JobAttempt)), j.state,
                    j.attempts, j.published_at, j.worker_id,
                    s.scalar(select(func.count()).select_from(Verdict)))

    before = snapshot()
    for _ in range(5):
        assert worker.run_job(job_id) == "refuse"
    assert worker.run_job(str(uuid.uuid4())) == "skip"
    assert worker.run_job("not-a-job") == "skip"
    assert snapshot() == before


def test_a_worker_without_a_trust_policy_refuses_to_start(stack: Stack, tmp_path: Path) -> None:
    from workers.replay import NoTrustPolicy, ReplayWorker

    bare = Settings(database_url=stack.settings.database_url, log_name=ORIGIN)
    with pytest.raises(NoTrustPolicy, match="LEDGER_TRUST_POLICY_FILE"):
        ReplayWorker(bare, stack.db, models=["tiny-demo"], signer=stack.worker_signer)
    key = tmp_path / "worker.pem"
    from ledger.core.keys import private_pem

    key.write_bytes(private_pem(stack.worker_signer.key))
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_TRUST_POLICY_FILE"}
    r = subprocess.run([sys.executable, "-m", "ledger.cli.main", "worker", "--models",
                        "tiny-demo", "--key", str(key), "--loglevel", "WARNING"], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**env, **component_env(["worker"], {
                           "LEDGER_DATABASE_URL": stack.settings.database_url})})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "LEDGER_TRUST_POLICY_FILE" in lines[0], r.stderr
    assert "--insecure-dev" in lines[0]
