"""The reference engine: static batches, prefill then one-token decode steps.

Requests run in the given order, ``max_batch`` at a time (the caller chooses co-tenants).
A batch is prefilled (packed prompts, in groups of at most ``prefill_token_budget``
tokens), then decoded one token per step; finished requests leave the batch and the last
live slot moves into the hole, so cache slots 0..B-1 always hold the live requests.
Each step reports, per request, the chosen token's fp32 logprob (log-softmax of the raw
logits, before penalties and temperature, like vLLM's ``raw_logprobs``), optional top-k
logprobs, and the SHA-256 of the raw fp32 logits row (little-endian IEEE binary32, V*4
bytes), hashed on a worker thread while the next step runs.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine import ops
from workers.engine.api import GenerationRequest, GenerationResult
from workers.engine.config import ModelConfig
from workers.engine.loader import load_transformer, random_transformer
from workers.engine.model import KVCache, Transformer, decode_one_token, prefill
from workers.engine.runtime import reference_runtime, torch_dtype
from workers.engine.sampling import BatchSampler, validate
from workers.engine.torch_kernels import DECODE_KV_BLOCK

TINY_DEMO_NAME = "tiny-demo"
TINY_DEMO_DIR = Path(__file__).with_name("tiny_demo")


def resolve_model_dir(model: str | Path) -> Path:
    """A model directory, or the packaged tiny demo model for the name ``tiny-demo``."""
    if str(model) == TINY_DEMO_NAME:
        return TINY_DEMO_DIR
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    return path


def logits_digests(logits: Tensor) -> list[str]:
    """SHA-256 hex of each fp32 row's little-endian bytes. logits fp32 [B, V] on the CPU."""
    assert sys.byteorder == "little", "digests are defined over little-endian binary32"
    rows = logits.numpy()
    return [hashlib.sha256(rows[i].data).hexdigest() for i in range(rows.shape[0])]


