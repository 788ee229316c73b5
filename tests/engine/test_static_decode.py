"""The static (bucketed, CUDA-graph-ready) decode path, exercised on CPU.

On CUDA the engine pads every decode step to a power-of-two batch and replays it as a CUDA
graph. The padding logic is device-independent, so it is checked here: in batch-invariant
mode the padded path must give exactly the bits of the plain path, and stay invariant.
(tests/engine/test_cuda_invariance.py checks the graphs themselves on a GPU.)
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.test_invariance import differing_requests, random_pool, signature
from workers.engine import load_engine
from workers.engine.model import KVCache, decode_one_token, prefill
from workers.engine.static_decode import PREFILL_BUCKETS, decode_bucket, prefill_bucket


def test_decode_bucket() -> None:
    assert [decode_bucket(b) for b in (1, 2, 3, 4, 5, 31, 32, 33, 64, 65)] == \
        [1, 2, 4, 4, 8, 32, 32, 64, 64, 128]


def test_prefill_bucket() -> None:
    assert [prefill_bucket(n) for n in (1, 16, 17, 128, 129, 300, 512)] == \
        [16, 16, 32, 128, 192, 320, 512]
    assert prefill_bucket(513) is None and list(PREFILL_BUCKETS) == sorted(PREFILL_BUCKETS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_decode_matches_plain_decode_bit_for_bit(dtype: str) -> None:
    plain = load_engine("tiny-demo", dtype=dtype)
    padded = load_engine("tiny-demo", dtype=dtype)
    padded.static_decode = True
    assert not plain.static_decode                  # CPU default: exact batches
    pool = random_pool(11, plain.config.vocab_size, n=40)
    rng = random.Random(4)
    for size in (1, 3, 5, 13, 40):
        members = rng.sample(pool, size)
        want = [signature(r) for r in plain.generate(members, max_batch=size)]
        got = [signature(r) for r in padded.generate(members, max_batch=size)]
        assert got == want, f"padded decode changed results at batch {size}"
    assert padded._decoder is not None and padded._cache is not None
    assert padded._cache.slots == 64                # bucket of 40
    assert padded.stats.decode_steps > 0 and padded.stats.generated_tokens > 0


def test_padded_decode_is_invariant() -> None:
    engine = load_engine("tiny-demo")
    engine.static_decode = True
    pool = random_pool(12, engine.config.vocab_size, n=30)
    differing, compared = differing_requests(engine, pool, seed=6, sizes=(3, 7, 30))
    assert compared == 40 and not differing, differing[:10]


def test_static_decode_step_needs_no_rope_growth() -> None:
    """decode_one_token(static=True) only indexes the RoPE tables sized beforehand."""
    engine = load_engine("tiny-demo")
    model = engine.model
    cache = KVCache(model.config, 2, 128, dtype=model.dtype, device=model.device)
    model.ensure_rope(cache.max_seq)
    table = model._rope_cos
    prompt = torch.tensor([5, 6, 7])
    prefill(model, cache, prompt, torch.arange(3), torch.zeros(3, dtype=torch.int64),
            torch.tensor([0, 3], dtype=torch.int32))
    tokens, positions = torch.tensor([8, 0]), torch.tensor([3, 0])
    static = decode_one_token(model, cache, tokens, positions, static=True)
    assert model._rope_cos is table
    again = decode_one_token(model, cache, tokens, positions)
    assert torch.equal(static, again)


def test_kv_cache_layers_are_views_of_one_buffer() -> None:
    """Every layer's k and v live in ``kv``: a slot move and a growth carry all of them."""
    engine = load_engine("tiny-demo")
    cfg = engine.model.config
    cache = KVCache(cfg, 3, 32, dtype=torch.float32, device=torch.device("cpu"))
    assert len(cache.k) == len(cache.v) == cfg.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    assert torch.equal(cache.kv[1, -1], cache.v[-1])
    before = [t.clone() for t in cache.k + cache.v]
    cache.move_slot(2, 0)
    for old, new in zip(before, cache.k + cache.v, strict=True):
        assert torch.equal(new[0], old[2]) and torch.equal(new[1:], old[1:])
    moved = [t.clone() for t in cache.k + cache.v]
    bigger = cache.grow(5, 48)
    assert (bigger.slots, bigger.max_seq) == (5, 48)
    for old, new in zip(moved, bigger.k + bigger.v, strict=True):
        assert torch.equal(new[:3, :, :32], old) and not new[3:].any() and not new[:, :, 32:].any()
    bigger.k[0][4, 0, 40] = 1.0
    assert bigger.kv[0, 0, 4, 0, 40].eq(1.0).all()
