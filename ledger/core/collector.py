"""The garbage collector while a server serves: what start-up made is frozen, and young
collections are rarer (the ledger API and ``ledger engine serve`` both use it)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Container allocations between two collections of the youngest generation while a
#: server serves (CPython's default: 700).
YOUNG_COLLECTION_EVERY = 20_000


_serving_lock = threading.Lock()
#: lifespans in progress in this process, and the collector's thresholds before the first
_serving: dict[str, Any] = {"count": 0, "before": gc.get_threshold()}


@contextmanager
def collecting_less() -> Iterator[None]:
    """While a server serves: what start-up made is frozen (never scanned again: an old
    generation's collection no longer walks the model, the framework and the CUDA graphs'
    objects) and the youngest generation is collected every :data:`YOUNG_COLLECTION_EVERY`
    allocations, not 700; a request makes thousands of short-lived containers (the
    statement's models and lists). ~5-7% less API CPU per single-envelope POST
    (``benchmarks/ingest_cpu.py``, paired rounds; issue 17). When the last lifespan in
    progress leaves, the collector is put back as it was before the first (a test process
    runs many lifespans, some at once)."""
    with _serving_lock:
        if not _serving["count"]:
            _serving["before"] = before = gc.get_threshold()
            gc.collect()
            gc.freeze()
            gc.set_threshold(YOUNG_COLLECTION_EVERY, *before[1:])
        _serving["count"] += 1
    try:
        yield
    finally:
        with _serving_lock:
            _serving["count"] -= 1
            if not _serving["count"]:
                gc.set_threshold(*_serving["before"])
                gc.unfreeze()
