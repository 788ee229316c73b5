"""Continuous batching, chunked prefill and the prefix cache keep results bitwise.

One probe request (a 70-token prompt, seeded sampling with top_k, penalties and top
logprobs) runs under every combination of

* alone, or joining a running batch of co-tenants at step 0, 1 or 7;
* prefill chunk size 1, 16, 61 or the whole prompt;
* prefix cache cold (empty), or warm (a request sharing the probe's first 64 tokens ran
  before, so 4 of its 16-token blocks are served from the cache),

and its token ids, logprobs (float bits), top logprobs, finish reason and per-step logits
digests must equal those of the plain run (alone, whole prompt, no prefix cache), for each
model family the engine supports. With batch invariance off the same matrix must find
differences (the negative control), and the test says where.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import product
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.engine.test_invariance import signature  # noqa: E402
from workers.engine import load_engine  # noqa: E402
from workers.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from workers.engine.prefix_cache import PrefixCache  # noqa: E402

JOINS = (None, 0, 1, 7)                 # None: alone
CHUNKS = (1, 16, 61, None)              # None: the whole prompt in one pass
WARM = (False, True)
BLOCK = 16


def scenario(vocab_size: int, seed: int = 0, prompt_len: int = 70
             ) -> tuple[GenerationRequest, list[GenerationRequest], GenerationRequest]:
    """(probe, co-tenants, warmer): the warmer shares the probe's first 64 tokens, one
    co-tenant its first 32."""
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab_size) for _ in range(n))

    prompt = tokens(prompt_len)
    probe = GenerationRequest("probe", prompt, SamplingParams(
        temperature=0.9, seed=1234, top_k=20, repetition_penalty=1.2, max_tokens=8,
        ignore_eos=True, logprobs=3))
    cotenants = [
        GenerationRequest("c0", tokens(5), SamplingParams(max_tokens=20, ignore_eos=True)),
        GenerationRequest("c1", tokens(33), SamplingParams(
            temperature=1.1, seed=7, top_p=0.9, max_tokens=14, ignore_eos=True)),
        GenerationRequest("c2", prompt[:32] + tokens(58), SamplingParams(
            max_tokens=18, ignore_eos=True, presence_penalty=0.5, logprobs=1)),
        GenerationRequest("c3", tokens(1), SamplingParams(max_tokens=3, ignore_eos=True)),
        GenerationRequest("c4", tokens(20), SamplingParams(max_tokens=25, ignore_eos=True)),
    ]
    warmer = GenerationRequest("warmer", prompt[:64] + tokens(9),
                               SamplingParams(max_tokens=2, ignore_eos=True))
    return probe, cotenants, warmer


def run_probe(engine: Any, probe: GenerationRequest, cotenants: list[GenerationRequest],
              warmer: GenerationRequest, *, join: int | None, chunk: int | None,
              warm: bool | None, mixed: list[int] | None = None) -> tuple[Any, int]:
    """The probe's signature under one combination, and its prefix-cache hit tokens.
    ``warm`` None: no prefix cache at all. ``mixed``: gets the run's mixed steps appended."""
    engine.prefix_cache = None if warm is None else PrefixCache(pages=64, block_size=BLOCK)
    if warm:
        engine.generate([warmer], max_batch=1)
    hits_before = engine.stats.prefix_hit_tokens
    mixed_before = engine.stats.mixed_steps
    with engine.batcher(max_batch=8, prefill_chunk=chunk) as batcher:
        if join is not None:
            for request in cotenants:
                batcher.add(request)
            for _ in range(join):
                batcher.step()
            assert join == 0 or batcher.running > 0, "co-tenants finished before the probe joined"
        ticket = batcher.add(probe)
        results = {f.ticket: f.result for f in batcher.run()}
    hits = engine.stats.prefix_hit_tokens - hits_before
    if mixed is not None:
        mixed.append(engine.stats.mixed_steps - mixed_before)
    engine.prefix_cache = None
    return signature(results[ticket]), hits


