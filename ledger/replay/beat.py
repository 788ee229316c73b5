"""`ledger beat`: the one scheduler. Each tick it runs the outbox sweeper (routing and
re-publishing jobs), samples due re-verification windows, starts fingerprint-change
gates and sends alerts (drift above a policy threshold, failed gates) to the webhook.
Exactly one runs: it holds a Postgres advisory lock for its lifetime, and a second beat
waits for the lock instead of ticking beside the first. A worker that registers notifies
the beat (``NOTIFY ledger_workers``), which ticks at once: the jobs and disputes waiting
for that worker's fingerprint are routed to it, their reason refreshed, without waiting
for the next interval."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, text

from ledger.replay import jobs
from ledger.replay.broker import Publisher
from ledger.replay.records import Signer
from ledger.settings import Settings

log = logging.getLogger("ledger.beat")
BEAT_LOCK_KEY = 0x1ED6E4  # pg_advisory_lock key of the single beat


class AlreadyRunning(RuntimeError):
    pass


def tick(engine: Engine, publisher: Publisher | None, settings: Settings,
         signer: Signer | None) -> dict[str, int]:
    """One pass of every periodic duty; returns counts (for logs and tests)."""
    from ledger.replay import gate, reverification

    out: dict[str, int] = {}
    report = jobs.sweep(engine, publisher, settings, signer, actor="beat")
    out["published"], out["awaiting"], out["recovered"] = (
        len(report.published), len(report.awaiting), len(report.recovered))
    out["runs"] = len(reverification.run_due(engine, settings, signer))
    out["gates"] = len(gate.check_new_fingerprints(engine, settings, signer))
    if out["runs"] or out["gates"]:  # publish what they created without waiting a tick
        jobs.sweep(engine, publisher, settings, signer, actor="beat")
    from ledger.replay import alerts

    out.update(alerts.tick(engine, settings, signer))  # with LEDGER_WEBHOOK_URL only
    out["erasures"] = _retention(engine, settings, signer)
    return out


def _retention(engine: Engine, settings: Settings, signer: Signer | None) -> int:
    """Retention policies (docs/privacy.md): erase what is older than each window. Needs
    the service key (each erasure is a signed leaf) and the KEK."""
    from ledger.db.session import session_scope
    from ledger.privacy import erasure
    from ledger.privacy.keys import kek_from_settings

    kek = kek_from_settings(settings)
    if signer is None or kek is None:
        return 0
    trusted = None
    if settings.trust_policy_file is not None:  # the policy's service keys, not only ours
        from ledger.core.keys import key_id
        from ledger.core.trust import load_trust_policy

        keys = load_trust_policy(settings.trust_policy_file).service_keys
        trusted = {key_id(bytes(k)): bytes(k) for k in keys}
    with session_scope(engine) as session:
        return len(erasure.run_retention(session, signer, kek, trusted=trusted))


def _until_next_tick(driver: Any, woken: threading.Event, interval_s: float,
                     stop: threading.Event) -> None:
    """Wait ``interval_s``, or less: until a worker registers (a notification on the lock's
    connection, received now or during the tick) or ``stop`` is set."""
    deadline = time.monotonic() + interval_s
    while not stop.is_set() and not woken.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for _ in driver.notifies(timeout=min(left, 0.25), stop_after=1):
            woken.set()
    woken.clear()


def run(engine: Engine, publisher: Publisher | None, settings: Settings,
        signer: Signer | None, *, interval_s: float = 2.0, wait_for_lock: bool = True,
        stop: threading.Event | None = None,
        on_tick: Callable[[dict[str, int]], None] | None = None) -> None:
    """Tick until ``stop`` is set. A lost database connection (a restart, a network blip)
    does not end the beat: it reconnects, takes the lock again and carries on."""
    stop = stop or threading.Event()
    while not stop.is_set():
        try:
            _run_locked(engine, publisher, settings, signer, interval_s=interval_s,
                        wait_for_lock=wait_for_lock, stop=stop, on_tick=on_tick)
        except AlreadyRunning:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the lock's connection was lost
            log.warning("beat lost its database connection (%s); reconnecting", exc)
            stop.wait(interval_s)


def _run_locked(engine: Engine, publisher: Publisher | None, settings: Settings,
                signer: Signer | None, *, interval_s: float, wait_for_lock: bool,
                stop: threading.Event,
                on_tick: Callable[[dict[str, int]], None] | None) -> None:
    with engine.connect() as lock_conn:
        got = lock_conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                {"k": BEAT_LOCK_KEY}).scalar_one()
        if not got:
            if not wait_for_lock:
                raise AlreadyRunning("another `ledger beat` holds the lock")
            log.warning("another beat is running; waiting to take over")
            while not stop.is_set() and not lock_conn.execute(
                    text("SELECT pg_try_advisory_lock(:k)"), {"k": BEAT_LOCK_KEY}).scalar_one():
                lock_conn.commit()
                stop.wait(interval_s)
        lock_conn.execute(text(f"LISTEN {jobs.WORKER_CHANNEL}"))
        lock_conn.commit()
        driver = lock_conn.connection.driver_connection
        assert driver is not None
        woken = threading.Event()
        driver.add_notify_handler(lambda _n: woken.set())
        while not stop.is_set():
            lock_conn.execute(text("SELECT 1"))  # the lock lives as long as this session
            lock_conn.commit()
            try:
                counts = tick(engine, publisher, settings, signer)
                if on_tick:
                    on_tick(counts)
            except Exception as exc:  # noqa: BLE001 - a blip must not stop the beat
                log.warning("beat tick failed: %s", exc)
            _until_next_tick(driver, woken, interval_s, stop)
        lock_conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": BEAT_LOCK_KEY})
        lock_conn.commit()
