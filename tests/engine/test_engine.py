"""ReferenceEngine behaviour: finish reasons, digests, logprobs, toggling, random weights."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ledger.core.fingerprint import FINGERPRINT_FIELDS, fingerprint_id
from workers.engine import ReferenceEngine, load_engine, ops
from workers.engine.api import GenerationRequest, SamplingParams
from workers.engine.model import KVCache, prefill


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return load_engine("tiny-demo")


def req(prompt: tuple[int, ...] = (256, 72, 105), id: str = "r", **sampling: object
        ) -> GenerationRequest:
    return GenerationRequest(id, prompt, SamplingParams(**sampling))  # type: ignore[arg-type]


def test_finish_reasons(engine: ReferenceEngine) -> None:
    free = engine.generate([req(max_tokens=6, ignore_eos=True)], max_batch=1)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop_at = free.token_ids[2]
    stopped = engine.generate([req(max_tokens=6, stop_token_ids=(stop_at,))], max_batch=1)[0]
    first = free.token_ids.index(stop_at)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first + 1]       # the stop token is included
    empty = engine.generate([req(max_tokens=0)], max_batch=1)[0]
    assert empty.token_ids == [] and empty.finish_reason == "length"


def test_eos_stops_unless_ignored() -> None:
    eng = load_engine("tiny-demo")
    first = eng.generate([req(max_tokens=1)], max_batch=1)[0].token_ids[0]
    object.__setattr__(eng.model.config, "eos_token_ids", (first,))
    assert eng.generate([req(max_tokens=4)], max_batch=1)[0].finish_reason == "stop"
    ignored = eng.generate([req(max_tokens=4, ignore_eos=True)], max_batch=1)[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 4


def test_context_limit_caps_generation(engine: ReferenceEngine) -> None:
    limit = engine.config.max_position_embeddings
    result = engine.generate([req(prompt=(1,) * (limit - 3), max_tokens=10)], max_batch=1)[0]
    assert len(result.token_ids) == 3 and result.finish_reason == "length"
    with pytest.raises(ValueError, match="does not fit"):
        engine.generate([req(prompt=(1,) * limit)], max_batch=1)


@pytest.mark.parametrize("bad", [
    {"prompt": ()}, {"prompt": (260,)}, {"prompt": (-1,)},
    {"temperature": 0.5},                       # no seed
])
def test_invalid_requests(engine: ReferenceEngine, bad: dict[str, object]) -> None:
    prompt = bad.pop("prompt", (1, 2))
    with pytest.raises(ValueError):
        engine.generate([req(prompt=prompt, **bad)], max_batch=1)  # type: ignore[arg-type]


def test_digest_and_logprob_of_first_step(engine: ReferenceEngine) -> None:
    prompt = (256, 10, 20, 30)
    result = engine.generate([req(prompt=prompt, max_tokens=1, logprobs=3)], max_batch=1)[0]
    cache = KVCache(engine.config, 1, 64, dtype=engine.model.dtype, device=engine.device)
    with torch.inference_mode(), ops.batch_invariant_mode(True):
        logits = prefill(engine.model, cache, torch.tensor(prompt), torch.arange(4),
                         torch.zeros(4, dtype=torch.int64),
                         torch.tensor([0, 4], dtype=torch.int32))[0]
        logprobs = ops.log_softmax(logits[None])[0]
    assert result.logits_sha256 == [hashlib.sha256(logits.numpy().tobytes()).hexdigest()]
    token = result.token_ids[0]
    assert token == int(logits.argmax())
    assert result.logprobs == [logprobs[token].item()]
    assert result.top_logprobs is not None
    top = result.top_logprobs[0]
    assert top[0][0] == token and len(top) == 3
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_seeded_sampling_is_reproducible(engine: ReferenceEngine) -> None:
    a = engine.generate([req(temperature=1.0, seed=1, max_tokens=12)], max_batch=1)[0]
    b = engine.generate([req(temperature=1.0, seed=1, max_tokens=12)], max_batch=1)[0]
    c = engine.generate([req(temperature=1.0, seed=2, max_tokens=12)], max_batch=1)[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


def test_batches_keep_file_order(engine: ReferenceEngine) -> None:
    requests = [req(prompt=(256, i), id=f"r{i}", max_tokens=2) for i in range(7)]
    results = engine.generate(requests, max_batch=3)
    assert [r.id for r in results] == [f"r{i}" for i in range(7)]


def test_toggle_between_calls_and_runtime(engine: ReferenceEngine) -> None:
    runtime = engine.runtime()
    assert set(FINGERPRINT_FIELDS) <= set(runtime)
    assert runtime["batch_invariant"] is True and runtime["attention_backend"] == "torch-bi"
    assert runtime["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    try:
        engine.batch_invariant = False
        fast = engine.runtime()
        assert fast["batch_invariant"] is False
        assert fingerprint_id(fast) != fingerprint_id(runtime)
        assert engine.generate([req(max_tokens=2)], max_batch=1)[0].token_ids
    finally:
        engine.batch_invariant = True
    assert not ops.is_batch_invariant()                 # nothing leaked out of generate


def test_random_engine_any_shape() -> None:
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128,
              "intermediate_size": 448, "num_hidden_layers": 3, "num_attention_heads": 8,
              "num_key_value_heads": 2, "rope_theta": 500000.0, "max_position_embeddings": 256,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 128}}
    engine = ReferenceEngine.random(config, dtype="bfloat16", seed=3)
    assert engine.model.embed.dtype == torch.bfloat16
    assert engine.model.layers[0].wqkv.shape == ((8 + 2 * 2) * 16, 128)
    again = ReferenceEngine.random(config, dtype="bfloat16", seed=3)
    r = [req(prompt=(1, 2, 3), max_tokens=3)]
    assert engine.generate(r, max_batch=1)[0].logits_sha256 == \
        again.generate(r, max_batch=1)[0].logits_sha256


def test_prefill_groups_do_not_change_results() -> None:
    """Prompts prefilled in several token-budget groups give the same bits as one group."""
    one = load_engine("tiny-demo")
    many = load_engine("tiny-demo")
    many.prefill_token_budget = 7
    requests = [req(prompt=(256, *range(i, i + 3 * i + 1)), id=f"r{i}", max_tokens=3)
                for i in range(6)]
    a, b = one.generate(requests, max_batch=6), many.generate(requests, max_batch=6)
    assert [r.logits_sha256 for r in a] == [r.logits_sha256 for r in b]