def matrix(engine: Any, vocab_size: int, mixed: list[int] | None = None
           ) -> tuple[list[str], int]:
    """Combinations whose probe result differs from the plain run (alone, whole prompt, no
    prefix cache, never mixed); the number compared."""
    probe, cotenants, warmer = scenario(vocab_size)
    was, engine.mixed_steps = engine.mixed_steps, False
    plain, _ = run_probe(engine, probe, cotenants, warmer, join=None, chunk=None, warm=None)
    engine.mixed_steps = was
    differing, compared = [], 0
    for join, chunk, warm in product(JOINS, CHUNKS, WARM):
        got, hits = run_probe(engine, probe, cotenants, warmer, join=join, chunk=chunk,
                              warm=warm, mixed=mixed)
        if warm:
            assert hits >= 4 * BLOCK, f"warm prefix cache served only {hits} tokens"
        compared += 1
        if got != plain:
            differing.append(f"join={join} chunk={chunk} warm={warm}")
    return differing, compared


#: Every family; three of them are ``slow`` (the matrix is ~35 runs of up to 70 steps each
#: on the invariant CPU path: ~20-50 s per case on a shared 2-core machine).
CASES = ["tiny-demo/float32", "mistral/float32", "qwen2/float32", "qwen3/bfloat16",
         pytest.param("tiny-demo/bfloat16", marks=pytest.mark.slow),
         pytest.param("llama2/float32", marks=pytest.mark.slow),
         pytest.param("llama3/float32", marks=pytest.mark.slow)]


@pytest.fixture(params=CASES)
def engine(request: pytest.FixtureRequest, hf_model_dir: Any) -> Iterator[Any]:
    model, dtype = request.param.split("/")
    source: str | Path = model if model == "tiny-demo" else hf_model_dir(model)
    yield load_engine(source, dtype=dtype)


def test_invariant_under_joins_chunks_and_prefix_cache(engine: Any) -> None:
    assert engine.batch_invariant
    differing, compared = matrix(engine, engine.config.vocab_size)
    assert compared == len(JOINS) * len(CHUNKS) * len(WARM)
    assert not differing, f"{len(differing)}/{compared} combinations changed the probe: " \
                          f"{differing}"


def test_negative_control_default_kernels_differ(engine: Any) -> None:
    engine.batch_invariant = False
    differing, compared = matrix(engine, engine.config.vocab_size)
    assert differing, f"batch invariance off, yet none of {compared} combinations changed " \
                      f"the probe: the test is blind"
    # Where the fast path differs: every chunked prefill (a different GEMM row count and
    # attention split than the one-pass prompt) on this CPU.
    chunked = [d for d in differing if "chunk=None" not in d]
    assert chunked, differing


@pytest.mark.parametrize("case", ["tiny-demo/float32", "qwen3/bfloat16",
                                  pytest.param("llama3/float32", marks=pytest.mark.slow)])
def test_mixed_steps_give_the_same_bits(case: str, hf_model_dir: Any) -> None:
    """With ``mixed_steps`` the running requests' decode tokens ride in the prompt forwards
    of the steps that have prompt work: the whole matrix must still equal the plain run,
    and mixed steps must have run."""
    model, dtype = case.split("/")
    engine = load_engine(model if model == "tiny-demo" else hf_model_dir(model), dtype=dtype)
    engine.mixed_steps = True
    mixed: list[int] = []
    differing, compared = matrix(engine, engine.config.vocab_size, mixed)
    assert not differing, f"{len(differing)}/{compared} combinations changed the probe " \
                          f"with mixed steps: {differing}"
    assert sum(mixed) > 0 and sum(1 for m in mixed if m) >= len(mixed) // 2, mixed


def test_mixed_steps_split_prompts_to_their_token_budget() -> None:
    """A mixed step prefills at most ``mixed_step_tokens`` tokens with its decode tokens
    (here 7, so the probe's prompt is cut into pieces of 1-6 tokens over many steps, and a
    step whose decode tokens fill the budget still takes one prompt token)."""
    engine = load_engine("tiny-demo")
    engine.mixed_steps = True
    whole: list[int] = []
    matrix(engine, engine.config.vocab_size, whole)
    engine.mixed_step_tokens = 7
    cut: list[int] = []
    differing, compared = matrix(engine, engine.config.vocab_size, cut)
    assert not differing, f"{len(differing)}/{compared}: {differing}"
    # the same prompts in smaller pieces: more mixed steps wherever chunks were > 6 tokens
    assert sum(cut) > sum(whole) and all(c >= w for c, w in zip(cut, whole, strict=True)), \
        (cut, whole)


def test_mixed_steps_default_kernels_differ() -> None:
    """The negative control with mixed steps: the default kernels change the probe."""
    engine = load_engine("tiny-demo")
    engine.batch_invariant = False
    engine.mixed_steps = True
    differing, compared = matrix(engine, engine.config.vocab_size)
    assert differing, f"default kernels, mixed steps: none of {compared} combinations " \
                      f"changed the probe: the test is blind"


