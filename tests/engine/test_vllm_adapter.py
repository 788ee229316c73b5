"""The vLLM adapter: mapping tested without vLLM; an integration test where vLLM + GPU exist."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest

from workers.engine.api import GenerationRequest, SamplingParams
from workers.engine.vllm_adapter import (
    VLLM_ENV,
    result_from_output,
    vllm_engine_kwargs,
    vllm_sampling_kwargs,
)


def test_every_sampling_field_is_mapped() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                            repetition_penalty=1.1, presence_penalty=0.2,
                            frequency_penalty=0.3, max_tokens=12, seed=99,
                            stop_token_ids=(5, 6), ignore_eos=True, logprobs=4)
    kwargs = vllm_sampling_kwargs(params)
    for field in dataclasses.fields(SamplingParams):
        assert field.name in kwargs, f"SamplingParams.{field.name} is not mapped to vLLM"
    assert kwargs == {
        "n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
        "max_tokens": 12, "seed": 99, "stop_token_ids": [5, 6], "ignore_eos": True,
        "logprobs": 4, "detokenize": False,
    }


def test_defaults_map_to_vllm_disabled_values() -> None:
    kwargs = vllm_sampling_kwargs(SamplingParams())
    assert kwargs["top_k"] == -1 and kwargs["logprobs"] == 0 and kwargs["seed"] is None
    assert kwargs["stop_token_ids"] == []


def test_engine_kwargs_pin_replay_settings() -> None:
    kwargs = vllm_engine_kwargs("/m", dtype="bfloat16", tensor_parallel_size=2,
                                attention_backend="FLASH_ATTN", max_batch=16, seed=0)
    assert kwargs["skip_tokenizer_init"] is True
    assert kwargs["enable_prefix_caching"] is False and kwargs["async_scheduling"] is False
    assert kwargs["attention_backend"] == "FLASH_ATTN" and kwargs["tensor_parallel_size"] == 2
    assert kwargs["max_num_seqs"] == 16 and kwargs["logprobs_mode"] == "raw_logprobs"
    older = vllm_engine_kwargs("/m", dtype="bfloat16", tensor_parallel_size=1,
                               attention_backend="FLASH_ATTN", max_batch=16, seed=0,
                               accepted={"model", "skip_tokenizer_init", "dtype"})
    assert set(older) == {"model", "skip_tokenizer_init", "dtype"}
    assert VLLM_ENV["VLLM_BATCH_INVARIANT"] == "1"
    assert VLLM_ENV["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def _lp(logprob: float, rank: int | None) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=None)


def test_result_from_request_output() -> None:
    output = SimpleNamespace(outputs=[SimpleNamespace(
        token_ids=[7, 3], finish_reason="stop",
        logprobs=[{7: _lp(-0.25, 1), 9: _lp(-2.0, 2)},
                  {3: _lp(-1.5, 3), 4: _lp(-0.5, 1), 8: _lp(-1.0, 2)}],
    )])
    result = result_from_output("a", output, want_top=2)
    assert result.token_ids == [7, 3] and result.finish_reason == "stop"
    assert result.logprobs == [-0.25, -1.5]
    assert result.top_logprobs == [[(7, -0.25), (9, -2.0)], [(4, -0.5), (8, -1.0)]]
    assert result.logits_sha256 == []
    assert result_from_output("a", output, want_top=None).top_logprobs is None


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_is_batch_invariant_on_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from workers.engine.reference import TINY_DEMO_DIR
    from workers.engine.vllm_adapter import VLLMEngine

    engine = VLLMEngine(str(TINY_DEMO_DIR), dtype="bfloat16", max_batch=16)
    requests = [GenerationRequest(f"r{i}", tuple(range(1, 3 + 5 * i)), SamplingParams(
        max_tokens=8, temperature=0.8 if i % 2 else 0.0, seed=i, logprobs=2))
        for i in range(16)]
    alone = [engine.generate([r], max_batch=1)[0] for r in requests]
    batched = engine.generate(requests, max_batch=16)
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert engine.runtime()["engine"] == "vllm"
