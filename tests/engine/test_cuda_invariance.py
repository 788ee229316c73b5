"""Acceptance 3: batch invariance of the whole engine on CUDA, at Llama-3-8B shapes in bf16.

The same procedure as the CPU test (tests/engine/test_invariance.py), on a model with
Llama-3-8B's shapes (32 layers, hidden 4096, 32/8 heads, intermediate 14336, vocab 128256)
and random weights drawn on the GPU: every request of a random pool (greedy and seeded
sampling with random temperature, top_k, top_p, min_p, penalties, logprobs and stop ids)
runs alone, then inside random batches of 2..64 co-tenants in random order. Token ids,
logprobs (as float bits), top logprobs, finish reasons and per-step logits digests must be
identical. Prompts run up to 700 tokens (several prefill query blocks and decode KV splits);
decode steps run as CUDA graphs on batches padded to powers of two. The negative control
(batch invariance off: cuBLAS, SDPA) must find differences.

On the device: ``python3 -m pytest tests/engine/test_cuda_invariance.py --noconftest -m gpu``
(tests/conftest.py needs psycopg; this file needs only torch, triton and safetensors).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.engine.test_invariance import (  # noqa: E402
    BATCH_SIZES,
    differing_requests,
    random_pool,
    signature,
)
from workers.engine import ReferenceEngine, ops  # noqa: E402
from workers.engine import model as engine_model  # noqa: E402
from workers.engine.api import GenerationRequest  # noqa: E402
from workers.engine.config import LLAMA3_8B_CONFIG  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

POOL_SIZE = 72


def gpu_pool(seed: int, vocab_size: int, n: int = POOL_SIZE) -> list[GenerationRequest]:
    """The CPU test's random requests with longer prompts (1..700 tokens), 1..12 new tokens."""
    rng = random.Random(seed)
    pool = []
    for request in random_pool(seed, vocab_size, n):
        length = rng.choice([1, 2, rng.randint(3, 64), rng.randint(65, 300),
                             rng.randint(301, 700)])
        prompt = tuple(rng.randrange(vocab_size) for _ in range(length))
        sampling = dataclasses.replace(request.sampling, max_tokens=rng.randint(1, 12))
        pool.append(GenerationRequest(request.id, prompt, sampling))
    return pool


@pytest.fixture(scope="module")
def engine() -> Iterator[ReferenceEngine]:
    engine = ReferenceEngine.random(LLAMA3_8B_CONFIG, device="cuda", dtype="bfloat16",
                                    seed=0)
    yield engine
    del engine
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def pool(engine: ReferenceEngine) -> list[GenerationRequest]:
    return gpu_pool(2026, engine.config.vocab_size)


def test_engine_runs_triton_kernels_and_cuda_graphs(engine: ReferenceEngine,
                                                    pool: list[GenerationRequest]) -> None:
    assert engine.runtime()["attention_backend"] == "triton-bi"
    assert engine.static_decode and engine.cuda_graphs
    five = [GenerationRequest(r.id, r.prompt_token_ids, dataclasses.replace(
        r.sampling, max_tokens=6, ignore_eos=True, stop_token_ids=())) for r in pool[:5]]
    results = engine.generate(five, max_batch=5)
    assert all(len(r.token_ids) == 6 for r in results)
    assert all(r.token_ids and len(r.logits_sha256) == len(r.token_ids) for r in results)
    assert engine._decoder is not None
    assert (True, 8) in engine._decoder.captured            # 5 rows padded to 8, captured
    stats = engine.stats
    assert stats.decode_steps > 0 and stats.generated_tokens == sum(
        len(r.token_ids) for r in results)


def test_batch_invariant_on_cuda(engine: ReferenceEngine,
                                 pool: list[GenerationRequest]) -> None:
    engine.batch_invariant = True
    differing, compared = differing_requests(engine, pool, seed=1)
    assert compared == sum(BATCH_SIZES)
    assert not differing, f"{len(differing)}/{compared} results changed with co-tenants: " \
                          f"{differing[:10]}"
    # The pool exercised what it should: both sampling kinds, several lengths.
    assert any(r.sampling.temperature > 0 for r in pool)
    assert any(r.sampling.temperature == 0 for r in pool)
    assert max(len(r.prompt_token_ids) for r in pool) > 300


