"""The static (bucketed, CUDA-graph-ready) decode path, exercised on CPU.

On CUDA the engine pads every decode step to a power-of-two batch and replays it as a CUDA
graph. The padding logic is device-independent, so it is checked here: in batch-invariant
mode the padded path must give exactly the bits of the plain path, and stay invariant.
(tests/engine/test_cuda_invariance.py checks the graphs themselves on a GPU.)
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.engine.test_invariance import differing_requests, random_pool, signature
from workers.engine import load_engine, ops
from workers.engine.model import KVCache, decode_one_token, prefill
from workers.engine.static_decode import StaticDecoder, decode_bucket


def test_decode_bucket() -> None:
    assert [decode_bucket(b) for b in (1, 2, 3, 4, 5, 31, 32, 33, 64, 65)] == \
        [1, 2, 4, 4, 8, 32, 32, 64, 64, 128]


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


# ------------------------------------------------------------------ decode rows in prefill
#: Every family of the continuous matrix (tests/engine/test_continuous.py).
FAMILIES = ["tiny-demo/float32", "tiny-demo/bfloat16", "mistral/float32", "qwen2/float32",
            "qwen3/bfloat16", "llama2/float32", "llama3/float32"]


def _copy(cache: KVCache) -> KVCache:
    twin = KVCache.__new__(KVCache)
    twin.slots, twin.max_seq = cache.slots, cache.max_seq
    twin.k, twin.v = [k.clone() for k in cache.k], [v.clone() for v in cache.v]
    return twin


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all())


def _packed(pieces: list[tuple[int, int, list[int]]]) -> tuple[torch.Tensor, ...]:
    """tokens, positions, slots, cu_seqlens of (slot, first position, tokens) pieces."""
    tokens = torch.tensor([t for _, _, ts in pieces for t in ts])
    positions = torch.tensor([p0 + i for _, p0, ts in pieces for i in range(len(ts))])
    slots = torch.tensor([s for s, _, ts in pieces for _ in ts])
    cu = torch.tensor([0, *(len(ts) for _, _, ts in pieces)]).cumsum(0).to(torch.int32)
    return tokens, positions, slots, cu


@pytest.mark.parametrize("case", FAMILIES)
def test_decode_token_through_prefill_matches_decode_step_bit_for_bit(
        case: str, hf_model_dir: Any) -> None:
    """A mixed step's decode row (a one-token chunk at the sequence's next position, packed
    with prompt chunks of other slots) gives the logits and the k/v bits of the decode
    step (``decode_one_token``, and the padded static decoder the CUDA graphs replay)."""
    model_name, dtype = case.split("/")
    engine = load_engine(model_name if model_name == "tiny-demo" else hf_model_dir(model_name),
                         dtype=dtype)
    model, vocab = engine.model, engine.config.vocab_size
    rng = random.Random(case)
    lens = [70, 5, 130, 1]                        # decode rows at these positions (KV blocks
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]        # of 64: 1-3)
    chunk = [rng.randrange(vocab) for _ in range(40)]           # slot 4: a prompt, 2nd chunk
    head = [rng.randrange(vocab) for _ in range(25)]
    nexts = [rng.randrange(vocab) for _ in lens]
    with torch.inference_mode(), ops.batch_invariant_mode(True):
        cache = KVCache(model.config, 8, 256, dtype=model.dtype, device=model.device)
        for slot, prompt in enumerate([*prompts, head]):
            prefill(model, cache, *_packed([(slot, 0, prompt)]))
        tokens, positions = torch.tensor(nexts), torch.tensor(lens)

        plain_cache = _copy(cache)
        plain = decode_one_token(model, plain_cache, tokens, positions)            # [4, V]
        static_cache = _copy(cache)
        decoder = StaticDecoder(model, static_cache, cuda_graphs=False)
        padded = decoder.step(tokens[:3], positions[:3]).clone()    # 3 rows in a bucket of 4
        alone_cache = _copy(cache)
        alone = prefill(model, alone_cache, *_packed([(4, 25, chunk)]))            # [1, V]

        # The mixed forward: four decode rows, then the prompt chunk.
        mixed_cache = _copy(cache)
        mixed = prefill(model, mixed_cache, *_packed(
            [*((s, lens[s], [nexts[s]]) for s in range(4)), (4, 25, chunk)]))      # [5, V]
        # Decode rows of slots 1 and 3 only, the chunk first (dummy rows at slots 0, 2).
        sparse_cache = _copy(cache)
        sparse = prefill(model, sparse_cache, *_packed(
            [(4, 25, chunk), (1, lens[1], [nexts[1]]), (3, lens[3], [nexts[3]])]))
        # One decode row (no batching of one-token chunks).
        one = prefill(model, _copy(cache), *_packed([(2, lens[2], [nexts[2]])]))

    assert _same_bits(mixed[:4], plain), "decode rows in a mixed prefill differ from decode"
    assert _same_bits(padded, plain[:3]), "the padded static decode step differs"
    assert _same_bits(mixed[4], alone[0]), "the prompt chunk changed next to decode rows"
    assert _same_bits(sparse[0], alone[0])
    assert _same_bits(sparse[1], plain[1]) and _same_bits(sparse[2], plain[3])
    assert _same_bits(one[0], plain[2])
    for layer in range(model.config.num_hidden_layers):    # the k/v written: same bits
        for got, want in ((mixed_cache, plain_cache), (static_cache, plain_cache)):
            for a, b in ((got.k[layer][:3], want.k[layer][:3]),
                         (got.v[layer][:3], want.v[layer][:3])):
                assert _same_bits(a, b), f"layer {layer}: cache differs"
        assert _same_bits(mixed_cache.k[layer][4], alone_cache.k[layer][4])
