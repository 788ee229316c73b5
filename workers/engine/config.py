"""Model configuration for the reference engine, read from a Hugging Face ``config.json``.

One dataclass covers the Llama family as Hugging Face ``transformers`` defines it:
Llama 2/3 (``LlamaConfig``, incl. ``rope_scaling.rope_type == "llama3"``), Mistral
(``MistralConfig``), Qwen2 (``Qwen2Config``: bias on q/k/v, none on o) and Qwen3
(``Qwen3Config``: RMSNorm on q and k per head). Kept free of torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

#: Meta-Llama-3.1-8B's config.json shapes (for ``ReferenceEngine.random`` benchmarks).
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096                 # d_model
    intermediate_size: int = 11008          # SwiGLU hidden width
    num_hidden_layers: int = 32
    num_attention_heads: int = 32           # query heads
    num_key_value_heads: int = 32           # < num_attention_heads: grouped-query attention
    head_dim: int = 0                       # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None   # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False       # lm_head shares model.embed_tokens.weight
    qkv_bias: bool = False                  # Qwen2; Llama's attention_bias also sets o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                   # Qwen3: RMSNorm over head_dim on q and k
    sliding_window: int | None = None       # only checked: longer sequences are refused
    model_type: str = "llama"
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    torch_dtype: str | None = None          # the checkpoint's dtype, informational
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            assert self.hidden_size % self.num_attention_heads == 0, (
                "hidden_size must divide by num_attention_heads when head_dim is not given"
            )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        assert self.num_attention_heads % self.num_key_value_heads == 0, (
            f"{self.num_attention_heads} query heads do not group onto "
            f"{self.num_key_value_heads} key/value heads"
        )
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if self.rope_scaling is not None:
            kind = rope_scaling_type(self.rope_scaling)
            if kind not in ("default", "llama3", "linear"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported")

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Build from the parsed ``config.json`` of a Hugging Face checkpoint."""
        model_type = str(data.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        attention_bias = bool(data.get("attention_bias", False))
        qkv_bias = model_type == "qwen2" or attention_bias
        o_bias = attention_bias and model_type != "qwen2"
        sliding_window = data.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not data.get("use_sliding_window", False):
            sliding_window = None
        eos = data.get("eos_token_id", 2)
        eos_ids = tuple(int(t) for t in eos) if isinstance(eos, list) else (
            () if eos is None else (int(eos),)
        )
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "mlp_bias", "model_type", "bos_token_id", "eos_token_id",
            "torch_dtype", "sliding_window", "use_sliding_window",
        }
        n_heads = int(data["num_attention_heads"])
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=int(data["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or n_heads),
            head_dim=int(data.get("head_dim") or 0),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            rope_scaling=data.get("rope_scaling"),
            max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(data.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=None if sliding_window is None else int(sliding_window),
            model_type=model_type,
            bos_token_id=None if data.get("bos_token_id") is None else int(data["bos_token_id"]),
            eos_token_ids=eos_ids,
            torch_dtype=data.get("torch_dtype"),
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` and merge EOS ids from ``generation_config.json`` if present."""
        model_dir = Path(model_dir)
        config = cls.from_hf(json.loads((model_dir / "config.json").read_text("utf-8")))
        generation = model_dir / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text("utf-8")).get("eos_token_id")
            more = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(t) for t in more)]))
            object.__setattr__(config, "eos_token_ids", merged)
        return config


def rope_scaling_type(rope_scaling: Mapping[str, Any]) -> str:
    """``rope_type`` (current transformers) or ``type`` (older configs)."""
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))
