"""Decode steps on fixed shapes, captured once per batch bucket as CUDA graphs.

A decode step of an 8B model is ~230 kernel launches; launched from Python that is several
milliseconds of host time per step, more than the GPU needs. So the engine runs each step on
static buffers whose batch dimension is padded up to a power of two (a *bucket*), and on CUDA
captures that step once per (mode, bucket) in a ``torch.cuda.CUDAGraph`` and replays it.

Padding must not change any real row's bits. In batch-invariant mode it cannot: every op's
row result depends only on that row (linear, norms, RoPE, the elementwise ops), and decode
attention reads only its own slot up to its own length. Padded rows decode token 0 at
position 0 in cache slots past the live ones, which hold no live request (the engine keeps
live requests in slots 0..B-1), and their logits are dropped. In the default mode padding
can change bits, as any batch change can there.

The captured graph bakes in buffer addresses: the KV cache, the weights and the RoPE
tables. A decoder belongs to one cache (the engine makes a new one when it reallocates the
cache), sizes the RoPE tables for the whole cache before any capture, and drops its graphs
if the tables are ever replaced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.engine import ops
from workers.engine.model import KVCache, Transformer, decode_one_token

log = logging.getLogger(__name__)


def decode_bucket(batch: int) -> int:
    """The padded batch size a decode step of ``batch`` rows runs at (next power of two)."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class _Step:
    tokens: Tensor                    # [bucket] int64, static input
    positions: Tensor                 # [bucket] int64, static input
    graph: torch.cuda.CUDAGraph | None = None
    logits: Tensor | None = None      # [bucket, V] fp32, the graph's output
    failed: bool = False              # capture failed: run this bucket eagerly


class StaticDecoder:
    """Decode steps for one KV cache at bucketed batch sizes, CUDA-graph captured on CUDA."""

    def __init__(self, model: Transformer, cache: KVCache, *, cuda_graphs: bool) -> None:
        self.model, self.cache = model, cache
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        model.ensure_rope(cache.max_seq)
        self._rope = model._rope_cos                 # graphs read this very tensor
        self._steps: dict[tuple[bool, int], _Step] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    @property
    def captured(self) -> list[tuple[bool, int]]:
        """(batch_invariant, bucket) of every step captured as a CUDA graph so far."""
        return sorted(key for key, step in self._steps.items() if step.graph is not None)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions [B] int64 on the model's device (slot b holds sequence b).

        Returns fp32 logits [B, V]: a view of a static buffer, valid until the next step.
        """
        b = tokens.shape[0]
        bucket = min(decode_bucket(b), self.cache.slots)
        assert b <= bucket, f"batch {b} exceeds the cache's {self.cache.slots} slots"
        if self.model._rope_cos is not self._rope:  # tables replaced: graphs read stale ones
            self.model.ensure_rope(self.cache.max_seq)
            self._rope = self.model._rope_cos
            self._steps.clear()
        key = (ops.is_batch_invariant(), bucket)
        step = self._steps.get(key)
        if step is None:
            zeros = torch.zeros(bucket, dtype=torch.int64, device=tokens.device)
            step = self._steps[key] = _Step(tokens=zeros, positions=zeros.clone())
        step.tokens[:b].copy_(tokens)
        step.positions[:b].copy_(positions)
        if b < bucket:                              # padding rows: token 0 at position 0
            step.tokens[b:].zero_()
            step.positions[b:].zero_()
        if self.cuda_graphs and step.graph is None and not step.failed:
            self._capture(step)
        if step.graph is not None and step.logits is not None:
            step.graph.replay()
            return step.logits[:b]
        return self._run(step)[:b]

    def _run(self, step: _Step) -> Tensor:
        return decode_one_token(self.model, self.cache, step.tokens, step.positions,
                                static=True)

    def _capture(self, step: _Step) -> None:
        """Warm up eagerly, then capture. Neither changes the cache beyond what the replay
        that follows writes anyway: the warm-up writes this step's k/v at this step's
        positions (the replay rewrites them before reading), padding rows write dead slots."""
        self._run(step)         # compiles/allocates what capture must not (Triton, counters)
        torch.cuda.synchronize(self.model.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the digest threads may wait on CUDA events meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._run(step)
        except Exception as exc:  # noqa: BLE001  # pragma: no cover - depends on the torch build
            step.failed = True
            log.warning("CUDA graph capture of a %d-row decode step failed (%s: %s); "
                        "running it eagerly", step.tokens.shape[0], type(exc).__name__, exc)
            return
        step.graph, step.logits = graph, logits