def test_negative_control_finds_differences(engine: ReferenceEngine,
                                            pool: list[GenerationRequest]) -> None:
    engine.batch_invariant = False
    try:
        assert engine.runtime()["attention_backend"] == "torch-sdpa"
        differing, compared = differing_requests(engine, pool, seed=1)
    finally:
        engine.batch_invariant = True
    print(f"negative control: {len(differing)}/{compared} batched results differ")
    assert differing, "batch invariance off, yet no request changed: the test is blind"


def test_cuda_graphs_give_the_eager_bits(engine: ReferenceEngine,
                                         pool: list[GenerationRequest]) -> None:
    """Graph replay == the same padded step run eagerly == the exact (unpadded) batch ==
    the unfused torch RoPE + KV-cache write, bit for bit."""
    members = random.Random(3).sample(pool, 13)
    graphed = [signature(r) for r in engine.generate(members, max_batch=13)]
    try:
        engine.cuda_graphs, engine._decoder = False, None           # eager, padded to 16
        eager = [signature(r) for r in engine.generate(members, max_batch=13)]
        engine.static_decode, engine._decoder = False, None         # eager, exact batch
        exact = [signature(r) for r in engine.generate(members, max_batch=13)]
        engine_model.FUSE_ROPE_ON_CUDA = False              # torch RoPE, index_put
        unfused = [signature(r) for r in engine.generate(members, max_batch=13)]
    finally:
        engine_model.FUSE_ROPE_ON_CUDA = True
        engine.cuda_graphs, engine.static_decode, engine._decoder = True, True, None
    assert graphed == eager
    assert graphed == exact
    assert graphed == unfused


# ------------------------------------------------------------------ accuracy on the GPU
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch_invariant", [True, False], ids=["bi", "fast"])
def test_cuda_logits_match_float64_reference(tmp_path: Path, dtype: str,
                                             batch_invariant: bool) -> None:
    """Acceptance 1's check on CUDA: a small Llama-3 checkpoint (head_dim 64), prefill then
    teacher-forced decode steps, against the float64 reference of test_correctness."""
    from tests.engine.conftest import write_hf_model
    from tests.engine.test_correctness import TOLERANCE, reference_logits
    from workers.engine import load_engine
    from workers.engine.model import KVCache, decode_one_token, prefill

    model_dir = write_hf_model(tmp_path / "llama3", "llama3", hidden_size=256,
                               intermediate_size=512, max_position_embeddings=256)
    engine = load_engine(model_dir, device="cuda", dtype=dtype,
                         batch_invariant=batch_invariant)
    dev = engine.device
    tokens = [int(t) for t in torch.randint(0, 300, (40,), generator=torch.Generator()
                                            .manual_seed(7))]
    prompt_len = 23
    model = engine.model
    cache = KVCache(model.config, 1, 64, dtype=model.dtype, device=dev)
    rows = []
    with torch.inference_mode(), ops.batch_invariant_mode(batch_invariant):
        rows.append(prefill(
            model, cache, torch.tensor(tokens[:prompt_len], device=dev),
            torch.arange(prompt_len, device=dev),
            torch.zeros(prompt_len, dtype=torch.int64, device=dev),
            torch.tensor([0, prompt_len], dtype=torch.int32, device=dev))[0])
        for pos in range(prompt_len, len(tokens)):
            rows.append(decode_one_token(model, cache, torch.tensor([tokens[pos]], device=dev),
                                         torch.tensor([pos], device=dev))[0])
    got = torch.stack(rows).double().cpu()
    want = reference_logits(model_dir, tokens,
                            torch.bfloat16 if dtype == "bfloat16" else None)[prompt_len - 1:]
    scale = 1 + want.abs().max().item()
    err = (got - want).abs().max().item()
    print(f"{dtype} {'bi' if batch_invariant else 'fast'}: max |logit error| {err:.3g} "
          f"(scale {scale:.3g})")
    assert err <= TOLERANCE[dtype] * scale, f"{dtype}: max error {err:.3g}"