def top_logprobs(logprobs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best (token id, logprob) per row, best first, ties to the smaller id.

    Sorts on unique int64 keys (order-preserving float bits, then the id), so the answer
    does not depend on the top-k algorithm or on k. logprobs fp32 [S, V] -> ids, values [S, k]
    """
    ids = torch.arange(logprobs.shape[-1], device=logprobs.device, dtype=torch.int64)
    bits = logprobs.contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)              # float order
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - ids)
    best = torch.topk(keys, k, dim=-1).indices
    return best, logprobs.gather(1, best)


class ReferenceEngine:
    """Batch-invariant PyTorch engine for Llama-family checkpoints (the ``Engine`` protocol)."""

    name = "reference"

    def __init__(
        self, model: Transformer, *, dtype: str = "float32", batch_invariant: bool = True,
        model_name: str | None = None, prefill_token_budget: int = 8192,
    ) -> None:
        torch_dtype(dtype)
        self.model = model
        self.dtype = dtype
        self.batch_invariant = batch_invariant      # may be toggled between generate calls
        self.model_name = model_name
        self.prefill_token_budget = prefill_token_budget
        self._cache: KVCache | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dir(
        cls, model_dir: str | Path, *, device: str = "cpu", dtype: str = "float32",
        batch_invariant: bool = True,
    ) -> ReferenceEngine:
        path = resolve_model_dir(model_dir)
        model = load_transformer(path, device=device, dtype=torch_dtype(dtype))
        name = TINY_DEMO_NAME if path == TINY_DEMO_DIR else path.name
        return cls(model, dtype=dtype, batch_invariant=batch_invariant, model_name=name)

    @classmethod
    def random(
        cls, config: ModelConfig | Mapping[str, Any], *, device: str = "cpu",
        dtype: str = "float32", batch_invariant: bool = True, seed: int = 0,
    ) -> ReferenceEngine:
        """Random weights of any Llama-family shape, built directly on ``device``."""
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
        model = random_transformer(cfg, device=device, dtype=torch_dtype(dtype), seed=seed)
        return cls(model, dtype=dtype, batch_invariant=batch_invariant, model_name="random")

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def runtime(self) -> dict[str, Any]:
        return reference_runtime(self.device, self.dtype, self.batch_invariant)

    # ------------------------------------------------------------------ generation
    def generate(
        self, requests: Sequence[GenerationRequest], *, max_batch: int
    ) -> list[GenerationResult]:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        for request in requests:            # refuse bad input before any work is done
            self._budget(request)
        results: list[GenerationResult] = []
        with (
            torch.inference_mode(),
            ops.batch_invariant_mode(self.batch_invariant),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="logits-sha256") as hasher,
        ):
            for start in range(0, len(requests), max_batch):
                results += self._generate_batch(requests[start:start + max_batch], hasher)
        return results

    def _budget(self, request: GenerationRequest) -> int:
        """Tokens this request may generate (max_tokens, capped by the context length)."""
        cfg = self.config
        validate(request.sampling)
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {request.id!r}: empty prompt")
        if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
            raise ValueError(f"request {request.id!r}: token id outside [0, {cfg.vocab_size})")
        if len(prompt) >= cfg.max_position_embeddings:
            raise ValueError(f"request {request.id!r}: prompt of {len(prompt)} tokens does "
                             f"not fit the context of {cfg.max_position_embeddings}")
        budget = min(request.sampling.max_tokens, cfg.max_position_embeddings - len(prompt))
        if cfg.sliding_window is not None and len(prompt) + budget > cfg.sliding_window:
            raise ValueError(f"request {request.id!r}: sequences longer than the sliding "
                             f"window ({cfg.sliding_window}) are not supported")
        return budget

    def _kv_cache(self, slots: int, max_seq: int) -> KVCache:
        cache = self._cache
        if cache is None or cache.slots < slots or cache.max_seq < max_seq:
            self._cache = cache = None      # free the old buffers before allocating
            cache = KVCache(self.config, slots, max_seq, dtype=self.model.dtype,
                            device=self.device)
            self._cache = cache
        return cache

    def _prefill(self, cache: KVCache, prompts: list[tuple[int, ...]]) -> Tensor:
        """Prefill prompts into slots 0..B-1; fp32 logits of each last token [B, V]."""
        dev = self.device
        groups: list[list[int]] = [[]]          # consecutive slots, <= budget tokens each
        used = 0
        for slot, prompt in enumerate(prompts):
            if groups[-1] and used + len(prompt) > self.prefill_token_budget:
                groups.append([])
                used = 0
            groups[-1].append(slot)
            used += len(prompt)
        logits = torch.empty((len(prompts), self.config.vocab_size), device=dev)
        for group in groups:
            lengths = [len(prompts[s]) for s in group]
            tokens = torch.tensor([t for s in group for t in prompts[s]], device=dev)
            positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
            slots = torch.repeat_interleave(torch.tensor(group, device=dev),
                                            torch.tensor(lengths, device=dev))
            cu = torch.tensor([0, *lengths], device=dev).cumsum(0).to(torch.int32)
            logits[torch.tensor(group, device=dev)] = prefill(
                self.model, cache, tokens, positions, slots, cu
            )
        return logits

    def _generate_batch(
        self, requests: Sequence[GenerationRequest], hasher: ThreadPoolExecutor
    ) -> list[GenerationResult]:
        budgets = [self._budget(r) for r in requests]
        results = [
            GenerationResult(id=r.id, token_ids=[], finish_reason="length", logprobs=[],
                             top_logprobs=[] if r.sampling.logprobs else None,
                             logits_sha256=[])
            for r in requests
        ]
        live = [i for i, b in enumerate(budgets) if b > 0]       # slot -> request index
        if not live:
            return results
        prompts = [requests[i].prompt_token_ids for i in live]
        max_seq = max(len(requests[i].prompt_token_ids) + budgets[i] for i in live)
        max_seq = -(-max_seq // DECODE_KV_BLOCK) * DECODE_KV_BLOCK
        cache = self._kv_cache(len(live), max_seq)
        sampler = BatchSampler([requests[i].sampling for i in live], prompts,
                               self.config.vocab_size, self.device)
        eos = set(self.config.eos_token_ids)
        positions = [len(p) for p in prompts]                    # next position, per slot
        pending: list[tuple[Future[list[str]], list[int]]] = []

        logits = self._prefill(cache, prompts)
        while True:
            steps = [len(results[i].token_ids) for i in live]
            tokens = sampler.choose(logits, steps)                           # [B]
            logprobs = ops.log_softmax(logits)                               # fp32 [B, V]
            chosen = logprobs.gather(1, tokens[:, None])[:, 0]
            pending.append((hasher.submit(logits_digests, logits.cpu()), list(live)))
            self._record_top_logprobs(requests, results, live, logprobs)
            sampler.record(tokens)

            keep: list[int] = []                                             # surviving slots
            for slot, (i, token, logprob) in enumerate(
                zip(live, tokens.tolist(), chosen.tolist(), strict=True)
            ):
                result, params = results[i], requests[i].sampling
                result.token_ids.append(token)
                result.logprobs.append(logprob)
                if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
                    result.finish_reason = "stop"
                elif len(result.token_ids) >= budgets[i]:
                    result.finish_reason = "length"
                else:
                    keep.append(slot)
            if not keep:
                break
            rows = self._compact(cache, keep)
            sampler.compact(rows)
            live = [live[r] for r in rows]
            positions = [positions[r] for r in rows]
            index = torch.tensor(rows, device=self.device)
            logits = decode_one_token(
                self.model, cache, tokens[index],
                torch.tensor(positions, device=self.device),
            )
            positions = [p + 1 for p in positions]

        for future, owners in pending:
            for i, digest in zip(owners, future.result(), strict=True):
                results[i].logits_sha256.append(digest)
        return results

    @staticmethod
    def _compact(cache: KVCache, keep: list[int]) -> list[int]:
        """Fill slots 0..len(keep)-1 with the kept slots, moving the fewest cache rows.

        Returns rows: new slot s holds the request that was in slot rows[s].
        """
        n, kept = len(keep), set(keep)
        holes = [s for s in range(n) if s not in kept]
        movers = [s for s in keep if s >= n]
        order = dict(zip(holes, movers, strict=True))
        rows = [order.get(s, s) for s in range(n)]
        for dst, src in order.items():
            cache.move_slot(src, dst)
        return rows

    def _record_top_logprobs(
        self, requests: Sequence[GenerationRequest], results: list[GenerationResult],
        live: list[int], logprobs: Tensor,
    ) -> None:
        wanted = [(slot, i, int(requests[i].sampling.logprobs or 0))
                  for slot, i in enumerate(live) if requests[i].sampling.logprobs]
        if not wanted:
            return
        k_max = min(max(k for _, _, k in wanted), logprobs.shape[-1])
        ids, values = top_logprobs(logprobs[torch.tensor([s for s, _, _ in wanted],
                                                         device=logprobs.device)], k_max)
        for (_, i, k), row_ids, row_values in zip(wanted, ids.tolist(), values.tolist(),
                                                 strict=True):
            top = results[i].top_logprobs
            assert top is not None
            top.append(list(zip(row_ids[:k], row_values[:k], strict=True)))
