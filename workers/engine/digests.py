"""Per-step logits digests, computed off the critical path.

``logits_sha256[t]`` of a request is the SHA-256 of its raw fp32 logits row at step t as
little-endian IEEE binary32 (V x 4 bytes). For an 8B model with a 128256-token vocabulary
and 64 requests that is 33 MB to move to the host and hash per decode step, more than one
hashing thread gets through in the GPU's step time, so on CUDA:

* the row block is copied on the compute stream into a staging buffer (a device-to-device
  copy, ~16 us), so the next step may overwrite the logits at once;
* once the step's tokens are on the host, a second stream copies the staging buffer into
  pinned host memory while the next step computes (not before: the copy engine would make
  the tokens' few bytes wait behind those 33 MB);
* several threads hash row chunks once that copy's event has fired (``hashlib`` releases
  the GIL on large buffers).

A ring of ``RING`` such (staging, pinned) pairs lets that many steps be in flight; a
slot is reused only after its hashes are done. On CPU the logits already live on the host
and one thread hashes them while the next step runs.
"""

from __future__ import annotations

import hashlib
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def logits_digests(logits: Tensor) -> list[str]:
    """SHA-256 hex of each fp32 row's little-endian bytes. logits fp32 [B, V] on the CPU."""
    assert sys.byteorder == "little", "digests are defined over little-endian binary32"
    rows = logits.numpy()
    return [hashlib.sha256(rows[i].data).hexdigest() for i in range(rows.shape[0])]


def hashing_threads(device: torch.device) -> int:
    """Threads that hash logits: one on CPU (the engine's single intra-op thread does the
    model), up to 8 on CUDA (the host is otherwise idle there)."""
    if device.type != "cuda":
        return 1
    return max(1, min(8, (os.cpu_count() or 2) - 2))


class CpuDigester:
    """Hashes host logits on a thread while the next step runs."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool

    def stage(self, logits: Tensor) -> Tensor:
        """Hold this step's logits (host tensors: nothing to copy)."""
        return logits

    def start(self, staged: Tensor) -> list[Future[list[str]]]:
        """Digests of the rows of fp32 logits [B, V], as futures of row chunks in order."""
        return [self.pool.submit(logits_digests, staged.cpu())]


def _hash_rows(ready: torch.cuda.Event, rows: Any, lo: int, hi: int) -> list[str]:
    ready.synchronize()                         # the device-to-host copy has landed
    return [hashlib.sha256(rows[i].data).hexdigest() for i in range(lo, hi)]


def cuda_event(blocking: bool = False) -> torch.cuda.Event:
    return torch.cuda.Event(blocking=blocking)  # type: ignore[no-untyped-call]


@dataclass
class _Slot:
    staging: Tensor                             # [rows, V] fp32 on the device
    pinned: Tensor                              # [rows, V] fp32, page-locked host memory
    ready: torch.cuda.Event = field(default_factory=cuda_event)   # staging written
    # pinned written; blocking: the hashing threads sleep rather than spin while they wait
    copied: torch.cuda.Event = field(default_factory=lambda: cuda_event(blocking=True))
    futures: list[Future[list[str]]] = field(default_factory=list)


class CudaDigestRing:
    """The device and pinned buffers of :class:`CudaDigester`, kept across generate calls."""

    RING = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.slots: list[_Slot | None] = [None] * self.RING
        self.next = 0

    def slot(self, rows: int, vocab: int) -> _Slot:
        """The next slot, with room for ``rows`` rows, once nobody reads it any more."""
        i = self.next
        self.next = (self.next + 1) % self.RING
        slot = self.slots[i]
        if slot is not None:
            for future in slot.futures:         # the hashers are done with slot.pinned
                future.result()
            slot.futures = []
        if slot is None or slot.staging.shape[0] < rows or slot.staging.shape[1] != vocab:
            if slot is not None:
                slot.copied.synchronize()
            self.slots[i] = slot = _Slot(
                staging=torch.empty((rows, vocab), dtype=torch.float32, device=self.device),
                pinned=torch.empty((rows, vocab), dtype=torch.float32, pin_memory=True),
            )
        return slot


class CudaDigester:
    """Copies logits to pinned memory on a side stream; hashes them on a thread pool."""

    def __init__(self, ring: CudaDigestRing, pool: ThreadPoolExecutor, threads: int) -> None:
        assert sys.byteorder == "little", "digests are defined over little-endian binary32"
        self.ring, self.pool, self.threads = ring, pool, threads

    def stage(self, logits: Tensor) -> tuple[_Slot, int]:
        """Copy fp32 logits [B, V] (on the device) into a staging buffer, on the current
        stream: afterwards ``logits`` may be overwritten by later work on that stream.

        The copy to the host waits for :meth:`start`, which the batcher calls after the
        step's one device-to-host sync: a 33 MB copy queued on the side stream first would
        hold that sync's few bytes behind it on the copy engine (~0.9 ms per step on an
        H200, ``benchmarks/engine_steps.py``)."""
        b, v = logits.shape
        slot = self.ring.slot(b, v)
        compute = torch.cuda.current_stream(self.ring.device)
        compute.wait_event(slot.copied)         # the last copy out of this staging is done
        slot.staging[:b].copy_(logits)
        slot.ready.record(compute)
        return slot, b

    def start(self, staged: tuple[_Slot, int]) -> list[Future[list[str]]]:
        """Copy the staged rows to pinned memory on the side stream and hash them on the
        pool; futures of row chunks in order."""
        slot, b = staged
        side = self.ring.stream
        side.wait_event(slot.ready)
        with torch.cuda.stream(side):
            slot.pinned[:b].copy_(slot.staging[:b], non_blocking=True)
            slot.copied.record(side)
        rows = slot.pinned.numpy()
        step = -(-b // self.threads)
        slot.futures = [self.pool.submit(_hash_rows, slot.copied, rows, lo, min(lo + step, b))
                        for lo in range(0, b, step)]
        return list(slot.futures)

