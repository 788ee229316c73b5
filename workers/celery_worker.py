"""`ledger worker`: a Celery worker that consumes only ``replay.<its fingerprint_id>``.

Solo pool, prefetch 1, late acks: the process that loaded the engine is the one that runs
the job, nothing forks after CUDA is initialised, and a job whose worker dies goes back to
the queue (Redis redelivers unacknowledged messages after the visibility timeout; the
sweeper in ``ledger beat`` re-publishes sooner, once the dead worker's heartbeat stops).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ledger.core.fingerprint import replay_queue
from ledger.db.session import make_engine, session_scope
from ledger.replay.broker import TASK_REPLAY, make_celery
from ledger.replay.records import Signer
from ledger.settings import Settings
from workers.replay import ReplayWorker

if TYPE_CHECKING:
    from workers.semantic import VendorReplayWorker

log = logging.getLogger("ledger.worker")


def build_worker(settings: Settings, *, models: list[str], engine_name: str, device: str,
                 dtype: str, max_batch: int, key_file: Path | None,
                 register_key: bool = False, insecure_dev: bool = False,
                 threads: int | None = 1, hashing_progress: Any = None) -> ReplayWorker:
    from workers.replay import worker_trust

    trust = worker_trust(settings, insecure_dev=insecure_dev)  # refuses before anything
    signer = Signer.from_file(key_file or settings.worker_key_file, "worker", "replay-worker")
    if signer is None:
        raise SystemExit("a worker needs its signing key: --key FILE or LEDGER_WORKER_KEY_FILE")
    db = make_engine(settings, pool_size=3)
    worker = ReplayWorker(settings, db, models=models, engine_name=engine_name, device=device,
                          dtype=dtype, max_batch=max_batch, signer=signer, trust=trust,
                          insecure_dev=insecure_dev, threads=threads,
                          hashing_progress=hashing_progress)
    if register_key:
        _register(settings, db, signer)
    return worker


def _register(settings: Settings, db: Any, signer: Signer) -> None:
    # a registry leaf when the service key is at hand (otherwise `ledger audit`
    # reports the row, and bundles verified with a policy do not believe the key)
    service = Signer.from_file(settings.service_key_file, "ledger", "ledger-service")
    with session_scope(db) as session:
        if service is not None:
            service.ensure_registered(session)
        signer.ensure_registered(session, service)


def build_vendor_worker(settings: Settings, *, key_file: Path | None,
                        register_key: bool = False,
                        insecure_dev: bool = False) -> VendorReplayWorker:
    """A vendor worker (:mod:`workers.semantic`): no models, its vendor's key."""
    from workers.replay import worker_trust
    from workers.semantic import VendorReplayWorker

    trust = worker_trust(settings, insecure_dev=insecure_dev)
    signer = Signer.from_file(key_file or settings.worker_key_file, "worker", "vendor-worker")
    if signer is None:
        raise SystemExit("a worker needs its signing key: --key FILE or LEDGER_WORKER_KEY_FILE")
    db = make_engine(settings, pool_size=3)
    worker = VendorReplayWorker(settings, db, signer=signer, trust=trust,
                                insecure_dev=insecure_dev)
    if register_key:
        _register(settings, db, signer)
    return worker


def serve(worker: ReplayWorker, settings: Settings, *, loglevel: str = "INFO") -> None:
    app = make_celery(settings)

    @app.task(name=TASK_REPLAY, bind=True, acks_late=True,  # type: ignore[untyped-decorator]
              reject_on_worker_lost=True)  # Celery's decorator has no type hints
    def replay_job(self: Any, job_id: str) -> str:
        return worker.run_job(job_id)

    worker.register()
    worker.start_heartbeat()
    queue = replay_queue(worker.fingerprint_id)
    log.warning("worker %s consuming %s", worker.worker_id, queue)
    try:
        app.worker_main(["worker", "--queues", queue, "--pool", "solo", "--concurrency", "1",
                         "--hostname", f"{worker.worker_id}@%h", "--without-gossip",
                         "--without-mingle", "--loglevel", loglevel, "--prefetch-multiplier",
                         "1"])
    finally:
        worker.stop()
