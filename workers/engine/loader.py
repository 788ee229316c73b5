"""Build a :class:`Transformer` from Hugging Face safetensors, or with random weights.

Tensor names are the Hugging Face ones (``model.layers.N.self_attn.q_proj.weight`` ...).
q/k/v and gate/up are fused at load time, one layer at a time, so loading never holds a
second copy of the model. Random weights are drawn directly on the target device in the
target dtype (Llama-3-8B shapes in bf16 need 16 GB and no fp32 staging).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from workers.engine.config import ModelConfig
from workers.engine.model import LayerWeights, Transformer


class MissingTensorError(ValueError):
    """The checkpoint lacks a tensor the config says the model has."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: from ``model.safetensors.index.json``, else ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def load_transformer(
    model_dir: str | Path, *, device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32, config: ModelConfig | None = None,
) -> Transformer:
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    handles: list[Any] = [
        safe_open(str(path), framework="pt", device=str(device))
        for path in safetensors_files(model_dir)
    ]
    where: dict[str, Any] = {name: h for h in handles for name in h.keys()}  # noqa: SIM118

    def get(name: str) -> Tensor:
        if name not in where:
            raise MissingTensorError(f"{model_dir}: tensor {name!r} not found")
        tensor: Tensor = where[name].get_tensor(name)
        return tensor.to(dtype)

    def get_optional(name: str) -> Tensor | None:
        return get(name) if name in where else None

    return _build(config, get, get_optional)


def _build(
    config: ModelConfig, get: Callable[[str], Tensor],
    get_optional: Callable[[str], Tensor | None],
) -> Transformer:
    if config.mlp_bias:
        raise ValueError("mlp_bias=True checkpoints are not supported")
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        wqkv = torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"])
        bqkv = (torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"])
                if config.qkv_bias else None)
        layers.append(LayerWeights(
            attn_norm=get(p + "input_layernorm.weight"),
            wqkv=wqkv,
            bqkv=bqkv,
            wo=get(attn + "o_proj.weight"),
            bo=get(attn + "o_proj.bias") if config.o_bias else None,
            q_norm=get(attn + "q_norm.weight") if config.qk_norm else None,
            k_norm=get(attn + "k_norm.weight") if config.qk_norm else None,
            ffn_norm=get(p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            w_down=get(p + "mlp.down_proj.weight"),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = None if config.tie_word_embeddings else get_optional("lm_head.weight")
    model = Transformer(
        config=config, embed=embed, layers=layers, norm=get("model.norm.weight"),
        lm_head=embed if lm_head is None else lm_head,
    )
    _check_shapes(model)
    return model


def _check_shapes(model: Transformer) -> None:
    c = model.config
    d, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    expect = {
        "embed": (model.embed, (c.vocab_size, c.hidden_size)),
        "lm_head": (model.lm_head, (c.vocab_size, c.hidden_size)),
        "wqkv": (model.layers[0].wqkv, ((hq + 2 * hkv) * d, c.hidden_size)),
        "wo": (model.layers[0].wo, (c.hidden_size, hq * d)),
        "w_gate_up": (model.layers[0].w_gate_up, (2 * c.intermediate_size, c.hidden_size)),
        "w_down": (model.layers[0].w_down, (c.hidden_size, c.intermediate_size)),
    }
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, config says {shape}")


def random_transformer(
    config: ModelConfig, *, device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> Transformer:
    """Random weights of ``config``'s shapes, drawn on ``device`` in ``dtype``.

    Scales keep activations and logits in a realistic range at any depth: linear weights
    ~ N(0, 1/fan_in), output projections scaled down by sqrt(2 * layers), norms ~ 1,
    embeddings and LM head ~ N(0, 4/hidden) (logits of std ~2, not dominated by the
    input token when tied).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    c = config
    d, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    residual = (2 * c.num_hidden_layers) ** -0.5

    def normal(*shape: int, std: float, mean: float = 0.0) -> Tensor:
        t = torch.empty(shape, device=device, dtype=dtype)
        return t.normal_(mean, std, generator=gen)

    def linear(out: int, fan_in: int, scale: float = 1.0) -> Tensor:
        return normal(out, fan_in, std=scale * fan_in ** -0.5)

    def norm(n: int) -> Tensor:
        return normal(n, std=0.1, mean=1.0)

    layers = [
        LayerWeights(
            attn_norm=norm(c.hidden_size),
            wqkv=linear((hq + 2 * hkv) * d, c.hidden_size),
            bqkv=normal((hq + 2 * hkv) * d, std=0.1) if c.qkv_bias else None,
            wo=linear(c.hidden_size, hq * d, residual),
            bo=normal(c.hidden_size, std=0.02) if c.o_bias else None,
            q_norm=norm(d) if c.qk_norm else None,
            k_norm=norm(d) if c.qk_norm else None,
            ffn_norm=norm(c.hidden_size),
            w_gate_up=linear(2 * c.intermediate_size, c.hidden_size),
            w_down=linear(c.hidden_size, c.intermediate_size, residual),
        )
        for _ in range(c.num_hidden_layers)
    ]
    embed = normal(c.vocab_size, c.hidden_size, std=2.0 * c.hidden_size ** -0.5)
    lm_head = embed if c.tie_word_embeddings else linear(c.vocab_size, c.hidden_size, 2.0)
    return Transformer(config=c, embed=embed, layers=layers, norm=norm(c.hidden_size),
                       lm_head=lm_head)


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under Hugging Face names (for writing test checkpoints)."""
    c = model.config
    d, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    out = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = torch.split(layer.wqkv, [hq * d, hkv * d, hkv * d])
        out |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.wo,
                p + "input_layernorm.weight": layer.attn_norm,
                p + "post_attention_layernorm.weight": layer.ffn_norm,
                p + "mlp.down_proj.weight": layer.w_down}
        gate, up = layer.w_gate_up.chunk(2)
        out |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
        if layer.bqkv is not None:
            bq, bk, bv = torch.split(layer.bqkv, [hq * d, hkv * d, hkv * d])
            out |= {p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk,
                    p + "self_attn.v_proj.bias": bv}
        if layer.bo is not None:
            out[p + "self_attn.o_proj.bias"] = layer.bo
        if layer.q_norm is not None and layer.k_norm is not None:
            out[p + "self_attn.q_norm.weight"] = layer.q_norm
            out[p + "self_attn.k_norm.weight"] = layer.k_norm
    return {name: t.contiguous() for name, t in out.items()}
