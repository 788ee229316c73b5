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

In batch-invariant mode on CUDA the decoder also captures **prompt forwards** (``prefill``:
packed prompt rows of any slots and positions, ``model.prefill_rows``) per bucket of rows
(``PREFILL_BUCKETS``, all captured at the first prompt forward). Launched eagerly, a prompt
forward is ~700 launches whose host time (~20-30 ms on an H200 host) dwarfs the GPU's (~8 ms for 128
rows), and every running request waits for it. Padding rows there feed token 0 at the
cache's spare position (never a live one) of slot 0 with a length of 1, and their logits
are never read; a real row's bits do not depend on them (every op is row-wise, attention
reads the row's own slot up to its own length). Prompt graphs keep their own memory pool:
a decode step's logits are still in use while a prompt forward runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from workers.engine import ops
from workers.engine.model import KVCache, Transformer, decode_one_token, prefill_rows

log = logging.getLogger(__name__)


def decode_bucket(batch: int) -> int:
    """The padded batch size a decode step of ``batch`` rows runs at (next power of two)."""
    return 1 << max(batch - 1, 0).bit_length()


#: Capture prompt forwards (0: run them eagerly; benchmarks/join_step.py compares the two).
PREFILL_GRAPHS = 1
#: Prompt rows a captured prompt forward runs at (padded up); more rows run eagerly. Past
#: 128 rows a forward is compute-bound, so buckets grow by 64 rather than doubling.
PREFILL_BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)


#: Logit rows of a captured prompt forward (a bucket's own rows, if fewer): the chunks
#: completing a prompt in it and a mixed step's decode tokens, at most (more run eagerly).
#: 128: a mixed step of 64 running requests and its prompts; up to 128 rows the LM head
#: reads its weights once (one 128-row tile) whatever the count.
PREFILL_LOGIT_ROWS = 128


def prefill_bucket(rows: int) -> int | None:
    """The padded row count a prompt forward of ``rows`` rows runs at; None: eagerly."""
    return next((b for b in PREFILL_BUCKETS if rows <= b), None)


