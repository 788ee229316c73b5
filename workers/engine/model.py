"""Llama-family decoder for replay: weights, RoPE, preallocated KV cache, prefill, decode.

References: gpt-fast ``model.py``/``generate.py`` (structure: dataclass config, KV cache
buffers updated in place, free functions ``prefill`` and ``decode_one_token``) and
Hugging Face ``transformers`` ``modeling_llama.py`` / ``modeling_qwen3.py`` (the
numerics it reproduces: rotate-half RoPE, RMSNorm in fp32 then cast, SwiGLU, GQA).

Every numerics-sensitive op goes through :mod:`workers.engine.ops`; this file holds no
reduction of its own. Tokens of all sequences in a batch are packed along one axis
(``T`` in the shape comments), as in vLLM, so no padding enters the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from workers.engine import ops
from workers.engine.config import ModelConfig, rope_scaling_type

#: RoPE tables are built in blocks of this many positions, each block on its own, so a
#: position's cos/sin bits never depend on how long the table is.
ROPE_BLOCK = 4096


@dataclass
class LayerWeights:
    attn_norm: Tensor                 # [hidden]
    wqkv: Tensor                      # [(Hq + 2 Hkv) * D, hidden]: q, k, v rows stacked
    bqkv: Tensor | None               # [(Hq + 2 Hkv) * D]
    wo: Tensor                        # [hidden, Hq * D]
    bo: Tensor | None                 # [hidden]
    q_norm: Tensor | None             # [D] (Qwen3)
    k_norm: Tensor | None             # [D] (Qwen3)
    ffn_norm: Tensor                  # [hidden]
    w_gate_up: Tensor                 # [2 * intermediate, hidden]: gate rows, then up rows
    w_down: Tensor                    # [hidden, intermediate]


@dataclass
class Transformer:
    config: ModelConfig
    embed: Tensor                     # [V, hidden]
    layers: list[LayerWeights]
    norm: Tensor                      # [hidden]
    lm_head: Tensor                   # [V, hidden] (the embedding itself when tied)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def __post_init__(self) -> None:
        self._rope_cos = torch.empty(0, self.config.head_dim // 2, device=self.device)
        self._rope_sin = torch.empty_like(self._rope_cos)

    def ensure_rope(self, length: int) -> None:
        """Grow the RoPE tables to cover positions 0..length-1 (whole blocks at a time)."""
        while self._rope_cos.shape[0] < length:
            start = self._rope_cos.shape[0]
            cos, sin = rope_table(self.config, start, ROPE_BLOCK, self.device)
            self._rope_cos = torch.cat([self._rope_cos, cos])
            self._rope_sin = torch.cat([self._rope_sin, sin])

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin fp32 [T, D/2] for int64 positions [T]."""
        self.ensure_rope(int(positions.max().item()) + 1 if positions.numel() else 0)
        return self.rope_at(positions)

    def rope_at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Like :meth:`rope`, without growing the tables (no host sync: CUDA-graph safe).
        The caller has called :meth:`ensure_rope` for every position it passes."""
        return self._rope_cos[positions], self._rope_sin[positions]


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies (float64) [D/2], with llama3 or linear scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = rope_scaling_type(scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_table(
    config: ModelConfig, start: int, length: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos, sin fp32 [length, D/2] for positions start..start+length-1 (float64 math)."""
    inv_freq = rope_inv_freq(config)                                      # [D/2]
    pos = torch.arange(start, start + length, dtype=torch.float64)
    angles = pos[:, None] * inv_freq[None, :]                             # [length, D/2]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (transformers' layout) in fp32. x [T, H, D], cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]                             # [T, H, D/2]
    c, s = cos[:, None, :], sin[:, None, :]                               # [T, 1, D/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class KVCache:
    """Per layer k and v buffers [slots, Hkv, max_seq, D] (gpt-fast), written in place.

    All of them are views of one buffer ``kv`` [2, layers, slots, Hkv, max_seq, D] (k, v),
    so a copy across every layer (a slot move, a prefix-cache page) is one launch."""

    def __init__(
        self, config: ModelConfig, slots: int, max_seq: int, *, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._set(torch.zeros((2, config.num_hidden_layers, slots, config.num_key_value_heads,
                               max_seq, config.head_dim), dtype=dtype, device=device))

    def _set(self, kv: Tensor) -> None:
        self.kv = kv
        self.k, self.v = list(kv[0].unbind(0)), list(kv[1].unbind(0))
        self.slots, self.max_seq = kv.shape[2], kv.shape[4]

    def write(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [T, Hkv, D] at (slot, position) pairs [T]."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def grow(self, slots: int, max_seq: int) -> KVCache:
        """A larger cache holding this one's contents (slots and positions keep their
        place). The old buffers are released once the caller drops this object."""
        shape = list(self.kv.shape)
        shape[2], shape[4] = max(slots, self.slots), max(max_seq, self.max_seq)
        kv = self.kv.new_zeros(shape)
        kv[:, :, :self.slots, :, :self.max_seq] = self.kv
        bigger = KVCache.__new__(KVCache)
        bigger._set(kv)
        return bigger

    def move_slot(self, src: int, dst: int) -> None:
        self.kv[:, :, dst].copy_(self.kv[:, :, src])


def _attention_inputs(
    model: Transformer, layer: LayerWeights, h: Tensor, rope: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] from normed hidden states h [T, hidden]."""
    cfg = model.config
    t, d = h.shape[0], cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    qkv = ops.linear(h, layer.wqkv, layer.bqkv)                           # [T, (Hq+2Hkv)*D]
    q, k, v = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
    q = q.reshape(t, hq, d)                                               # [T, Hq, D]
    k = k.reshape(t, hkv, d)                                              # [T, Hkv, D]
    v = v.reshape(t, hkv, d).contiguous()                                 # [T, Hkv, D]
    if layer.q_norm is not None and layer.k_norm is not None:
        q = ops.rms_norm(q.reshape(t * hq, d), layer.q_norm, cfg.rms_norm_eps).view(t, hq, d)
        k = ops.rms_norm(k.reshape(t * hkv, d), layer.k_norm, cfg.rms_norm_eps).view(t, hkv, d)
    cos, sin = rope
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


#: On CUDA, do RoPE and the KV-cache write in one Triton launch (``cuda_kernels.
#: rope_qkv_to_cache``) instead of ~20 small torch kernels per layer. Same bits (the kernel
#: performs the torch formula's operations); a switch so tests can compare the two.
FUSE_ROPE_ON_CUDA = True


def _fused_rope_kernels(h: Tensor, layer: LayerWeights) -> Any:
    """``cuda_kernels`` where the fused RoPE + KV write applies (CUDA, no q/k norm)."""
    if FUSE_ROPE_ON_CUDA and h.is_cuda and layer.q_norm is None:
        return ops.cuda_kernels()
    return None


def _attention_qkv(
    model: Transformer, layer: LayerWeights, index: int, h: Tensor,
    rope: tuple[Tensor, Tensor], cache: KVCache, slots: Tensor, positions: Tensor, *,
    need_kv: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """q [T, Hq, D] (RoPE applied) from normed hidden states h [T, hidden]; writes this
    layer's k and v at (slot, position) into the cache. Also returns k, v [T, Hkv, D] if
    ``need_kv`` (prefill attends to them directly)."""
    ck = _fused_rope_kernels(h, layer)
    if ck is None:
        q, k, v = _attention_inputs(model, layer, h, rope)
        cache.write(index, slots, positions, k, v)
        return q, k, v
    cfg = model.config
    t, d = h.shape[0], cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    cos, sin = rope
    if not need_kv and ops.is_batch_invariant():     # the product and RoPE in one launch
        q_rot = ck.linear_rope_kv(h, layer.wqkv, layer.bqkv, cos, sin, cache.k[index],
                                  cache.v[index], slots, positions, hq, hkv)
        return q_rot, None, None
    qkv = ops.linear(h, layer.wqkv, layer.bqkv)                           # [T, (Hq+2Hkv)*D]
    q_rot, k_rot = ck.rope_qkv_to_cache(qkv, cos, sin, cache.k[index], cache.v[index],
                                        slots, positions, hq, hkv, return_k=need_kv)
    v_view = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d) if need_kv else None  # [T, Hkv, D]
    return q_rot, k_rot, v_view


def _mlp(layer: LayerWeights, h: Tensor) -> Tensor:
    return ops.linear(ops.linear_silu_mul(h, layer.w_gate_up), layer.w_down)  # [T, hidden]


def _first_norm(model: Transformer, x: Tensor) -> Tensor:
    """The first layer's attention norm (the final norm if there is no layer)."""
    weight = model.layers[0].attn_norm if model.layers else model.norm
    return ops.rms_norm(x, weight, model.config.rms_norm_eps)


def _next_norm(model: Transformer, i: int) -> Tensor:
    """The norm after layer i's MLP: layer i+1's attention norm, or the final norm."""
    return model.layers[i + 1].attn_norm if i + 1 < len(model.layers) else model.norm


def prefill(
    model: Transformer, cache: KVCache, tokens: Tensor, positions: Tensor, slots: Tensor,
    cu_seqlens: Tensor, chunks: list[tuple[int, int, int, int]] | None = None,
) -> Tensor:
    """Run packed prompt *chunks*, fill their cache slots; logits of each chunk's last token.

    tokens, positions, slots [T] int64; cu_seqlens [C+1] int32 delimits the chunks. A chunk
    is consecutive positions of one sequence (one slot); it may start past position 0 (the
    rest of a chunked prompt, or the suffix after a prefix-cache hit), in which case the
    earlier positions are already in the cache. Returns fp32 [C, V]. ``chunks``: the
    caller's ``chunk_table`` of these inputs, from host values it has (then nothing here
    waits for the device: on CUDA the launches queue behind a step still running).

    In batch-invariant mode every query attends over the slot's cache (its own k/v written
    first) with the decode attention kernel, KV in fixed blocks in a fixed order: a
    position's result depends only on the cache contents up to it, never on where the
    chunk boundaries fell or what else was packed (see ``ops.chunk_attention``).
    """
    cfg = model.config
    scale = cfg.head_dim ** -0.5
    if chunks is None:
        chunks = chunk_table(cu_seqlens, slots, positions)
    model.ensure_rope(max((p0 + n for _, _, n, p0 in chunks), default=0))
    last = cu_seqlens[1:].to(torch.int64) - 1                             # [C]
    if ops.rows_attention_applies(model.embed):
        return prefill_rows(model, cache, tokens, positions, slots,
                            (positions + 1).to(torch.int32), last)
    whole = all(p0 == 0 for _, _, _, p0 in chunks)      # default mode may use flash SDPA
    fast_whole = whole and not ops.is_batch_invariant()
    x = model.embed[tokens]                                               # [T, hidden]
    rope = model.rope_at(positions)
    eps = cfg.rms_norm_eps
    h = _first_norm(model, x)
    for i, layer in enumerate(model.layers):
        q, k, v = _attention_qkv(model, layer, i, h, rope, cache, slots, positions,
                                 need_kv=fast_whole)
        if fast_whole:
            assert k is not None and v is not None
            attn = ops.prefill_attention(q, k, v, cu_seqlens, scale)      # [T, Hq, D]
        else:
            attn = ops.chunk_attention(q, cache.k[i], cache.v[i], chunks, scale)
        # residual adds fused with the norm that follows each (the same bits as apart)
        x, h = ops.add_rms_norm(x, ops.linear(attn.reshape(x.shape[0], -1), layer.wo,
                                              layer.bo), layer.ffn_norm, eps)
        x, h = ops.add_rms_norm(x, _mlp(layer, h), _next_norm(model, i), eps)
    return ops.logits(h[last], model.lm_head)                             # h: final norm


def prefill_rows(
    model: Transformer, cache: KVCache, tokens: Tensor, positions: Tensor, slots: Tensor,
    seq_lens: Tensor, last: Tensor,
) -> Tensor:
    """``prefill`` in batch-invariant mode on CUDA: packed prompt rows, each token at
    (slot, position) attending over its slot's cache up to ``seq_lens`` (position + 1)
    with one decode-kernel launch per layer (``ops.rows_attention``). fp32 logits of the
    rows ``last`` [C] int64. No host sync (``StaticDecoder`` captures it as a CUDA graph);
    the caller has sized the RoPE tables past every position."""
    cfg = model.config
    scale = cfg.head_dim ** -0.5
    eps = cfg.rms_norm_eps
    x = model.embed[tokens]                                               # [T, hidden]
    rope = model.rope_at(positions)
    h = _first_norm(model, x)
    for i, layer in enumerate(model.layers):
        q, _, _ = _attention_qkv(model, layer, i, h, rope, cache, slots, positions,
                                 need_kv=False)
        attn = ops.rows_attention(q, cache.k[i], cache.v[i], slots, seq_lens, scale)
        x, h = ops.add_rms_norm(x, ops.linear(attn.reshape(x.shape[0], -1), layer.wo,
                                              layer.bo), layer.ffn_norm, eps)
        x, h = ops.add_rms_norm(x, _mlp(layer, h), _next_norm(model, i), eps)
    return ops.logits(h[last], model.lm_head)                             # h: final norm


def chunk_table(
    cu_seqlens: Tensor, slots: Tensor, positions: Tensor
) -> list[tuple[int, int, int, int]]:
    """(slot, first packed row, length, first position) of each chunk, on the host."""
    bounds = [int(c) for c in cu_seqlens.tolist()]
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    if len(bounds) > 1 and bounds[-1] > 0:
        index = starts.clamp(max=bounds[-1] - 1).to(slots.device)
        first_slots = slots[index].tolist()
        first_positions = positions[index].tolist()
    else:
        first_slots = first_positions = [0] * (len(bounds) - 1)
    return [(int(s), a, b - a, int(p))
            for s, p, a, b in zip(first_slots, first_positions, bounds[:-1], bounds[1:],
                                  strict=True) if b > a]


def decode_one_token(
    model: Transformer, cache: KVCache, tokens: Tensor, positions: Tensor, *,
    static: bool = False,
) -> Tensor:
    """One step for the sequences in cache slots 0..B-1.

    tokens, positions [B] int64 (slot b holds sequence b). Returns fp32 logits [B, V].
    ``static``: no host sync anywhere (CUDA-graph capturable); the caller has sized the
    RoPE tables (``model.ensure_rope(cache.max_seq)``).
    """
    cfg = model.config
    scale = cfg.head_dim ** -0.5
    b = tokens.shape[0]
    slots = torch.arange(b, device=tokens.device)
    seq_lens = (positions + 1).to(torch.int32)                            # [B]
    x = model.embed[tokens]                                               # [B, hidden]
    rope = model.rope_at(positions) if static else model.rope(positions)
    eps = cfg.rms_norm_eps
    h = _first_norm(model, x)
    for i, layer in enumerate(model.layers):
        q, _, _ = _attention_qkv(model, layer, i, h, rope, cache, slots, positions,
                                 need_kv=False)
        attn = ops.decode_attention(q, cache.k[i][:b], cache.v[i][:b], seq_lens, scale)
        x, h = ops.add_rms_norm(x, ops.linear(attn.reshape(b, -1), layer.wo, layer.bo),
                                layer.ffn_norm, eps)                      # [B, hidden]
        x, h = ops.add_rms_norm(x, _mlp(layer, h), _next_norm(model, i), eps)
    return ops.logits(h, model.lm_head)                                   # h: final norm