def test_chunked_prefill_matches_decode_positions() -> None:
    """Chunk size 1 makes every prompt position a one-row forward over the cache: the
    probe must still match the one-pass prefill (tiny-demo, fp32, greedy)."""
    engine = load_engine("tiny-demo")
    request = GenerationRequest("g", tuple(range(40, 140)), SamplingParams(max_tokens=5))
    whole = engine.generate([request], max_batch=1)[0]
    engine.prefill_chunk = 1
    ones = engine.generate([request], max_batch=1)[0]
    assert signature(ones) == signature(whole)
    assert engine.stats.prefill_tokens == 100


def test_prefix_cache_is_keyed_by_kernel_mode() -> None:
    """Pages written by the fast path never serve an invariant request."""
    engine = load_engine("tiny-demo")
    engine.prefix_cache = PrefixCache(pages=16, block_size=BLOCK)
    request = GenerationRequest("p", tuple(range(50)), SamplingParams(max_tokens=2))
    engine.batch_invariant = False
    engine.generate([request], max_batch=1)
    engine.batch_invariant = True
    engine.generate([request], max_batch=1)
    assert engine.stats.prefix_hit_tokens == 0
    engine.generate([request], max_batch=1)
    assert engine.stats.prefix_hit_tokens == 48


def test_prefix_cache_evicts_least_recently_used() -> None:
    engine = load_engine("tiny-demo")
    engine.prefix_cache = cache = PrefixCache(pages=4, block_size=BLOCK)
    a = GenerationRequest("a", tuple(range(33)), SamplingParams(max_tokens=1))
    b = GenerationRequest("b", tuple(range(100, 165)), SamplingParams(max_tokens=1))
    engine.generate([a], max_batch=1)              # 2 pages
    engine.generate([b], max_batch=1)              # 4 more: a's pages are evicted
    assert len(cache) == 4 and cache.stats.evicted_blocks == 2
    engine.generate([a], max_batch=1)
    assert engine.stats.prefix_hit_tokens == 0


def test_prefix_cache_smaller_than_a_prompt_stays_correct() -> None:
    """A pool of 2 pages and a 5-block prompt: only whole, correct prefixes are served."""
    engine = load_engine("tiny-demo")
    request = GenerationRequest("p", tuple(range(90)), SamplingParams(max_tokens=3))
    plain = signature(engine.generate([request], max_batch=1)[0])
    engine.prefix_cache = PrefixCache(pages=2, block_size=BLOCK)
    for _ in range(2):
        assert signature(engine.generate([request], max_batch=1)[0]) == plain
    assert engine.stats.prefix_hit_tokens == 2 * BLOCK


def test_serve_batcher_admits_by_arrival() -> None:
    """``ledger engine serve``'s batcher: a request arriving mid-decode joins the running
    batch and leaves when done, before the long one; both equal their solo runs."""
    import time

    from workers.serve.batcher import EngineBatcher

    engine = load_engine("tiny-demo")
    long = GenerationRequest("long", tuple(range(20)),
                             SamplingParams(max_tokens=200, ignore_eos=True))
    short = GenerationRequest("short", tuple(range(30, 70)),
                              SamplingParams(max_tokens=2, ignore_eos=True, logprobs=2))
    solo = {r.id: signature(engine.generate([r], max_batch=1)[0]) for r in (long, short)}
    batcher = EngineBatcher(engine, max_batch=4, prefill_chunk=16)
    try:
        assert batcher.continuous
        f_long = batcher.submit(long)
        deadline = time.monotonic() + 60
        while batcher.batches < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        f_short = batcher.submit(short)
        got_short = f_short.result(timeout=60)
        assert not f_long.done(), "the short request did not join the running batch"
        got_long = f_long.result(timeout=120)
    finally:
        batcher.close()
    assert batcher.max_running == 2
    assert signature(got_short) == solo["short"] and signature(got_long) == solo["long"]