@dataclass
class _Prefill:
    tokens: Tensor                    # [bucket] int64, static inputs ...
    positions: Tensor
    slots: Tensor
    lens: Tensor                      # [bucket] int32: position + 1 (padding rows: 1)
    last: Tensor                      # [L] int64: rows whose logits are wanted (L: logit rows)
    graph: torch.cuda.CUDAGraph | None = None
    logits: Tensor | None = None      # [L, V] fp32, the graph's output
    failed: bool = False


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
        self._prefills: dict[int, _Prefill] = {}          # by rows bucket
        self._prefill_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    @property
    def captured(self) -> list[tuple[bool, int]]:
        """(batch_invariant, bucket) of every step captured as a CUDA graph so far."""
        return sorted(key for key, step in self._steps.items() if step.graph is not None)

    @property
    def captured_prefills(self) -> list[int]:
        """Rows buckets of the prompt forwards captured so far."""
        return sorted(key for key, p in self._prefills.items() if p.graph is not None)

    def _check_rope(self) -> None:
        if self.model._rope_cos is not self._rope:  # tables replaced: graphs read stale ones
            self.model.ensure_rope(self.cache.max_seq)
            self._rope = self.model._rope_cos
            self._steps.clear()
            self._prefills.clear()

    def prefill(self, tokens: Tensor, positions: Tensor, slots: Tensor, cu_seqlens: Tensor
                ) -> Tensor | None:
        """A prompt forward (``model.prefill``'s inputs, on the device) as a captured graph:
        fp32 logits [C, V] of each chunk's last row (a tensor of its own). None where none
        applies (not invariant mode on CUDA with graphs, more rows than a bucket, more
        logit rows than ``PREFILL_LOGIT_ROWS``): the caller runs ``model.prefill``. The first
        call captures every bucket (~1 s on an H200), so that no later step waits for one."""
        t, c = tokens.shape[0], cu_seqlens.shape[0] - 1
        bucket = prefill_bucket(t)
        if not (PREFILL_GRAPHS and self.cuda_graphs and ops.rows_attention_applies(tokens)) \
                or bucket is None or not 1 <= c <= min(bucket, PREFILL_LOGIT_ROWS):
            return None
        self._check_rope()
        self._capture_prefills()
        p = self._prefills[bucket]
        p.tokens[:t].copy_(tokens)
        p.positions[:t].copy_(positions)
        p.slots[:t].copy_(slots)
        torch.add(positions, 1, out=p.lens[:t])
        p.last[:c].copy_(cu_seqlens[1:])
        p.last[:c].sub_(1)
        if t < bucket:          # padding rows: token 0 at slot 0's spare position, length 1
            p.tokens[t:].zero_()
            p.positions[t:].fill_(self.cache.max_seq - 1)
            p.slots[t:].zero_()
            p.lens[t:].fill_(1)
        p.last[c:].zero_()
        if p.graph is not None and p.logits is not None:
            p.graph.replay()
            return p.logits[:c].clone()
        return self._run_prefill(p)[:c]              # its capture failed: eagerly

    def warm_up(self, rows: int) -> int:
        """Capture now what the first steps of up to ``rows`` running requests would: the
        decode step of every bucket up to ``rows`` (in the current kernel mode) and, in
        invariant mode, the prompt forwards; the number of graphs captured. A server calls
        it before it takes requests (``ReferenceEngine.warm_up``), so that its first burst
        at a new batch size waits for no capture (~0.1-0.3 s each on an H200). Each warm-up
        step feeds token 0 at the spare position of its slots (never a live one)."""
        if not self.cuda_graphs:
            return 0
        before = len(self.captured) + len(self.captured_prefills)
        dev = self.model.device
        bucket, last = 1, min(decode_bucket(rows), self.cache.slots)
        while True:
            zeros = torch.zeros(bucket, dtype=torch.int64, device=dev)
            self.step(zeros, torch.full_like(zeros, self.cache.max_seq - 1))
            if bucket >= last:
                break
            bucket *= 2
        if PREFILL_GRAPHS and ops.rows_attention_applies(self._rope):   # (step checked it)
            self._capture_prefills()
        torch.cuda.synchronize(dev)
        return len(self.captured) + len(self.captured_prefills) - before

    def _capture_prefills(self) -> None:
        """Every prompt bucket's graph, once (all at the first prompt forward or warm-up)."""
        if not self._prefills:
            for rows in PREFILL_BUCKETS:
                self._capture_prefill(self._padding_prefill(rows, self.model.device))

    def _padding_prefill(self, rows: int, device: torch.device) -> _Prefill:
        """The static inputs of a ``rows`` bucket, every row a padding row."""
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        p = self._prefills[rows] = _Prefill(
            tokens=zeros, positions=torch.full_like(zeros, self.cache.max_seq - 1),
            slots=zeros.clone(), lens=torch.ones(rows, dtype=torch.int32, device=device),
            last=torch.zeros(min(rows, PREFILL_LOGIT_ROWS), dtype=torch.int64, device=device))
        return p

    def _run_prefill(self, p: _Prefill) -> Tensor:
        return prefill_rows(self.model, self.cache, p.tokens, p.positions, p.slots, p.lens,
                            p.last)

    def _capture_prefill(self, p: _Prefill) -> None:
        """As ``_capture``, on padding rows only: their k/v go to slot 0's spare position."""
        captured = _capture_graph(lambda: self._run_prefill(p), self._prefill_pool,
                                  self.model.device, f"{p.tokens.shape[0]}-row prompt forward")
        if captured is None:
            p.failed = True
        else:
            p.graph, p.logits = captured

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions [B] int64 on the model's device (slot b holds sequence b).

        Returns fp32 logits [B, V]: a view of a static buffer, valid until the next step.
        """
        b = tokens.shape[0]
        bucket = min(decode_bucket(b), self.cache.slots)
        assert b <= bucket, f"batch {b} exceeds the cache's {self.cache.slots} slots"
        self._check_rope()
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
        captured = _capture_graph(lambda: self._run(step), self._pool, self.model.device,
                                  f"{step.tokens.shape[0]}-row decode step")
        if captured is None:
            step.failed = True
        else:
            step.graph, step.logits = captured


def _capture_graph(run: Callable[[], Tensor], pool: Any, device: torch.device, what: str
                   ) -> tuple[torch.cuda.CUDAGraph, Tensor] | None:
    """``run`` once eagerly (it compiles and allocates what capture must not: Triton
    kernels, counters), then captured into a graph in ``pool``: (graph, its output), or
    None (logged) where capture fails and the caller runs ``run`` eagerly instead."""
    run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: the digest threads may wait on CUDA events meanwhile.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = run()
    except Exception as exc:  # noqa: BLE001  # pragma: no cover - depends on the torch build
        log.warning("CUDA graph capture of a %s failed (%s: %s); running it eagerly", what,
                    type(exc).__name__, exc)
        return None
    return graph, out
