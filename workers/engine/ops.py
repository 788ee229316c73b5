"""The one dispatch point for every numerics-sensitive op of the reference model.

The model calls only these functions; the **batch-invariant mode** decides what runs:

=================  ===========================  ==================================
mode / device      CPU (and CUDA w/o Triton)    CUDA with ``cuda_kernels``
=================  ===========================  ==================================
batch-invariant    ``torch_kernels.bi_*``       ``workers.engine.cuda_kernels.bi_*``
off                ordinary torch: ``F.linear``, ``log_softmax``; on CPU
                   ``torch_kernels.fast_*``; on CUDA ``F.rms_norm`` and SDPA
                   (``torch_kernels.fast_*_cuda``: no host sync in decode)
=================  ===========================  ==================================

``silu_mul`` is elementwise: on CUDA both modes compute ``F.silu(gate) * up``'s bits.

The mode is scoped (like Thinking Machines' ``set_batch_invariant_mode``, but with
``try/finally``) and held in a ``ContextVar``, so it cannot leak past the ``with`` block,
into another thread, or out of a failing call. Nothing is patched globally: ``aten`` ops
called by other code keep their ordinary kernels. On entry it also turns TF32 and
reduced-precision reductions off for CUDA matmuls, and restores them on exit.
"""

from __future__ import annotations

import contextvars
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from workers.engine import torch_kernels

_BATCH_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ledger_batch_invariant", default=False
)
_cuda_kernels: ModuleType | None = None
_cuda_kernels_error: str | None = None
_cuda_kernels_tried = False


@contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the enclosed ops batch invariant (``enabled``) or on the ordinary fast path."""
    token = _BATCH_INVARIANT.set(enabled)
    saved = _cuda_matmul_flags()
    try:
        if enabled:
            _set_cuda_matmul_flags(dict.fromkeys(saved, False))
        yield
    finally:
        _set_cuda_matmul_flags(saved)
        _BATCH_INVARIANT.reset(token)


def is_batch_invariant() -> bool:
    return _BATCH_INVARIANT.get()


def _cuda_matmul_flags() -> dict[str, bool]:
    m = torch.backends.cuda.matmul
    return {
        "matmul.allow_tf32": bool(m.allow_tf32),
        "matmul.allow_bf16_reduced_precision_reduction": bool(
            m.allow_bf16_reduced_precision_reduction
        ),
        "matmul.allow_fp16_reduced_precision_reduction": bool(
            m.allow_fp16_reduced_precision_reduction
        ),
        "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


def _set_cuda_matmul_flags(flags: dict[str, bool]) -> None:
    m = torch.backends.cuda.matmul
    m.allow_tf32 = flags["matmul.allow_tf32"]
    m.allow_bf16_reduced_precision_reduction = flags[
        "matmul.allow_bf16_reduced_precision_reduction"
    ]
    m.allow_fp16_reduced_precision_reduction = flags[
        "matmul.allow_fp16_reduced_precision_reduction"
    ]
    torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]


def cuda_kernels() -> ModuleType | None:
    """``workers.engine.cuda_kernels`` if it imports (Triton, a GPU), else ``None``."""
    global _cuda_kernels, _cuda_kernels_error, _cuda_kernels_tried
    if not _cuda_kernels_tried:
        _cuda_kernels_tried = True
        try:
            _cuda_kernels = importlib.import_module("workers.engine.cuda_kernels")
        except Exception as exc:  # noqa: BLE001 - ImportError, or Triton failing to initialise
            _cuda_kernels_error = f"{type(exc).__name__}: {exc}"
    return _cuda_kernels


def backend_name(device: str | torch.device, batch_invariant: bool) -> str:
    """The kernel family ``device`` runs in this mode (the fingerprint's attention_backend)."""
    if not batch_invariant:
        return "torch-sdpa"
    if torch.device(device).type == "cuda" and cuda_kernels() is not None:
        return "triton-bi"
    return "torch-bi"


def _bi_cuda(x: Tensor) -> Any:
    """``cuda_kernels`` if the invariant mode is on and ``x`` lives where it runs, else None
    (the ops the CPU kernels have no single-launch form of)."""
    return cuda_kernels() if _BATCH_INVARIANT.get() and x.is_cuda else None


def _bi(x: Tensor) -> Any:
    """The batch-invariant kernel module for ``x``'s device."""
    if x.is_cuda:
        module = cuda_kernels()
        if module is not None:
            return module
    return torch_kernels


# --------------------------------------------------------------------------- the ops
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K], weight [N, K], bias [N] | None -> [M, N]"""
    if _BATCH_INVARIANT.get():
        return _bi(x).bi_linear(x, weight, bias)  # type: ignore[no-any-return]
    return torch.nn.functional.linear(x, weight, bias)


def logits(x: Tensor, weight: Tensor) -> Tensor:
    """``linear(x, weight).float()``: the LM head, fp32 [M, V]. On CUDA in batch-invariant
    mode the product is stored widened in the same launch (``cuda_kernels.bi_linear_fp32``;
    the same bits, one 33 MB pass fewer per decode step at 64 x 128256)."""
    if (module := _bi_cuda(x)) is not None:
        return module.bi_linear_fp32(x, weight)  # type: ignore[no-any-return]
    return linear(x, weight).float()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [M, D], weight [D] -> [M, D]; computed in fp32, returned in x's dtype."""
    if _BATCH_INVARIANT.get():
        return _bi(x).bi_rms_norm(x, weight, eps)  # type: ignore[no-any-return]
    if x.is_cuda:
        return torch_kernels.fast_rms_norm_cuda(x, weight, eps)
    return torch_kernels.fast_rms_norm(x, weight, eps)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(x + residual, rms_norm(x + residual, weight, eps))``: a residual add and the norm
    after it. The sum is rounded to x's dtype first, as ``x + residual`` is; on CUDA in
    batch-invariant mode one launch (``cuda_kernels.bi_add_rms_norm``) gives those bits."""
    if (module := _bi_cuda(x)) is not None:
        return module.bi_add_rms_norm(x, residual, weight, eps)  # type: ignore[no-any-return]
    total = x + residual
    return total, rms_norm(total, weight, eps)


def log_softmax(x: Tensor) -> Tensor:
    """x [M, V] -> fp32 [M, V]"""
    if _BATCH_INVARIANT.get():
        return _bi(x).bi_log_softmax(x)  # type: ignore[no-any-return]
    return torch_kernels.fast_log_softmax(x)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, [M, I].

    Elementwise, so batch invariant wherever every element runs the same code. On CUDA that
    holds for torch's fused ``F.silu`` (one functor per element, vectorised or not); the
    invariant mode runs the same bits in one Triton launch (``cuda_kernels.silu_mul``), the
    default mode torch's two kernels. On CPU the invariant mode needs the exp form (see
    ``torch_kernels``).
    """
    if _BATCH_INVARIANT.get():
        if not gate.is_cuda:
            return torch_kernels.silu_mul(gate, up)
        module = cuda_kernels()
        if module is not None:
            return module.silu_mul(gate, up)  # type: ignore[no-any-return]
    return torch_kernels.fast_silu_mul(gate, up)


def linear_silu_mul(x: Tensor, w_gate_up: Tensor, bias: Tensor | None = None) -> Tensor:
    """``silu_mul(gate, up)`` of ``linear(x, w_gate_up, bias)`` split in halves: the gate/up
    projection and the product after it, [M, I]. On CUDA in batch-invariant mode one launch
    where the product's path allows (``cuda_kernels.linear_silu_mul``): the same bits."""
    if (module := _bi_cuda(x)) is not None:
        return module.linear_silu_mul(x, w_gate_up, bias)  # type: ignore[no-any-return]
    gate, up = linear(x, w_gate_up, bias).chunk(2, dim=-1)
    return silu_mul(gate, up)


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """q [B, Hq, D], caches [B, Hkv, S, D], seq_lens [B] int32 -> [B, Hq, D]"""
    if _BATCH_INVARIANT.get():
        return _bi(q).bi_decode_attention(  # type: ignore[no-any-return]
            q, k_cache, v_cache, seq_lens, scale
        )
    if q.is_cuda:
        return torch_kernels.fast_decode_attention_cuda(q, k_cache, v_cache, seq_lens, scale)
    return torch_kernels.fast_decode_attention(q, k_cache, v_cache, seq_lens, scale)


def prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float
) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1] int32 -> [T, Hq, D] (causal)"""
    if _BATCH_INVARIANT.get():
        return _bi(q).bi_prefill_attention(  # type: ignore[no-any-return]
            q, k, v, cu_seqlens, scale
        )
    if q.is_cuda:
        return torch_kernels.fast_prefill_attention_cuda(q, k, v, cu_seqlens, scale)
    return torch_kernels.fast_prefill_attention(q, k, v, cu_seqlens, scale)


#: Query rows per decode-kernel call in ``chunk_attention`` and ``rows_attention``, times
#: KV heads (not numerics).
_CHUNK_ROWS_PER_CALL = 4096


def chunk_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, chunks: list[tuple[int, int, int, int]],
    scale: float,
) -> Tensor:
    """Causal attention of packed prompt chunks over their slots' KV cache.

    q [T, Hq, D]; caches [slots, Hkv, S, D] already hold every chunk's own k/v; chunks:
    (slot, first row in q, length, first position) on the host. -> [T, Hq, D]

    Batch-invariant mode runs the **decode** attention kernel for every query row (a query
    at position p is a decode row of length p + 1 over its slot, the slot broadcast as a
    stride-0 view): KV in fixed-size blocks (``DECODE_KV_BLOCK`` on CPU, ``KV_SPLIT`` on
    CUDA) combined in a fixed order. A position's output therefore depends only on the
    cache contents up to it: the same whether its prompt was prefilled in one pass, in
    chunks of any size, after a prefix-cache hit, or next to any co-tenant.
    """
    out = torch.empty_like(q)
    invariant = _BATCH_INVARIANT.get()
    for slot, row, n, p0 in chunks:
        end = p0 + n
        qs = q[row:row + n]                                               # [n, Hq, D]
        if invariant:
            # Rows per call: the Triton kernel keeps one counter per (row, KV head) in a
            # 4096-entry buffer that captured decode graphs point at; never make it grow.
            step = max(1, _CHUNK_ROWS_PER_CALL // k_cache.shape[1])
            for a in range(0, n, step):
                m = min(step, n - a)
                stop = p0 + a + m
                kc = k_cache[slot:slot + 1, :, :stop].expand(m, -1, -1, -1)  # [m, Hkv, S', D]
                vc = v_cache[slot:slot + 1, :, :stop].expand(m, -1, -1, -1)
                lens = torch.arange(p0 + a + 1, stop + 1, device=q.device, dtype=torch.int32)
                out[row + a:row + a + m] = _bi(q).bi_decode_attention(
                    qs[a:a + m], kc, vc, lens, scale)
        else:
            out[row:row + n] = torch_kernels.fast_chunk_attention(
                qs, k_cache[slot, :, :end], v_cache[slot, :, :end], p0, scale)
    return out


def rows_attention_applies(x: Tensor) -> bool:
    """Whether ``rows_attention`` runs for tensors like ``x`` (invariant mode, CUDA)."""
    return _bi_cuda(x) is not None


def rows_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """Causal attention of packed prompt rows, batch-invariant, on CUDA: row r over the
    first ``seq_lens[r]`` positions of cache slot ``slots[r]`` (its own k/v already written).

    q [T, Hq, D]; caches [slots, Hkv, S, D]; slots [T] int64; seq_lens [T] int32 (a
    prompt row at position p: p + 1). -> [T, Hq, D]. The decode kernel with a slot per
    row, one launch for up to ``_CHUNK_ROWS_PER_CALL // Hkv`` rows whatever the chunks:
    each row sums the same keys in the same fixed blocks as ``chunk_attention``'s calls
    (only the address it reads them at differs), so a row's bits are those of a decode
    row of its length. Without a host sync: a CUDA graph can capture it.
    """
    ck = _bi_cuda(q)
    assert ck is not None, "rows_attention: batch-invariant mode on CUDA only"
    step = max(1, _CHUNK_ROWS_PER_CALL // k_cache.shape[1])   # the counters' 4096 entries
    n = q.shape[0]
    if n <= step:
        return ck.bi_decode_attention(  # type: ignore[no-any-return]
            q, k_cache, v_cache, seq_lens, scale, slots=slots)
    out = torch.empty_like(q)
    for a in range(0, n, step):
        out[a:a + step] = ck.bi_decode_attention(
            q[a:a + step], k_cache, v_cache, seq_lens[a:a + step], scale,
            slots=slots[a:a + step])
    return out
