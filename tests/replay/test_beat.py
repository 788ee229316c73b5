"""Exactly one beat ticks; a second waits for the first's lock and takes over when it stops."""

from __future__ import annotations

import threading
import time

import pytest

from ledger.db.session import make_engine
from ledger.replay import beat
from ledger.settings import Settings


def test_one_beat_at_a_time_and_takeover(db_url: str) -> None:
    settings = Settings(database_url=db_url)
    engine = make_engine(settings, pool_size=4)
    ticks: dict[str, int] = {"a": 0, "b": 0}
    stop_a, stop_b = threading.Event(), threading.Event()
    a = threading.Thread(target=beat.run, args=(engine, None, settings, None), kwargs={
        "interval_s": 0.05, "stop": stop_a,
        "on_tick": lambda _: ticks.__setitem__("a", ticks["a"] + 1)}, daemon=True)
    a.start()
    time.sleep(0.5)
    with pytest.raises(beat.AlreadyRunning):
        beat.run(engine, None, settings, None, wait_for_lock=False, interval_s=0.05)
    b = threading.Thread(target=beat.run, args=(engine, None, settings, None), kwargs={
        "interval_s": 0.05, "stop": stop_b,
        "on_tick": lambda _: ticks.__setitem__("b", ticks["b"] + 1)}, daemon=True)
    b.start()
    time.sleep(0.5)
    assert ticks["a"] > 0 and ticks["b"] == 0  # b waits
    stop_a.set()
    a.join(5)
    deadline = time.monotonic() + 5
    while ticks["b"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ticks["b"] > 0  # b took over
    stop_b.set()
    b.join(5)
    engine.dispose()
