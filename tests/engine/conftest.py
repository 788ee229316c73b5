"""Fixtures for the engine tests: tiny random Hugging Face checkpoints of each family.

Checkpoints are written here tensor by tensor under the Hugging Face names, without the
engine's loader or ``hf_state_dict``, so the loader is tested against the real layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

_BASE: dict[str, Any] = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "hidden_act": "silu",
}

#: One small config per family, each exercising that family's particular feature.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama2": {**_BASE, "model_type": "llama", "num_key_value_heads": 4,
               "rope_theta": 10000.0},
    "llama3": {**_BASE, "model_type": "llama", "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64},
               "eos_token_id": [2, 3]},
    "mistral": {**_BASE, "model_type": "mistral", "num_key_value_heads": 1, "head_dim": 32,
                "rope_theta": 1000000.0, "sliding_window": None},
    "qwen2": {**_BASE, "model_type": "qwen2", "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "use_sliding_window": False,
              "sliding_window": 4096},
    "qwen3": {**_BASE, "model_type": "qwen3", "head_dim": 32, "rope_theta": 1000000.0,
              "attention_bias": False, "tie_word_embeddings": False},
}


def hf_tensors(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Random weights under Hugging Face names for ``config``."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or hidden // hq
    qwen2, qwen3 = config["model_type"] == "qwen2", config["model_type"] == "qwen3"

    def w(*shape: int, std: float, mean: float = 0.0) -> Any:
        return torch.randn(shape, generator=g) * std + mean

    t = {"model.embed_tokens.weight": w(config["vocab_size"], hidden, std=2 * hidden ** -0.5),
         "model.norm.weight": w(hidden, std=0.1, mean=1.0)}
    if not config.get("tie_word_embeddings", False):
        t["lm_head.weight"] = w(config["vocab_size"], hidden, std=2 * hidden ** -0.5)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(hq * d, hidden, std=hidden ** -0.5)
        t[p + "self_attn.k_proj.weight"] = w(hkv * d, hidden, std=hidden ** -0.5)
        t[p + "self_attn.v_proj.weight"] = w(hkv * d, hidden, std=hidden ** -0.5)
        t[p + "self_attn.o_proj.weight"] = w(hidden, hq * d, std=0.5 * (hq * d) ** -0.5)
        if qwen2:
            t[p + "self_attn.q_proj.bias"] = w(hq * d, std=0.1)
            t[p + "self_attn.k_proj.bias"] = w(hkv * d, std=0.1)
            t[p + "self_attn.v_proj.bias"] = w(hkv * d, std=0.1)
        if qwen3:
            t[p + "self_attn.q_norm.weight"] = w(d, std=0.1, mean=1.0)
            t[p + "self_attn.k_norm.weight"] = w(d, std=0.1, mean=1.0)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden, std=hidden ** -0.5)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden, std=hidden ** -0.5)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter, std=0.5 * inter ** -0.5)
        t[p + "input_layernorm.weight"] = w(hidden, std=0.1, mean=1.0)
        t[p + "post_attention_layernorm.weight"] = w(hidden, std=0.1, mean=1.0)
    return t


def write_hf_model(directory: Path, family: str, *, seed: int = 0, sharded: bool = False,
                   **overrides: Any) -> Path:
    config = {**FAMILIES[family], **overrides}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in hf_tensors(config, seed).items()}
    if not sharded:
        safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        safetensors_torch.save_file({n: tensors[n] for n in shard_names}, str(directory / shard))
        weight_map |= dict.fromkeys(shard_names, shard)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return directory


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(family, **config overrides) -> a checkpoint directory (cached per arguments)."""
    cache: dict[str, Path] = {}

    def make(family: str, **kwargs: Any) -> Path:
        key = json.dumps([family, kwargs], sort_keys=True)
        if key not in cache:
            cache[key] = write_hf_model(tmp_path_factory.mktemp(family), family, **kwargs)
        return cache[key]

    return make


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Engine tests run single-threaded: fast on a shared 2-core box, and deterministic.
    (Thread count is part of the fingerprint; tests that need 2 threads set it.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
