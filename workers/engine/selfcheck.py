"""The replay worker's batch-invariance self-check, engine by engine (no database needed).

Each request alone vs among co-tenants, for greedy, seeded full-distribution, top_k, top_p
and top_k + top_p sampling, at batch sizes on both sides of every threshold the engine
declares (``engine.batch_thresholds``; vLLM: 8, where its sampler changes path, and ~44,
where divergence has been reported), up to the batch size the worker runs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from workers.engine.api import GenerationRequest, SamplingParams


class SelfCheckFailed(RuntimeError):
    pass


def self_check_sizes(max_batch: int, thresholds: Sequence[int], minimum: int = 6) -> list[int]:
    """Batch sizes for the self-check: 1, each threshold t as t - 1, t, t + 1, a minimum
    size and ``max_batch``, all within [1, max_batch]."""
    sizes = {1, min(minimum, max_batch), max_batch}
    for t in thresholds:
        sizes |= {t - 1, t, t + 1}
    return sorted(s for s in sizes if 1 <= s <= max_batch)


SELF_CHECK_MODES: tuple[dict[str, Any], ...] = (
    {},                                                     # greedy
    {"temperature": 0.8},                                   # seeded, full distribution
    {"temperature": 0.9, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 40, "top_p": 0.95},
)


def self_check_engine(engine: Any, *, name: str, max_batch: int, minimum: int = 6,
                      max_tokens: int = 8) -> dict[int, int]:
    """Run the self-check on one engine; returns {batch size: requests compared}.

    A pool of ``max_batch`` requests cycles through :data:`SELF_CHECK_MODES` (all seeded;
    every fourth has a prompt of 200-600 tokens: vLLM's divergence needs long prompts);
    each runs alone once, then every size from :func:`self_check_sizes` runs a random
    subset of the pool (needles among co-tenants, shuffled). Any difference in token IDs,
    logprob or logits-digest bits raises :class:`SelfCheckFailed`."""
    rng = random.Random(1234)  # noqa: S311 - test inputs, not a secret
    vocab = int(engine.config.vocab_size) if hasattr(engine, "config") else 256
    pool = [GenerationRequest(
        id=f"self-check-{i}",
        prompt_token_ids=tuple(rng.randrange(min(vocab, 256)) for _ in range(
            rng.randrange(200, 600) if i % 4 == 3 else rng.randrange(2, 24))),
        sampling=SamplingParams(**SELF_CHECK_MODES[i % len(SELF_CHECK_MODES)], seed=i,
                                max_tokens=max_tokens, logprobs=2, ignore_eos=True))
        for i in range(max_batch)]
    alone = {r.id: engine.generate([r], max_batch=1)[0] for r in pool}
    compared: dict[int, int] = {}
    for size in self_check_sizes(max_batch, getattr(engine, "batch_thresholds", ()),
                                 minimum):
        batch = rng.sample(pool, size)
        for req, a in zip(batch, engine.generate(batch, max_batch=size), strict=True):
            b = alone[req.id]
            if (a.token_ids, a.logprobs, a.logits_sha256) != (b.token_ids, b.logprobs,
                                                               b.logits_sha256):
                raise SelfCheckFailed(
                    f"{name}: request {req.id} ({req.sampling}) differs alone vs in a "
                    f"batch of {size}; this engine is not batch invariant here")
        compared[size] = size
    return compared
