"""Continuous batching, chunked prefill and the prefix cache on CUDA, at Llama-3-8B shapes.

The CPU matrix of ``tests/engine/test_continuous.py`` (probe alone / joining a running
batch at step 0, 1, 7 x prefill chunk 1, 16, 61, whole x prefix cache cold, warm) on a
model with Llama-3-8B's shapes in bf16 (random weights drawn on the GPU), with a
300-token probe prompt (two decode-kernel KV splits). Decode steps run as CUDA graphs;
prompt chunks run eagerly through the Triton decode-attention kernel over the slot's cache.
The negative control (cuBLAS, SDPA) must differ somewhere.

On the device: ``python3 -m pytest tests/engine/test_cuda_continuous.py --noconftest -m gpu``
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.engine.test_continuous import (  # noqa: E402
    CHUNKS,
    JOINS,
    WARM,
    run_probe,
    scenario,
)
from workers.engine import ReferenceEngine  # noqa: E402
from workers.engine.config import LLAMA3_8B_CONFIG  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT_LEN = 300


@pytest.fixture(scope="module")
def engine() -> Iterator[ReferenceEngine]:
    engine = ReferenceEngine.random(LLAMA3_8B_CONFIG, device="cuda", dtype="bfloat16", seed=0)
    yield engine
    del engine
    torch.cuda.empty_cache()


def cuda_matrix(engine: ReferenceEngine, mixed: list[int] | None = None
                ) -> tuple[list[str], int]:
    probe, cotenants, warmer = scenario(engine.config.vocab_size, prompt_len=PROMPT_LEN)
    was, engine.mixed_steps = engine.mixed_steps, False
    plain, _ = run_probe(engine, probe, cotenants, warmer, join=None, chunk=None, warm=None)
    engine.mixed_steps = was
    differing, compared = [], 0
    for join, chunk, warm in product(JOINS, CHUNKS, WARM):
        got, hits = run_probe(engine, probe, cotenants, warmer, join=join, chunk=chunk,
                              warm=warm, mixed=mixed)
        if warm:
            assert hits >= 64, f"warm prefix cache served only {hits} tokens"
        compared += 1
        if got != plain:
            differing.append(f"join={join} chunk={chunk} warm={warm}")
    return differing, compared


def test_gpu_invariant_under_joins_chunks_and_prefix_cache(engine: ReferenceEngine) -> None:
    engine.batch_invariant = True
    differing, compared = cuda_matrix(engine)
    assert compared == len(JOINS) * len(CHUNKS) * len(WARM)
    assert not differing, f"{len(differing)}/{compared} combinations changed the probe: " \
                          f"{differing}"
    decoder: Any = engine._decoder
    assert decoder is not None and any(bi for bi, _ in decoder.captured), \
        "decode steps did not run as CUDA graphs"


def test_gpu_mixed_steps_give_the_same_bits(engine: ReferenceEngine) -> None:
    """Decode tokens inside the prompt forwards (``mixed_steps``, a captured prompt graph
    or an eager forward) give the bits of decode steps, across the whole matrix."""
    engine.batch_invariant = True
    engine.mixed_steps = True
    mixed: list[int] = []
    try:
        differing, compared = cuda_matrix(engine, mixed)
    finally:
        engine.mixed_steps = False
    assert not differing, f"{len(differing)}/{compared} combinations changed the probe " \
                          f"with mixed steps: {differing}"
    assert sum(1 for m in mixed if m) >= len(mixed) // 2, mixed


def test_gpu_warm_up_captures_every_bucket_and_changes_no_bit(engine: ReferenceEngine) -> None:
    """A server's warm-up captures each decode bucket up to max_batch and every prompt
    bucket before any request; a request afterwards gets the bits it got before, and
    waits for no capture (the decoder, and so its graphs, stays the warmed one)."""
    from workers.engine.static_decode import PREFILL_BUCKETS

    engine.batch_invariant = True
    probe, cotenants, warmer = scenario(engine.config.vocab_size, prompt_len=PROMPT_LEN)
    before, _ = run_probe(engine, probe, cotenants, warmer, join=1, chunk=61, warm=True)
    engine._decoder = None
    engine._cache = None
    graphs = engine.warm_up(max_batch=8, max_len=1024)
    decoder = engine._decoder
    assert decoder is not None
    assert decoder.captured == [(True, b) for b in (1, 2, 4, 8)]
    assert decoder.captured_prefills == list(PREFILL_BUCKETS)
    assert graphs == 4 + len(PREFILL_BUCKETS)
    after, _ = run_probe(engine, probe, cotenants, warmer, join=1, chunk=61, warm=True)
    assert after == before
    assert engine._decoder is decoder and len(decoder.captured) == 4


def test_gpu_cuda_graphs_off_gives_the_same_bits(engine: ReferenceEngine) -> None:
    engine.batch_invariant = True
    probe, cotenants, warmer = scenario(engine.config.vocab_size, prompt_len=PROMPT_LEN)
    graphs, _ = run_probe(engine, probe, cotenants, warmer, join=1, chunk=61, warm=True)
    engine.cuda_graphs = False
    engine._decoder = None
    engine._cache = None
    try:
        eager, _ = run_probe(engine, probe, cotenants, warmer, join=1, chunk=61, warm=True)
    finally:
        engine.cuda_graphs = True
        engine._decoder = None
        engine._cache = None
    assert eager == graphs


def test_gpu_negative_control_default_kernels_differ(engine: ReferenceEngine) -> None:
    engine.batch_invariant = False
    try:
        differing, compared = cuda_matrix(engine)
    finally:
        engine.batch_invariant = True
    print(f"negative control: {len(differing)}/{compared} differ: {differing}")
    assert differing, f"batch invariance off, yet none of {compared} combinations changed " \
                      f"the probe: the test is blind"
