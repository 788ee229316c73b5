"""vLLM on a GPU with realistic weights: the needle through ``VLLMEngine`` for every
sampling mode the deterministic channel admits, the refusal of one it does not, the
worker's self-check, EOS with ``skip_tokenizer_init``, and what the fingerprint records.

Marked ``gpu``; skipped without a CUDA GPU or without vLLM. Weights: a Llama-family
safetensors checkpoint (8 layers, hidden 1024, GQA 16/8, vocab 1024, bf16, the reference
loader's N(0, 1/fan_in) draw), written to ``LEDGER_VLLM_TEST_MODEL`` if that names a
folder without one, else to a temporary folder. One engine for the module (vLLM reads its
flags once per process). Measured: docs/engine.md, "vLLM: what the flag covers".
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import struct
from pathlib import Path
from typing import Any

import pytest

from workers.engine.api import GenerationRequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

SMALL_LLAMA = {
    "model_type": "llama", "vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1001,
    "eos_token_id": 1000,
}
EOS = 1000
#: Every sampling mode the deterministic channel admits (all seeded but greedy).
ADMITTED = {
    "greedy": {},
    "seeded": {"temperature": 1.0},
    "top_k": {"temperature": 0.9, "top_k": 8},
    "top_k_large": {"temperature": 1.1, "top_k": 50},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "top_k+top_p": {"temperature": 0.8, "top_k": 20, "top_p": 0.95},
    "min_p+penalties": {"temperature": 1.0, "min_p": 0.05, "repetition_penalty": 1.1,
                        "presence_penalty": 0.2, "frequency_penalty": 0.1},
}
#: Admitted sizes (<= MAX_INVARIANT_SEQS = 16), both sides of vLLM's sampler switch at 8.
SIZES = (1, 3, 7, 8, 9, 16)
#: Beyond the admitted limit: measured to differ (needles with long prompts).
BEYOND = (43, 64)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from benchmarks.vllm import write_checkpoint
    from workers.engine.vllm_adapter import VLLMEngine

    model = Path(os.environ.get("LEDGER_VLLM_TEST_MODEL") or
                 tmp_path_factory.mktemp("llama") / "small-llama")
    if not (model / "config.json").is_file():
        write_checkpoint(model, SMALL_LLAMA, seed=3)
    extra = {"gpu_memory_utilization": 0.5, "max_model_len": 2048,
             **json.loads(os.environ.get("LEDGER_VLLM_TEST_ENGINE_ARGS") or "{}")}
    # max_num_seqs 64 so the sizes beyond the admitted 16 can be run too: this engine's
    # runtime is therefore labelled not batch invariant (asserted below); the admitted
    # sizes are all <= 16, where a 16-seq engine schedules the same batches.
    return VLLMEngine(str(model), dtype="bfloat16", max_batch=64, extra_engine_args=extra)


def _bits(result: Any) -> tuple[list[int], list[bytes]]:
    return result.token_ids, [struct.pack("<d", x) for x in result.logprobs]


def _request(rng: random.Random, rid: str, mode: dict[str, Any], seed: int,
             ignore_eos: bool = True) -> GenerationRequest:
    prompt = tuple(rng.randrange(1000) for _ in range(rng.randrange(8, 700)))
    extra = {"seed": seed} if mode else {}
    return GenerationRequest(rid, prompt, SamplingParams(
        max_tokens=rng.randrange(24, 48), ignore_eos=ignore_eos, logprobs=2, **mode, **extra))


def _needle_differences(engine: Any, sizes: tuple[int, ...]) -> tuple[int, list[str]]:
    rng = random.Random(5)
    needles = [_request(rng, f"needle-{name}", mode, 100 + i)
               for i, (name, mode) in enumerate(ADMITTED.items())]
    alone = {r.id: _bits(engine.generate([r], max_batch=1)[0]) for r in needles}
    modes = list(ADMITTED.values())
    differ: list[str] = []
    compared = 0
    for size in sizes:
        for start in range(0, len(needles), max(1, min(size, len(needles)))):
            batch = needles[start:start + size]
            n = 0
            while len(batch) < size:
                n += 1
                batch.insert(rng.randrange(len(batch) + 1), _request(
                    rng, f"co-{size}-{start}-{n}", modes[n % len(modes)], rng.randrange(10**6)))
            if size == max(sizes):
                rng.shuffle(batch)
            for req, res in zip(batch, engine.generate(batch, max_batch=size), strict=True):
                if req.id in alone:
                    compared += 1
                    if _bits(res) != alone[req.id]:
                        differ.append(f"{req.id} at batch {size}")
    assert compared == len(sizes) * len(needles)
    return compared, differ


def test_needle_is_invariant_for_every_admitted_mode(engine: Any) -> None:
    """Each needle (prompts of 8-700 tokens) alone vs at every admitted size (co-tenants of
    every admitted mode, random positions; the largest batch shuffled): identical token
    IDs and logprob bits."""
    _, differ = _needle_differences(engine, SIZES)
    assert not differ, differ


@pytest.mark.xfail(strict=True, reason="measured: vLLM 0.25 with the flag and the pin is not "
                   "batch invariant at 43+ sequences with long prompts; so not admitted")
def test_needle_beyond_the_admitted_batch_size_differs(engine: Any) -> None:
    _, differ = _needle_differences(engine, BEYOND)
    assert not differ, differ


def test_worker_self_check_passes(engine: Any) -> None:
    from workers.engine.selfcheck import self_check_engine, self_check_sizes

    compared = self_check_engine(engine, name="small-llama", max_batch=16)
    assert set(compared) == set(self_check_sizes(16, engine.batch_thresholds))
    assert {7, 8, 9, 16} <= set(compared)


def test_unseeded_sampling_is_refused(engine: Any) -> None:
    from workers.engine.vllm_adapter import NotDeterministic

    unseeded = SamplingParams(temperature=0.8, max_tokens=4)
    with pytest.raises(NotDeterministic, match="seed"):
        engine.check_deterministic(unseeded)
    engine.check_deterministic(SamplingParams(temperature=0.8, top_k=5, seed=1))  # pinned


def test_fingerprint_records_what_changes_numerics(engine: Any) -> None:
    from workers.engine.vllm_adapter import runtime_from

    runtime = engine.runtime()
    flags = runtime["engine_flags"]
    # this engine runs 64 sequences: labelled, with the reason
    assert runtime["batch_invariant"] is False
    assert "max_num_seqs > 16" in runtime["not_batch_invariant_because"]
    admitted = runtime_from(
        version=runtime["engine_version"], device={}, dtype="bfloat16",
        tensor_parallel_size=1, attention_backend="FLASH_ATTN", env=engine.env,
        settings={**engine.settings, "max_num_seqs": 16}, pin=engine.pin)
    assert admitted["batch_invariant"] is True, admitted.get("not_batch_invariant_because")
    assert "VLLM_ATTENTION_BACKEND" not in flags
    assert flags["plugin"] == "inference_ledger_pin/1" and flags["topk_topp_path"] == "pytorch"
    for key in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                "async_scheduling", "enable_prefix_caching", "compilation_mode",
                "cudagraph_mode", "block_size"):
        assert key in flags, key
    assert flags["async_scheduling"] is False and flags["enable_prefix_caching"] is False
    assert flags["enable_chunked_prefill"] is False
    assert flags["flash_attn_version"] == 3


def test_generation_stops_at_eos_without_a_tokenizer(engine: Any) -> None:
    """skip_tokenizer_init makes vLLM warn that the EOS id is None; generation_config.json's
    eos_token_id must still end generation, with the EOS token as the last output token
    (the reference engine's convention) and finish_reason "stop"."""
    rng = random.Random(11)
    requests = [GenerationRequest(f"eos-{i}", tuple(rng.randrange(1000) for _ in range(16)),
                                  SamplingParams(temperature=1.5, seed=i, max_tokens=200,
                                                 logprobs=None))
                for i in range(64)]
    results = engine.generate(requests, max_batch=64)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped, "no request sampled EOS: the check would be vacuous"
    for r in results:
        assert EOS not in r.token_ids[:-1], r.id
        if r.finish_reason == "stop":
            assert r.token_ids[-1] == EOS, r
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 200, r
    ignored = engine.generate([GenerationRequest(
        "ign", requests[0].prompt_token_ids, SamplingParams(
            temperature=1.5, seed=0, max_tokens=200, ignore_eos=True))], max_batch=1)[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 200