def _heard(target: Any, request: GenerationRequest) -> tuple[Any, list[tuple[Any, ...]],
                                                             list[float], bool]:
    """Run ``request`` alone through an EngineBatcher on ``target`` with a listener: the
    result, what the listener heard, when (seconds from the submit), and whether the future
    resolved before the last token was heard."""
    import time

    from workers.serve.batcher import EngineBatcher

    heard: list[tuple[Any, ...]] = []
    when: list[float] = []
    early: list[bool] = []
    batcher = EngineBatcher(target, max_batch=2)
    try:
        start = time.perf_counter()
        future = batcher.submit(request, on_token=lambda *token: (
            heard.append(token), when.append(time.perf_counter() - start)))
        future.add_done_callback(
            lambda _: early.append(len(heard) < request.sampling.max_tokens))
        result = future.result(timeout=120)
    finally:
        batcher.close()
    return result, heard, when, early == [True]


def test_serve_batcher_tells_each_token_as_it_is_sampled() -> None:
    """A stream's source: ``on_token`` hears a request's tokens while it still runs (the
    first in the first half of the run), each with its logprob and top logprobs, the
    finish reason on the last only, all before the future resolves, and they are the
    result's. An engine without a continuous batcher (as the vLLM adapter) tells them
    all at once when its batch is done."""
    engine = load_engine("tiny-demo")
    request = GenerationRequest("s", tuple(range(12)),
                                SamplingParams(max_tokens=120, ignore_eos=True, logprobs=2))

    class WholeBatches:               # the reference engine, seen through generate only
        def __init__(self) -> None:
            self.generate = engine.generate

    for target, continuous in ((engine, True), (WholeBatches(), False)):
        result, heard, when, early = _heard(target, request)
        assert not early, "the future resolved before its last token was told"
        assert [h[0] for h in heard] == result.token_ids
        assert [h[1] for h in heard] == result.logprobs
        assert [h[2] for h in heard] == result.top_logprobs
        assert [h[3] for h in heard] == [None] * 119 + [result.finish_reason]
        assert (when[0] < 0.5 * when[-1]) is continuous, (when[0], when[-1])


def test_serve_batcher_aborts_a_request_whose_client_left() -> None:
    """``abort``: a running request leaves the batch at its next token (finish reason
    "abort", fewer tokens than asked), one still waiting for a slot never runs; the
    batcher goes on, and the next request's answer equals its solo run."""
    import threading

    from workers.serve.batcher import EngineBatcher

    engine = load_engine("tiny-demo")
    long = GenerationRequest("long", tuple(range(10)),
                             SamplingParams(max_tokens=600, ignore_eos=True))
    queued = GenerationRequest("queued", tuple(range(5)),
                               SamplingParams(max_tokens=600, ignore_eos=True))
    after = GenerationRequest("after", tuple(range(40, 60)),
                              SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1))
    solo = signature(engine.generate([after], max_batch=1)[0])
    batcher = EngineBatcher(engine, max_batch=1)
    try:
        started = threading.Event()
        f_long = batcher.submit(long, on_token=lambda *_: started.set())
        assert started.wait(60)
        f_queued = batcher.submit(queued)
        batcher.abort(f_queued)
        batcher.abort(f_long)
        got = f_long.result(timeout=60)
        assert got.finish_reason == "abort" and 0 < len(got.token_ids) < 600
        assert f_queued.cancelled() or (f_queued.result(timeout=60).finish_reason == "abort"
                                        and f_queued.result().token_ids == [])
        assert signature(batcher.submit(after).result(timeout=60)) == solo
    finally:
        batcher.close()


def test_warm_up_sizes_the_cache_once_and_changes_no_bit() -> None:
    """A server's warm-up (``ReferenceEngine.warm_up``) allocates the cache for its batch
    and length; a request afterwards gets the bits a fresh engine gives it, and the cache
    is not regrown (on CUDA its graphs would be lost). Bad sizes are refused."""
    probe, cotenants, warmer = scenario(load_engine("tiny-demo").config.vocab_size)
    plain, _ = run_probe(load_engine("tiny-demo"), probe, cotenants, warmer, join=1,
                         chunk=16, warm=True)
    engine = load_engine("tiny-demo")
    engine.static_decode = True                # the padded (bucketed) path, as on CUDA
    assert engine.warm_up(max_batch=8, max_len=200) == 0       # no graphs on the CPU
    cache = engine._cache
    assert cache is not None and cache.slots == 8 and cache.max_seq >= 200
    got, _ = run_probe(engine, probe, cotenants, warmer, join=1, chunk=16, warm=True)
    assert got == plain
    assert engine._cache is cache
    with pytest.raises(ValueError, match="must be >= 1"):
        engine.warm_up(max_batch=0, max_len=16)
