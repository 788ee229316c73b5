"""The reference engine: static batches, prefill then one-token decode steps.

Requests run in the given order, ``max_batch`` at a time (the caller chooses co-tenants).
A batch is prefilled (packed prompts, in groups of at most ``prefill_token_budget``
tokens), then decoded one token per step; finished requests leave the batch and the last
live slot moves into the hole, so cache slots 0..B-1 always hold the live requests.
Each step reports, per request, the chosen token's fp32 logprob (log-softmax of the raw
logits, before penalties and temperature, like vLLM's ``raw_logprobs``), optional top-k
logprobs, and the SHA-256 of the raw fp32 logits row (little-endian IEEE binary32, V*4
bytes), hashed on worker threads while the next step runs (``digests``). On CUDA decode
steps are CUDA graphs over power-of-two batch buckets (``static_decode``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine import ops
from workers.engine.api import GenerationRequest, GenerationResult
from workers.engine.config import ModelConfig
from workers.engine.digests import (
    CpuDigester,
    CudaDigester,
    CudaDigestRing,
    hashing_threads,
    logits_digests,
)
from workers.engine.loader import load_transformer, random_transformer
from workers.engine.model import KVCache, Transformer, decode_one_token, prefill
from workers.engine.runtime import reference_runtime, torch_dtype
from workers.engine.sampling import BatchSampler, validate
from workers.engine.static_decode import StaticDecoder, decode_bucket
from workers.engine.torch_kernels import DECODE_KV_BLOCK

__all__ = ["GenerateStats", "ReferenceEngine", "logits_digests", "resolve_model_dir",
           "top_logprobs"]

TINY_DEMO_NAME = "tiny-demo"
TINY_DEMO_DIR = Path(__file__).with_name("tiny_demo")
#: On CUDA the KV cache length is rounded up to this (the Triton decode kernel's split
#: size), so a few cache sizes (and CUDA-graph sets) serve many batches.
CUDA_KV_ROUND = 256


def resolve_model_dir(model: str | Path) -> Path:
    """A model directory, or the packaged tiny demo model for the name ``tiny-demo``."""
    if str(model) == TINY_DEMO_NAME:
        return TINY_DEMO_DIR
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    return path


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


@dataclass
class GenerateStats:
    """Where the last ``generate`` call's wall time went (summed over its batches).

    Phase boundaries are host times after a device sync, so they are real elapsed times.
    """

    batches: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0        # prompts in -> first logits on the device (synced)
    decode_s: float = 0.0         # first sampling -> last token known on the host
    decode_steps: int = 0         # model decode steps (the first token comes from prefill)
    digest_wait_s: float = 0.0    # waiting for logits digests after the last step
    total_s: float = 0.0


class ReferenceEngine:
    """Batch-invariant PyTorch engine for Llama-family checkpoints (the ``Engine`` protocol).

    On CUDA, decode steps run on static buffers padded to power-of-two batch buckets and are
    replayed as CUDA graphs (``static_decode``/``cuda_graphs``; see ``static_decode``), in
    both modes. On CPU they run eagerly on the exact batch (``static_decode`` may be set to
    test the padded path there: it gives the same bits in batch-invariant mode).
    """

    name = "reference"

    def __init__(
        self, model: Transformer, *, dtype: str = "float32", batch_invariant: bool = True,
        model_name: str | None = None, prefill_token_budget: int = 8192,
        static_decode: bool | None = None, cuda_graphs: bool = True,
    ) -> None:
        torch_dtype(dtype)
        self.model = model
        self.dtype = dtype
        self.batch_invariant = batch_invariant      # may be toggled between generate calls
        self.model_name = model_name
        self.prefill_token_budget = prefill_token_budget
        self.static_decode = model.device.type == "cuda" if static_decode is None \
            else static_decode
        self.cuda_graphs = cuda_graphs
        self.stats = GenerateStats()                # of the last generate call
        self._cache: KVCache | None = None
        self._decoder: StaticDecoder | None = None
        self._digest_ring: CudaDigestRing | None = None

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
        self.stats = GenerateStats()
        began = time.perf_counter()
        with (
            torch.inference_mode(),
            ops.batch_invariant_mode(self.batch_invariant),
            self._digester() as digester,
        ):
            for start in range(0, len(requests), max_batch):
                results += self._generate_batch(requests[start:start + max_batch], digester)
        self.stats.total_s = time.perf_counter() - began
        return results

    @contextmanager
    def _digester(self) -> Iterator[CpuDigester | CudaDigester]:
        threads = hashing_threads(self.device)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="logits-sha256") as pool:
            if self.device.type != "cuda":
                yield CpuDigester(pool)
                return
            if self._digest_ring is None:
                self._digest_ring = CudaDigestRing(self.device)
            yield CudaDigester(self._digest_ring, pool, threads)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
        """A cache with at least ``slots`` slots of ``max_seq`` positions (grown, never
        shrunk; a larger cache changes no bits: attention reads only a row's own length)."""
        if self.static_decode:
            slots = decode_bucket(slots)
        if self.device.type == "cuda":
            max_seq = -(-max_seq // CUDA_KV_ROUND) * CUDA_KV_ROUND
        cache = self._cache
        if cache is None or cache.slots < slots or cache.max_seq < max_seq:
            if cache is not None:
                slots, max_seq = max(slots, cache.slots), max(max_seq, cache.max_seq)
            self._cache = cache = self._decoder = None  # free the old buffers and graphs
            cache = KVCache(self.config, slots, max_seq, dtype=self.model.dtype,
                            device=self.device)
            self._cache = cache
        if self.static_decode and self._decoder is None:
            self._decoder = StaticDecoder(self.model, cache, cuda_graphs=self.cuda_graphs)
        return cache

    def _decode(self, cache: KVCache, tokens: Tensor, positions: Tensor) -> Tensor:
        """fp32 logits [B, V] of one decode step for the requests in slots 0..B-1."""
        if self.static_decode and self._decoder is not None:
            return self._decoder.step(tokens, positions)
        return decode_one_token(self.model, cache, tokens, positions)

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
        self, requests: Sequence[GenerationRequest], digester: CpuDigester | CudaDigester
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
        stats = self.stats
        began = time.perf_counter()
        dev = self.device
        prompts = [requests[i].prompt_token_ids for i in live]
        max_seq = max(len(requests[i].prompt_token_ids) + budgets[i] for i in live)
        max_seq = -(-max_seq // DECODE_KV_BLOCK) * DECODE_KV_BLOCK
        cache = self._kv_cache(len(live), max_seq)
        sampler = BatchSampler([requests[i].sampling for i in live], prompts,
                               self.config.vocab_size, dev)
        eos = set(self.config.eos_token_ids)
        positions = torch.tensor([len(p) for p in prompts], device=dev)  # next, per slot
        pending: list[tuple[list[Future[list[str]]], list[int]]] = []

        logits = self._prefill(cache, prompts)
        self._synchronize()
        prefilled = time.perf_counter()
        while True:
            steps = [len(results[i].token_ids) for i in live]
            tokens = sampler.choose(logits, steps)                           # [B]
            logprobs = ops.log_softmax(logits)                               # fp32 [B, V]
            chosen = logprobs.gather(1, tokens[:, None])[:, 0]               # fp32 [B]
            pending.append((digester.submit(logits), list(live)))
            self._record_top_logprobs(requests, results, live, logprobs)
            sampler.record(tokens)
            # The step's one device->host sync: token ids and logprob bits together.
            host = torch.stack([tokens, chosen.view(torch.int32).to(torch.int64)]).cpu()
            token_ids = host[0].tolist()
            token_logprobs = host[1].to(torch.int32).view(torch.float32).tolist()

            keep: list[int] = []                                             # surviving slots
            for slot, (i, token) in enumerate(zip(live, token_ids, strict=True)):
                params = requests[i].sampling
                if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
                    continue
                if len(results[i].token_ids) + 1 < budgets[i]:
                    keep.append(slot)
            owners = live
            if keep:
                # Launch the next step before the host bookkeeping below.
                rows = self._compact(cache, keep)
                if rows != list(range(len(live))):
                    index = torch.tensor(rows).to(dev, non_blocking=True)
                    sampler.compact(rows)
                    tokens, positions = tokens[index], positions[index]
                live = [live[r] for r in rows]
                logits = self._decode(cache, tokens, positions)
                positions = positions + 1
                stats.decode_steps += 1
            for i, token, logprob in zip(owners, token_ids, token_logprobs, strict=True):
                result, params = results[i], requests[i].sampling
                result.token_ids.append(token)
                result.logprobs.append(logprob)
                if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
                    result.finish_reason = "stop"
                elif len(result.token_ids) >= budgets[i]:
                    result.finish_reason = "length"
            if not keep:
                break

        decoded = time.perf_counter()
        for futures, owners in pending:
            digests = [d for future in futures for d in future.result()]
            for i, digest in zip(owners, digests, strict=True):
                results[i].logits_sha256.append(digest)
        done = time.perf_counter()
        stats.batches += 1
        stats.prompt_tokens += sum(len(p) for p in prompts)
        stats.generated_tokens += sum(len(results[i].token_ids) for i in range(len(requests)))
        stats.prefill_s += prefilled - began
        stats.decode_s += decoded - prefilled
        stats.digest_wait_s += done - decoded
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
