"""The reference engine: prefill then one-token decode steps, on a continuous batch.

The generation loop lives in ``batching.ContinuousBatcher`` (requests join and leave at
every step, prompts prefilled whole or in chunks, an optional prefix cache).
``generate`` keeps the static contract: requests run in the given order, ``max_batch`` at
a time (the caller chooses co-tenants); ``batcher()`` gives the continuous one
(``ledger engine serve``). Each step reports, per request, the chosen token's fp32 logprob
(log-softmax of the raw logits, before penalties and temperature, like vLLM's
``raw_logprobs``), optional top-k logprobs, and the SHA-256 of the raw fp32 logits row
(little-endian IEEE binary32, V*4 bytes), hashed on worker threads while the next step runs
(``digests``). On CUDA decode steps are CUDA graphs over power-of-two batch buckets
(``static_decode``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine import ops
from workers.engine.api import GenerationRequest, GenerationResult
from workers.engine.batching import ContinuousBatcher, run_requests
from workers.engine.config import ModelConfig
from workers.engine.digests import CudaDigestRing, cuda_event, logits_digests
from workers.engine.loader import load_transformer, random_transformer
from workers.engine.model import KVCache, Transformer, decode_one_token, prefill
from workers.engine.prefix_cache import PrefixCache
from workers.engine.runtime import reference_runtime, torch_dtype
from workers.engine.sampling import validate
from workers.engine.static_decode import PREFILL_BUCKETS, StaticDecoder, decode_bucket
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
    """Where the last ``generate`` call's wall time went (summed over its steps; a
    continuous batcher adds to the engine's current stats).

    Phase boundaries are host times after a device sync, so they are real elapsed times.
    """

    batches: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0        # prompts in -> first logits on the device (synced)
    decode_s: float = 0.0         # first sampling -> last token known on the host
    decode_steps: int = 0         # model decode steps (the first token comes from prefill)
    mixed_steps: int = 0          # of them, run inside a prompt forward (``mixed_steps``)
    digest_wait_s: float = 0.0    # waiting for logits digests after the last step
    total_s: float = 0.0
    prefill_tokens: int = 0       # prompt tokens run through the model (not from the cache)
    prefix_hit_tokens: int = 0    # prompt tokens served by the prefix cache


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
        prefill_chunk: int | None = None, prefix_cache: PrefixCache | None = None,
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
        self.prefill_chunk = prefill_chunk          # prompt tokens per step (None: whole)
        self.prefix_cache = prefix_cache            # reuse of prompt-prefix KV (None: off)
        # A step with prompt work runs the running requests' decode tokens in its prompt
        # forward (batching.py, "Mixed steps"). Off: bitwise on the H200 too, but no
        # faster there (benchmarks/RESULTS.md, 2026-12-04 19:01).
        self.mixed_steps = False
        # A mixed step's forward: its decode tokens, then prompt tokens up to this many in
        # all (the largest captured prompt bucket, so it replays as a graph on CUDA).
        self.mixed_step_tokens = PREFILL_BUCKETS[-1]
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
        """Static batches: ``max_batch`` requests at a time in the given order, each group
        run until all its members finished (the caller chooses the co-tenants)."""
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        for request in requests:            # refuse bad input before any work is done
            self._budget(request)
        self.stats = GenerateStats()
        began = time.perf_counter()
        results = run_requests(self, requests, max_batch=max_batch,
                               prefill_chunk=self.prefill_chunk, static=True)
        self.stats.total_s = time.perf_counter() - began
        return results

    def batcher(self, *, max_batch: int, prefill_chunk: int | None = None,
                static: bool = False) -> ContinuousBatcher:
        """A continuous batch on this engine (requests join and leave at every step)."""
        return ContinuousBatcher(self, max_batch=max_batch, prefill_chunk=prefill_chunk,
                                 static=static, mixed=self.mixed_steps)

    def warm_up(self, *, max_batch: int, max_len: int) -> int:
        """Before serving: allocate the KV cache for ``max_batch`` requests of ``max_len``
        positions and, on CUDA, capture every decode bucket up to ``max_batch`` and the
        prompt graphs, so that no request waits for either later (a longer request still
        grows the cache, and its graphs are captured again). The number of graphs captured
        (0 on CPU). Changes no bit of any later request."""
        if max_batch < 1 or max_len < 1:
            raise ValueError("max_batch and max_len must be >= 1")
        with torch.inference_mode(), ops.batch_invariant_mode(self.batch_invariant):
            self._ensure_cache(max_batch, min(max_len, self.config.max_position_embeddings))
            if self._decoder is None:
                return 0
            return self._decoder.warm_up(max_batch)

    def prefix_mode(self) -> str:
        """What prefix-cache pages are named by, beside the tokens: the kernel mode."""
        return f"{'bi' if self.batch_invariant else 'fast'}:{self.dtype}"

    def _digest_ring_for_device(self) -> CudaDigestRing:
        if self._digest_ring is None:
            self._digest_ring = CudaDigestRing(self.device)
        return self._digest_ring

    def _event(self) -> torch.cuda.Event | None:
        """On CUDA, an event recorded now on the current stream (None on CPU, where
        everything already happened)."""
        if self.device.type != "cuda":
            return None
        event = cuda_event()
        event.record()
        return event

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

    def _ensure_cache(self, slots: int, need: int) -> KVCache:
        """A cache with at least ``slots`` slots and room for sequences of ``need``
        positions plus one spare (the dummy decode rows' position). Grown in place of the
        old one with its contents kept (running requests keep their k/v), never shrunk;
        a larger cache changes no bits: attention reads only a row's own length."""
        if self.static_decode:
            slots = decode_bucket(slots)
        max_seq = -(-(need + 1) // DECODE_KV_BLOCK) * DECODE_KV_BLOCK
        if self.device.type == "cuda":
            max_seq = -(-max_seq // CUDA_KV_ROUND) * CUDA_KV_ROUND
        cache = self._cache
        if cache is None:
            cache = KVCache(self.config, slots, max_seq, dtype=self.model.dtype,
                            device=self.device)
        elif cache.slots < slots or cache.max_seq < max_seq:
            self._decoder = None                    # its graphs point at the old buffers
            self._cache = None
            cache = cache.grow(slots, max_seq)
        self._cache = cache
        if self.static_decode and self._decoder is None:
            self._decoder = StaticDecoder(self.model, cache, cuda_graphs=self.cuda_graphs)
        return cache

    def _prefill(self, cache: KVCache, tokens: Tensor, positions: Tensor, slots: Tensor,
                 cu_seqlens: Tensor, chunks: list[tuple[int, int, int, int]]) -> Tensor:
        """``model.prefill`` (fp32 logits [C, V]); a captured graph where one applies."""
        if self.static_decode and self._decoder is not None:
            logits = self._decoder.prefill(tokens, positions, slots, cu_seqlens)
            if logits is not None:
                return logits
        return prefill(self.model, cache, tokens, positions, slots, cu_seqlens, chunks)

    def _decode(self, cache: KVCache, tokens: Tensor, positions: Tensor) -> Tensor:
        """fp32 logits [B, V] of one decode step for the requests in slots 0..B-1."""
        if self.static_decode and self._decoder is not None:
            return self._decoder.step(tokens, positions)
        return decode_one_token(self.model, cache, tokens, positions)
