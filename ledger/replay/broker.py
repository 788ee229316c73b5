"""Publishing replay jobs: to Celery queues ``replay.<fingerprint_id>`` over Redis, or to
an in-process worker (the embedded demo). Jobs are published only after the transaction
that made them commits; the sweeper re-publishes anything that did not get through, so
the database (the outbox) is the source of truth and a Redis restart loses nothing."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Protocol

from celery import Celery

from ledger.core.fingerprint import replay_queue
from ledger.settings import Settings

TASK_REPLAY = "ledger.replay_job"


class Publisher(Protocol):
    def publish(self, job_id: str, fingerprint_id: str) -> None: ...


def make_celery(settings: Settings, *, publish_timeout_s: float | None = None) -> Celery:
    """The Celery app of workers, beat and publishers. ``publish_timeout_s`` bounds a
    publish (connect and send, no retries) for callers that must not wait on the broker:
    the API, which leaves an undelivered job to the sweeper."""
    transport: dict[str, object] = {"visibility_timeout": settings.replay_visibility_timeout_s}
    app = Celery("inference-ledger", broker=settings.broker_url)
    app.conf.update(
        task_acks_late=True,                    # ack after the replay, not before
        task_reject_on_worker_lost=True,        # a killed worker's job goes back
        worker_prefetch_multiplier=1,           # a worker holds one job at a time
        task_ignore_result=True,                # results live in Postgres
        task_default_queue="replay.unrouted",
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    if publish_timeout_s is not None:
        transport.update(socket_connect_timeout=publish_timeout_s,
                         socket_timeout=publish_timeout_s, retry_on_timeout=False,
                         max_retries=0)
        app.conf.update(broker_connection_timeout=publish_timeout_s,
                        broker_connection_retry=False, broker_connection_max_retries=0,
                        broker_pool_limit=4)
    return app


@lru_cache(maxsize=4)
def _celery_for(broker_url: str, visibility: int, publish_timeout_s: float | None) -> Celery:
    return make_celery(Settings(broker_url=broker_url, replay_visibility_timeout_s=visibility),
                       publish_timeout_s=publish_timeout_s)


class CeleryPublisher:
    """Publishes jobs to ``replay.<fingerprint_id>``. With ``timeout_s`` a publish fails
    (raises) within about that long when the broker is down instead of retrying."""

    def __init__(self, settings: Settings, *, timeout_s: float | None = None) -> None:
        self.app = _celery_for(settings.broker_url, settings.replay_visibility_timeout_s,
                               timeout_s)
        self.expires = settings.replay_expires_s
        self.timeout_s = timeout_s

    def warm(self) -> None:
        """Build Celery's publishing machinery (imports, the producer pool, the Redis
        transport) without connecting, so that the first publish costs what the others do
        (it is 0.1-0.5 s otherwise: longer than the publish timeout itself)."""
        self.app.loader.import_default_modules()
        with self.app.producer_or_acquire() as producer:
            _ = producer.connection.transport, self.app.amqp.router

    def publish(self, job_id: str, fingerprint_id: str) -> None:
        self.app.send_task(TASK_REPLAY, args=[job_id], queue=replay_queue(fingerprint_id),
                           expires=self.expires, retry=False)


class InProcessPublisher:
    """Hands jobs to one in-process worker thread, in publish order (``ledger demo``).

    Like a queue that only this worker's fingerprint consumes: jobs for other fingerprints
    are not taken, and their disputes wait for a worker, as they would with Redis."""

    def __init__(self, run: Callable[[str], object], fingerprints: set[str]) -> None:
        self.run = run
        self.fingerprints = fingerprints
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._consume, name="ledger-inprocess-worker",
                                        daemon=True)
        self._thread.start()

    def publish(self, job_id: str, fingerprint_id: str) -> None:
        if fingerprint_id not in self.fingerprints:
            raise RuntimeError(f"no in-process consumer for replay.{fingerprint_id}")
        with self._lock:
            self._pending += 1
        self._queue.put(job_id)

    def _consume(self) -> None:
        while (job_id := self._queue.get()) is not None:
            try:
                self.run(job_id)
            except Exception:
                logging.getLogger("ledger.worker").exception("in-process job %s", job_id)
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float = 120) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)
