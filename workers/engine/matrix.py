"""The replay matrix: replay stored records under the serving axes a worker can vary itself.

A *cell* is a set of axis values, written ``axis:value`` joined by ``+``
(``batch:8+chunk:16``); ``alone`` is the plain replay (one request at a time, whole
prompt, no prefix cache, CUDA graphs on where there are any, batch-invariant kernels):

==================  ==========================================================================
axis                values
==================  ==========================================================================
``batch``           N: the sample runs as co-tenants of one continuous batch of N slots
``arrivals``        S: continuous batch of 8, record i is added at engine step i*S
``chunk``           C: prefill chunk of C tokens (with ``batch:8`` unless a batch is given)
``prefix``          ``warm``: the sample runs once to fill a prefix cache, then is replayed
                    (batch 8); ``cold``: an empty prefix cache
``graphs``          ``off``: decode steps eager (CUDA; on CPU there are no graphs: noted)
``kernels``         ``default``: the fast kernels (batch invariance off), batch 8
==================  ==========================================================================

Each cell's replays are compared with the records (``ledger.replay.matrix.compare``).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ledger.replay.matrix import (
    DEFAULT_CELLS,
    CellResult,
    Replayed,
    compare,
    parse_cell,
)
from workers.engine.api import GenerationRequest, SamplingParams
from workers.engine.prefix_cache import PrefixCache
from workers.engine.reference import ReferenceEngine

#: Top logprobs asked of every replay (reports the top-K at k-1 and k of a divergence).
TOP_K = 5


@dataclass(frozen=True)
class Record:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    output: Mapping[str, Any]


def record_from_statement(request_id: str, statement: Any) -> Record:
    """A matrix record from a signed (and checked) execution envelope statement."""
    p = statement.predicate
    out = p.output
    return Record(
        request_id=str(p.request_id or request_id), prompt_token_ids=tuple(p.prompt_token_ids),
        sampling=SamplingParams.from_mapping(p.sampling.model_dump()),
        output={"token_ids": list(out.token_ids), "logprobs": out.logprobs,
                "logits_sha256": out.logits_sha256,
                "top_logprobs": [[(e.token_id, e.logprob) for e in step]
                                 for step in out.top_logprobs]
                if out.top_logprobs is not None else None})


def _peak_memory(engine: ReferenceEngine) -> int | None:
    if engine.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(engine.device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _requests(records: Sequence[Record]) -> list[GenerationRequest]:
    return [GenerationRequest(r.request_id, r.prompt_token_ids, replace(
        r.sampling, logprobs=max(TOP_K, r.sampling.logprobs or 0))) for r in records]


def _replay(engine: ReferenceEngine, requests: list[GenerationRequest], axes: dict[str, Any]
            ) -> tuple[list[Any], list[float]]:
    """Results in request order and per-request latency (added -> finished)."""
    batch = axes.get("batch", 8 if axes else 1)
    offset = axes.get("arrivals")
    added: dict[int, float] = {}
    latencies: dict[int, float] = {}
    results: dict[int, Any] = {}
    with engine.batcher(max_batch=batch, prefill_chunk=axes.get("chunk")) as batcher:
        pending = list(requests)
        while pending or not batcher.idle:
            while pending and (offset is None or batcher.steps >= offset * len(added)):
                added[batcher.add(pending.pop(0))] = time.perf_counter()
            if batcher.waiting or batcher.running:
                batcher.step()
            for f in batcher.take_finished():
                results[f.ticket] = f.result
                latencies[f.ticket] = time.perf_counter() - added[f.ticket]
            if pending and batcher.idle:
                batcher.steps += 1            # nothing running: let the clock reach the next
    return [results[t] for t in sorted(results)], [latencies[t] for t in sorted(latencies)]


def run_cell(engine: ReferenceEngine, records: Sequence[Record], spec: str) -> CellResult:
    axes = parse_cell(spec)
    saved = (engine.batch_invariant, engine.cuda_graphs, engine.prefix_cache)
    note = None
    try:
        engine.batch_invariant = axes.get("kernels", "invariant") == "invariant"
        if axes.get("graphs") == "off":
            if engine.device.type == "cuda":
                engine.cuda_graphs = False
                engine._decoder = engine._cache = None
            else:
                note = "no CUDA graphs on CPU: eager in every cell"
        engine.prefix_cache = PrefixCache(pages=4096) if "prefix" in axes else None
        requests = _requests(records)
        if axes.get("prefix") == "warm":
            _replay(engine, requests, {**axes, "prefix": None})       # fills the cache
        if engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(engine.device)
        began = time.perf_counter()
        results, latencies = _replay(engine, requests, axes)
        seconds = time.perf_counter() - began
        extra = {}
        if engine.prefix_cache is not None:
            extra["prefix_hit_tokens"] = engine.prefix_cache.stats.hit_tokens
        comparisons = [compare(r.request_id, r.output, Replayed(
            token_ids=res.token_ids, logprobs=res.logprobs, top_logprobs=res.top_logprobs,
            logits_sha256=res.logits_sha256)) for r, res in zip(records, results, strict=True)]
        return CellResult(name=spec, axes=axes, comparisons=comparisons, seconds=seconds,
                          new_tokens=sum(len(r.token_ids) for r in results),
                          latencies_s=latencies, peak_memory_bytes=_peak_memory(engine),
                          note=note, extra=extra)
    finally:
        if engine.cuda_graphs != saved[1]:
            engine._decoder = engine._cache = None
        engine.batch_invariant, engine.cuda_graphs, engine.prefix_cache = saved


def run_matrix(engine: ReferenceEngine, records: Sequence[Record],
               cells: Sequence[str] = DEFAULT_CELLS) -> list[CellResult]:
    for spec in cells:
        parse_cell(spec)                      # refuse a bad cell before any work
    return [run_cell(engine, records, spec) for spec in cells]
