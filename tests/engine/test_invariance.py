"""Acceptance 2: batch invariance on CPU, and the negative control.

A pool of random requests (random prompt lengths, greedy and seeded sampling with random
temperature / top_k / top_p / min_p / penalties / logprobs / stop ids) is run alone, one
request per batch. Then random subsets of 2..64 co-tenants, in random order (so every
request lands in many positions), run as single batches. In batch-invariant mode every
request's token ids, logprobs (compared as exact float bits), top logprobs, finish reason
and per-step logits digests must equal its solo run. With batch invariance off the same
procedure must find differences; where it cannot (a configuration whose fast kernels happen
to be invariant at these shapes), the test is skipped with that statement, never passed.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine import load_engine
from workers.engine.api import GenerationRequest, GenerationResult, SamplingParams

BATCH_SIZES = (2, 3, 5, 8, 13, 21, 34, 64)
POOL_SIZE = 72


def random_pool(seed: int, vocab_size: int, n: int = POOL_SIZE) -> list[GenerationRequest]:
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        length = rng.choice([1, 2, rng.randint(3, 16), rng.randint(17, 70)])
        sampled = rng.random() < 0.6
        sampling = SamplingParams(
            temperature=rng.uniform(0.3, 1.5) if sampled else 0.0,
            seed=rng.randrange(2**63) if sampled else None,
            top_k=rng.choice([0, 0, 1, 5, 40]) if sampled else 0,
            top_p=rng.choice([1.0, 1.0, 0.9, 0.5]) if sampled else 1.0,
            min_p=rng.choice([0.0, 0.0, 0.05, 0.2]) if sampled else 0.0,
            repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
            presence_penalty=rng.choice([0.0, 0.0, 0.5, -0.3]),
            frequency_penalty=rng.choice([0.0, 0.0, 0.4]),
            max_tokens=rng.randint(1, 10),
            stop_token_ids=tuple(rng.sample(range(vocab_size), 3)) if rng.random() < 0.3
            else (),
            ignore_eos=rng.random() < 0.5,
            logprobs=rng.choice([None, None, 0, 1, 5]),
        )
        prompt = tuple(rng.randrange(vocab_size) for _ in range(length))
        pool.append(GenerationRequest(id=f"r{i}", prompt_token_ids=prompt, sampling=sampling))
    return pool


def signature(result: GenerationResult) -> tuple[Any, ...]:
    """Everything a bitwise verdict compares, with floats as exact bit patterns."""
    top = None if result.top_logprobs is None else [
        [(t, lp.hex()) for t, lp in step] for step in result.top_logprobs
    ]
    return (result.token_ids, [lp.hex() for lp in result.logprobs], result.logits_sha256,
            top, result.finish_reason)


def differing_requests(engine: Any, pool: list[GenerationRequest], seed: int,
                       sizes: tuple[int, ...] = BATCH_SIZES) -> tuple[list[str], int]:
    """Ids (with batch size and position) whose batched result differs from the solo run,
    and the number of comparisons made."""
    solo = {r.id: signature(engine.generate([r], max_batch=1)[0]) for r in pool}
    rng = random.Random(seed)
    differing, compared = [], 0
    for size in sizes:
        members = rng.sample(pool, size)                    # random co-tenants, random order
        results = engine.generate(members, max_batch=size)
        for position, (request, result) in enumerate(zip(members, results, strict=True)):
            assert result.id == request.id
            compared += 1
            if signature(result) != solo[request.id]:
                differing.append(f"{request.id}@{position}/{size}")
    return differing, compared


@pytest.fixture(params=["tiny-demo/float32", "tiny-demo/bfloat16", "qwen2/float32",
                        "qwen3/bfloat16"])
def engine_and_pool(request: pytest.FixtureRequest, hf_model_dir: Any
                    ) -> Iterator[tuple[Any, list[GenerationRequest]]]:
    model, dtype = request.param.split("/")
    source: str | Path = model if model == "tiny-demo" else hf_model_dir(model)
    engine = load_engine(source, dtype=dtype)
    yield engine, random_pool(zlib.crc32(request.param.encode()), engine.config.vocab_size)


def test_batch_invariant_mode_is_bitwise_invariant(engine_and_pool: Any) -> None:
    engine, pool = engine_and_pool
    assert engine.batch_invariant and engine.runtime()["batch_invariant"] is True
    differing, compared = differing_requests(engine, pool, seed=1)
    assert compared == sum(BATCH_SIZES)
    assert not differing, f"{len(differing)}/{compared} results changed with co-tenants: " \
                          f"{differing[:10]}"


def test_negative_control_finds_differences(engine_and_pool: Any) -> None:
    engine, pool = engine_and_pool
    engine.batch_invariant = False                  # same weights, ordinary kernels
    assert engine.runtime()["batch_invariant"] is False
    differing, compared = differing_requests(engine, pool, seed=1)
    if not differing:
        pytest.skip(f"negative control: no differences among {compared} batched results "
                    f"with batch invariance off ({engine.dtype}, {engine.config.model_type}, "
                    f"{torch.get_num_threads()} thread): the fast kernels are invariant at "
                    f"these shapes on this CPU, so this configuration proves nothing")
    assert len(differing) > 0


def test_invariant_with_two_threads() -> None:
    """MKL splits work across threads: invariance must hold with 2 threads as well."""
    torch.set_num_threads(2)
    engine = load_engine("tiny-demo")
    pool = random_pool(5, engine.config.vocab_size, n=24)
    differing, _ = differing_requests(engine, pool, seed=2, sizes=(2, 7, 24))
    assert not differing, differing[:10]


def test_fp32_negative_control_must_differ() -> None:
    """The fp32 CPU fast path is known to vary with M (F.linear): it must be caught."""
    engine = load_engine("tiny-demo", batch_invariant=False)
    pool = random_pool(9, engine.config.vocab_size, n=24)
    differing, _ = differing_requests(engine, pool, seed=3, sizes=(2, 7, 24))
    assert differing, "batch invariance off, yet no request changed: the test is blind"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prompts_many_rounds(dtype: str) -> None:
    """Longer prompts (several KV blocks, several prefill query blocks) and more rounds."""
    engine = load_engine("tiny-demo", dtype=dtype)
    rng = random.Random(17)
    pool = random_pool(17, engine.config.vocab_size, n=96)
    pool = [GenerationRequest(r.id, r.prompt_token_ids * rng.randint(1, 6), r.sampling)
            for r in pool]
    for round_seed in range(3):
        differing, _ = differing_requests(engine, pool, seed=100 + round_seed,
                                          sizes=(4, 17, 64, 96))
        assert not differing, differing[:10]
