"""The vLLM adapter: mapping tested without vLLM; an integration test where vLLM + GPU exist."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from workers.engine import vllm_plugin
from workers.engine.api import SamplingParams
from workers.engine.selfcheck import self_check_sizes
from workers.engine.vllm_adapter import (
    RESOLVED_DEFAULTS,
    SCHEDULER_DEFAULTS,
    VLLM_ENV,
    deterministic_problem,
    memory_engine_args,
    result_from_output,
    runtime_from,
    settings_from_config,
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
    assert kwargs["enable_chunked_prefill"] is False
    assert kwargs["max_model_len"] == kwargs["max_num_batched_tokens"] == 8192
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


PIN = {"plugin": "inference_ledger_pin/1", "topk_topp_path": "pytorch"}
NO_PIN = {"plugin": None, "topk_topp_path": "vllm-default (<8 rows: pytorch, else triton)"}
DEVICE = {"device": "cuda", "gpu_name": "NVIDIA H200", "torch_version": "2.11.0+cu130"}


def _runtime(version: str = "0.25.0", env: dict[str, str] | None = None,
             pin: dict[str, object] | None = None, **settings: object) -> dict[str, object]:
    return runtime_from(version=version, device=DEVICE, dtype="bfloat16",
                        tensor_parallel_size=1, attention_backend="FLASH_ATTN",
                        env=VLLM_ENV if env is None else env,
                        settings={**SCHEDULER_DEFAULTS, **RESOLVED_DEFAULTS, **settings},
                        pin=PIN if pin is None else pin)


def test_fingerprint_records_settings_and_drops_dead_variables() -> None:
    from ledger.core.envelope import Runtime
    from ledger.core.fingerprint import fingerprint_id

    rt = _runtime()
    assert rt["batch_invariant"] is True and "not_batch_invariant_because" not in rt
    flags = rt["engine_flags"]
    assert "VLLM_ATTENTION_BACKEND" not in flags
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in flags     # no effect on numerics
    for key in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                "async_scheduling", "enable_prefix_caching", "compilation_mode",
                "cudagraph_mode", "plugin", "topk_topp_path", "block_size"):
        assert key in flags
    Runtime.model_validate(rt)
    base = fingerprint_id(rt)
    for change in ({"max_num_seqs": 32}, {"cudagraph_mode": "NONE"},
                   {"max_num_batched_tokens": 4096}, {"compilation_mode": "NONE"}):
        assert fingerprint_id(_runtime(**change)) != base, change
    triton = fingerprint_id(_runtime(pin={**PIN, "topk_topp_path": "triton"}))
    assert triton != base


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"pin": NO_PIN}, "not pinned"),
    ({"version": "0.27.1"}, "not a measured version"),
    ({"env": {**VLLM_ENV, "VLLM_BATCH_INVARIANT": "0"}}, "VLLM_BATCH_INVARIANT"),
    ({"async_scheduling": True}, "async scheduling"),
    ({"enable_prefix_caching": True}, "prefix caching"),
    ({"enable_chunked_prefill": True}, "chunked prefill"),
    ({"max_num_seqs": 256}, "max_num_seqs"),
])
def test_a_runtime_not_fully_pinned_is_not_batch_invariant(kwargs: dict[str, object],
                                                            reason: str) -> None:
    rt = _runtime(**kwargs)  # type: ignore[arg-type]
    assert rt["batch_invariant"] is False
    assert reason in str(rt["not_batch_invariant_because"])


def test_deterministic_channel_admission() -> None:
    greedy = SamplingParams()
    top_k = SamplingParams(temperature=0.8, top_k=20, seed=1)
    top_p = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    assert deterministic_problem(greedy, pinned=False) is None
    assert deterministic_problem(top_k, pinned=True) is None
    assert deterministic_problem(top_p, pinned=True) is None
    assert deterministic_problem(SamplingParams(temperature=0.8, seed=1), pinned=False) is None
    assert "top_k" in str(deterministic_problem(top_k, pinned=False))
    assert "top_k" in str(deterministic_problem(top_p, pinned=False))
    assert "seed" in str(deterministic_problem(SamplingParams(temperature=0.8), pinned=True))


def test_settings_are_read_from_vllm_config() -> None:
    import enum

    class Mode(enum.IntEnum):
        VLLM_COMPILE = 3

    class Graphs(enum.Enum):
        FULL_AND_PIECEWISE = (2, 1)

    cfg = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=16, max_num_batched_tokens=8192,
                                         enable_chunked_prefill=False,
                                         long_prefill_token_threshold=0,
                                         max_num_partial_prefills=1, async_scheduling=False),
        cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=16),
        model_config=SimpleNamespace(enforce_eager=False, disable_cascade_attn=True, seed=0,
                                     logprobs_mode="raw_logprobs"),
        compilation_config=SimpleNamespace(mode=Mode.VLLM_COMPILE,
                                           cudagraph_mode=Graphs.FULL_AND_PIECEWISE),
        attention_config=SimpleNamespace(flash_attn_version=3))
    settings = settings_from_config(cfg)
    assert settings == {**SCHEDULER_DEFAULTS, **RESOLVED_DEFAULTS}


def _fake_sampler() -> SimpleNamespace:
    calls: list[str] = []
    mod = SimpleNamespace(
        calls=calls, HAS_TRITON=True,
        apply_top_k_top_p_triton=lambda logits, k, p: calls.append("triton") or logits,
        apply_top_k_top_p_pytorch=lambda logits, k, p: calls.append("pytorch") or logits)

    def shipped(logits: list[int], k: object, p: object) -> list[int]:  # vLLM 0.25's branch
        impl = mod.apply_top_k_top_p_triton if len(logits) >= 8 \
            else mod.apply_top_k_top_p_pytorch
        return impl(logits, k, p)

    mod.apply_top_k_top_p = shipped
    return mod


@pytest.mark.parametrize("path", ["pytorch", "triton"])
def test_plugin_pins_one_path_in_every_importer(monkeypatch: pytest.MonkeyPatch,
                                                path: str) -> None:
    import sys

    sampler = _fake_sampler()
    importers = {name: SimpleNamespace(apply_top_k_top_p=sampler.apply_top_k_top_p)
                 for name in vllm_plugin.IMPORTERS}
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.25.0"))
    monkeypatch.setitem(sys.modules, vllm_plugin.SAMPLER_MODULE, sampler)
    for name, module in importers.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv(vllm_plugin.TOPK_PATH_ENV, path)
    monkeypatch.setattr(vllm_plugin, "_state", {"path": None, "patched": ()})
    sampler.apply_top_k_top_p([0] * 3, 1, None)
    sampler.apply_top_k_top_p([0] * 9, 1, None)
    assert sampler.calls == ["pytorch", "triton"]          # as shipped: by batch size
    vllm_plugin.register()
    vllm_plugin.register()                                  # idempotent
    sampler.calls.clear()
    for module in (sampler, *importers.values()):
        for rows in (1, 7, 8, 64):
            module.apply_top_k_top_p([0] * rows, 1, None)
    assert sampler.calls == [path] * 16
    assert vllm_plugin.active_path() == path
    assert vllm_plugin.pin_flags() == {"plugin": "inference_ledger_pin/1",
                                       "topk_topp_path": path}
    assert sampler.apply_top_k_top_p([5], None, None) == [5]   # nothing to filter


def test_plugin_leaves_an_unknown_vllm_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    sampler = _fake_sampler()
    shipped = sampler.apply_top_k_top_p
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.27.1"))
    monkeypatch.setitem(sys.modules, vllm_plugin.SAMPLER_MODULE, sampler)
    monkeypatch.setattr(vllm_plugin, "_state", {"path": None, "patched": ()})
    vllm_plugin.register()
    assert sampler.apply_top_k_top_p is shipped
    assert vllm_plugin.pin_flags()["plugin"] is None
    assert vllm_plugin.expected_flags("0.27.1")["plugin"] is None


def test_self_check_sizes_straddle_every_threshold() -> None:
    assert self_check_sizes(64, (8, 44)) == [1, 6, 7, 8, 9, 43, 44, 45, 64]
    assert self_check_sizes(32, ()) == [1, 6, 32]
    assert self_check_sizes(4, (8,)) == [1, 4]

# The GPU integration tests are in tests/engine/test_vllm_gpu.py.


def test_worker_engine_args_may_only_change_memory() -> None:
    """LEDGER_VLLM_ENGINE_ARGS: memory settings pass, anything else that the fingerprint
    does not record is refused by name."""
    assert memory_engine_args({"gpu_memory_utilization": 0.3, "max_model_len": 2048}) == {
        "gpu_memory_utilization": 0.3, "max_model_len": 2048}
    with pytest.raises(ValueError, match=r"not \['enforce_eager', 'max_num_seqs'\]"):
        memory_engine_args({"max_num_seqs": 64, "enforce_eager": True,
                            "gpu_memory_utilization": 0.3})
