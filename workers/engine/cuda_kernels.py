# Triton kernels take untyped tensor handles and @triton.jit is untyped:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Batch-invariant CUDA kernels (Triton) for the reference engine.

Batch invariance: every row's output bits depend only on that row's inputs (and the weights),
never on how many other rows share the launch, where the row sits, or how large a cache was
allocated. The engine's dispatch module imports this file lazily (CUDA, batch-invariant mode)
and calls the ``bi_*`` functions below; ``rope_qkv_to_cache`` is elementwise engine glue
(RoPE + KV-cache write in one launch) that the model uses on CUDA in both modes, and
``linear_silu_mul`` / ``linear_rope_kv`` / ``bi_linear_fp32`` are ``bi_linear`` with the op
after it (silu(gate) * up, RoPE + the KV write, the widening to fp32) in the same launch,
bit for bit the two. Nothing else is public API.

How each kernel stays invariant (docs/cuda_kernels.md has the long version and the numbers):

* ``bi_linear``: the reduction over K is fixed by the *weight* shape alone. K is cut into
  segments of ``linear_k_segment(N, K, dtype)`` elements; each segment is one chain of MMA
  steps (16 K-elements at a time, in K order) into a zero fp32 accumulator, and segment
  sums are added left to right in fp32. Two execution paths compute exactly that: *split*
  (one program per (tile, segment), partial sums to a workspace, the last program to finish
  a tile adds them in segment order; an atomic counter only elects that program, it never
  accumulates) for few-row calls, and *fused* (one program loops over all segments; TMA
  loads for the many-rows tile) otherwise. Every path issues the same per-element chain of
  wgmma k16 steps (m64n64 on the split path, m64n128 elsewhere; ieee FMA for fp32), so the
  path and tile chosen by M do not change a bit. Measured, not assumed:
  benchmarks/kernels_cuda.py compares every path and tile bit for bit on the GPU (H200,
  2026-11-29 and 2026-12-03: no mismatch).
* ``bi_rms_norm`` / ``bi_log_softmax``: one program per row, block size fixed by the row
  length, so the reduction tree never sees another row.
* ``bi_decode_attention``: split-KV with a fixed split *size* (``KV_SPLIT`` tokens), the
  number of splits set by the row's own length, combined in split order by the last split
  program of each (row, kv head). The grid covers the allocated cache length; programs past
  a row's length do nothing, so neither B nor S nor other rows' lengths reach the math.
* ``bi_prefill_attention``: flash-attention forward over packed sequences; query and key
  blocks are aligned to each sequence's own start, so a sequence's tiles and loop order are
  the same wherever it sits in the pack.

References: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025), and its
``batch_invariant_ops``; vLLM ``model_executor/layers/batch_invariant.py``; the Triton
tutorials (matmul, fused attention); Flash-Decoding (split-KV).

Changing any constant marked NUMERICS changes output bits: bump ``KERNELS_VERSION`` (the engine
records it in the runtime fingerprint).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = [
    "KERNELS_VERSION",
    "KV_SPLIT",
    "__version__",
    "bi_add_rms_norm",
    "bi_decode_attention",
    "bi_linear",
    "bi_linear_fp32",
    "bi_log_softmax",
    "bi_prefill_attention",
    "bi_rms_norm",
    "linear_k_segment",
    "linear_rope_kv",
    "linear_silu_mul",
    "rope_qkv_to_cache",
    "silu_mul",
]

KERNELS_VERSION = "bi-triton-2"
__version__ = KERNELS_VERSION  # read by workers.engine.runtime into the fingerprint

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    IEEE: fp32 operands, plain fp32 FMA (TF32 off). UPCAST: only under the Triton interpreter,
    whose bf16 dot is broken (it multiplies the raw uint16 storage); bf16 -> fp32 is exact.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


def _interpreting() -> bool:
    return isinstance(_linear_kernel, InterpretedFunction)


def _check_dtype(t: torch.Tensor, name: str) -> None:
    assert t.dtype in _SUPPORTED, f"{name}: unsupported dtype {t.dtype}"


class _Counters:
    """Per-device int32 counters used to elect the last program of a group.

    Every launch that uses them leaves them at zero again (the elected program resets its
    counter), so one zeroed buffer serves all launches on a stream. Allocate before CUDA
    graph capture (any warm-up call does). One stream at a time per device.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < n:
            buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
            self._buffers[device] = buf
        return buf


_COUNTERS = _Counters()


# ----------------------------------------------------------------------------------------
# Linear: y = x @ weight.T + bias
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# NUMERICS: block_k, and that each output element is one chain of wgmma k16 steps (16-bit
# types), fix how an element is summed. block_m, block_n, warps per tile and stages only
# decide which rows and columns run together; they may differ between the tiles because an
# element's bits do not depend on them (every tile here checked against the others on the
# GPU). The segment policy counts the few-row tile's 128-wide tiles: that stays fixed.
_TILE_FEW_16 = _Tile(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
_TILE_MANY_16 = _Tile(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
# The split path's tile (not numerics: the segment policy below counts 128-wide tiles, and a
# 64-wide wgmma gives each element the same bits, checked on the GPU by
# benchmarks/kernels_cuda.py "decode tiles"): twice the programs of 64x128, more bytes in
# flight per SM. H200, M = 64, us: qkv 21.3 -> 18.9, o 15.9 -> 15.1, down 37.8 -> 36.2.
_TILE_SPLIT_16 = _Tile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=6)
# fp32 with TF32 off: one FMA chain per element in K order; a single tile for every M.
_TILE_32 = _Tile(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)

# NUMERICS: the K-segment policy. Segments are doubled until the few-row launch has
# _SPLIT_TARGET_PROGRAMS programs, never below _MIN_K_SEGMENT elements, at most _MAX_SEGMENTS.
# (Measured on the H200, bf16, M = 1 and 64: 4 segments best for 4096x4096, 4-8 for
# 1024x4096, 1 for 14336x4096, 4 for 4096x14336; benchmarks/RESULTS.md.)
_SPLIT_TARGET_PROGRAMS = 96
_MIN_K_SEGMENT = 512
_MAX_SEGMENTS = 16
# Not numerics: rows at or below which the few-row tile is used.
_FEW_ROWS = 64
# Not numerics: rows (above _FEW_ROWS) up to which a weight whose 128-row tiles would leave
# most SMs idle is split into its K segments, with the few-row tile: a prompt forward of a
# prompt or two. H200, bf16, us per layer at 128 rows: qkv 29.7 -> 23.6, o 27.7 -> 19.3,
# down 90.6 -> 42.9 (benchmarks/kernels_cuda.py "prompt tiles", every variant today's bits).
_SPLIT_ROWS = 256


def _tiles(dtype: torch.dtype) -> tuple[_Tile, _Tile]:
    if dtype == torch.float32:
        return _TILE_32, _TILE_32
    return _TILE_FEW_16, _TILE_MANY_16


def _split_tile(dtype: torch.dtype) -> _Tile:
    return _TILE_32 if dtype == torch.float32 else _TILE_SPLIT_16


@functools.cache
def linear_k_segment(n: int, k: int, dtype: torch.dtype) -> int:
    """Length (in K elements) of one reduction segment for an [n, k] weight.

    A function of the weight shape and dtype only, never of the number of rows.
    """
    few, _ = _tiles(dtype)
    n_tiles = triton.cdiv(n, few.block_n)
    segments = 1
    while (
        n_tiles * segments < _SPLIT_TARGET_PROGRAMS
        and k // (2 * segments) >= _MIN_K_SEGMENT
        and segments < _MAX_SEGMENTS
    ):
        segments *= 2
    bk = few.block_k
    return int(triton.cdiv(triton.cdiv(k, segments), bk) * bk)


@triton.jit
def _linear_step(acc, x_rows, w_cols, ki, offs_k, mask_m, mask_n, K, stride_xk, stride_wk,
                 EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """acc + x[rows, block ki] @ weight[cols, block ki]^T."""
    kk = ki * BLOCK_K + offs_k
    if EVEN_K:
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=mask_n[None, :], other=0.0)
    else:
        mask_k = kk < K
        a = tl.load(x_rows + kk[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)          # [BM, BK]
        b = tl.load(w_cols + kk[:, None] * stride_wk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)          # [BK, BN]
    return _mma(a, b, acc, IEEE, UPCAST)


# What a linear launch does with its output tile (a constexpr of ``_linear_kernel``).
_STORE = 0      # y = x @ W^T (+ b)
_SILU_MUL = 1   # W = [gate; up]: y = silu(gate) * up, the gate/up projection's product
_ROPE_KV = 2    # W = [q; k; v] heads: RoPE on q and k, q to y, k and v into the KV cache


@triton.jit
def _tile_columns(pid_n, N, HALF, EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows (output columns) one tile multiplies, and which of them exist.

    _STORE: BLOCK_N consecutive rows. _SILU_MUL (N: the width of gate and of up): BLOCK_N/2
    gate rows and the up rows of the same columns. _ROPE_KV: the two halves that rotate
    together, BLOCK_N/2 columns from each half of one head (HALF: half the head dim).
    Which columns share a tile never changes an element's bits (see _Tile)."""
    j = tl.arange(0, BLOCK_N)
    HB: tl.constexpr = BLOCK_N // 2
    if EPILOGUE == 0:
        rows = pid_n * BLOCK_N + j
        exists = rows < N
    elif EPILOGUE == 1:
        col = pid_n * HB + j % HB
        rows = tl.where(j < HB, col, N + col)
        exists = col < N
    else:
        per_head = HALF // HB
        first = (pid_n // per_head) * (2 * HALF) + (pid_n % per_head) * HB + j % HB
        rows = tl.where(j < HB, first, first + HALF)
        exists = first < N
    return rows, exists


@triton.jit
def _halves(v, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A [BM, BN] tile's first and second BN/2 columns, as two [BM, BN/2] tensors."""
    return tl.split(tl.permute(tl.reshape(v, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1)))


@triton.jit
def _silu_times(g, u, out_ty: tl.constexpr, LIBDEVICE: tl.constexpr):
    """torch's ``F.silu(g) * u`` on rounded g, u: x / (1 + exp(-x)) in fp32 with an IEEE
    division and expf, rounded to g's dtype; then the product in fp32, rounded (launched
    with fp fusion off)."""
    x = g.to(tl.float32)
    if LIBDEVICE:  # noqa: SIM108  (a constexpr branch; the JIT compiles one side)
        e = libdevice.exp(-x)
    else:                                   # the interpreter has no libdevice: numpy's exp
        e = tl.exp(-x)
    silu = tl.math.div_rn(x, 1.0 + e).to(g.dtype)
    return (silu.to(tl.float32) * u.to(tl.float32)).to(out_ty)


@triton.jit
def _store_tile(
    out, offs_m, mask_m, cols, mask_n, pid_n, N, y_ptr, stride_ym, stride_yn,
    cos_ptr, sin_ptr, stride_cs, slots_ptr, pos_ptr, kc_ptr, vc_ptr,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, HALF,
    HQ: tl.constexpr, HKV: tl.constexpr, EPILOGUE: tl.constexpr, LIBDEVICE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, XTY: tl.constexpr,
):
    """Write a finished fp32 tile (bias added): rounded to y's dtype as the linear's output
    is, then, for the fused epilogues, the very operations of ``silu_mul`` or of
    ``_rope_kv_kernel`` on those rounded values, so the same bits as the two launches."""
    ty = y_ptr.dtype.element_ty
    rows = offs_m.to(tl.int64)[:, None]
    if EPILOGUE == 0:  # rounded to x's dtype, then (fp32 logits) widened: exact
        y_ptrs = y_ptr + rows * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, out.to(XTY).to(ty), mask=mask_m[:, None] & mask_n[None, :])
    elif EPILOGUE == 1:
        HB: tl.constexpr = BLOCK_N // 2
        col = pid_n * HB + tl.arange(0, HB)
        g, u = _halves(out.to(ty), BLOCK_M, BLOCK_N)                      # [BM, BN/2] each
        tl.store(y_ptr + rows * stride_ym + col[None, :] * stride_yn,
                 _silu_times(g, u, ty, LIBDEVICE), mask=mask_m[:, None] & (col < N)[None, :])
    else:
        _store_rope_kv(out.to(ty), rows, mask_m, offs_m, pid_n, y_ptr, stride_ym, cos_ptr,
                       sin_ptr, stride_cs, slots_ptr, pos_ptr, kc_ptr, vc_ptr, stride_kcb,
                       stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, HALF, HQ,
                       HKV, BLOCK_M, BLOCK_N)


@triton.jit
def _store_rope_kv(
    v, rows, mask_m, offs_m, pid_n, q_ptr, stride_q, cos_ptr, sin_ptr, stride_cs, slots_ptr,
    pos_ptr, kc_ptr, vc_ptr, stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch,
    stride_vcs, HALF, HQ: tl.constexpr, HKV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``_rope_kv_kernel``'s operations on a rounded qkv tile of rotation pairs."""
    HB: tl.constexpr = BLOCK_N // 2
    i = tl.arange(0, HB)
    a, b = _halves(v, BLOCK_M, BLOCK_N)                                   # [BM, BN/2] each
    per_head = HALF // HB
    h = pid_n // per_head                      # q heads, then k heads, then v heads
    c0 = (pid_n % per_head) * HB
    mask = mask_m[:, None]
    if h < HQ + HKV:
        cs = rows * stride_cs + c0 + i[None, :]
        c = tl.load(cos_ptr + cs, mask=mask, other=0.0)
        s = tl.load(sin_ptr + cs, mask=mask, other=0.0)
        x1 = a.to(tl.float32)
        x2 = b.to(tl.float32)
        o1 = (x1 * c - x2 * s).to(v.dtype)
        o2 = (x2 * c + x1 * s).to(v.dtype)
        if h < HQ:
            dst = q_ptr + rows * stride_q + h * (2 * HALF) + c0 + i[None, :]
        else:
            slot = tl.load(slots_ptr + offs_m, mask=mask_m, other=0)[:, None]
            pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0)[:, None]
            dst = (kc_ptr + slot * stride_kcb + (h - HQ) * stride_kch + pos * stride_kcs
                   + c0 + i[None, :])
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)
    else:
        slot = tl.load(slots_ptr + offs_m, mask=mask_m, other=0)[:, None]
        pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0)[:, None]
        dst = (vc_ptr + slot * stride_vcb + (h - HQ - HKV) * stride_vch + pos * stride_vcs
               + c0 + i[None, :])
        tl.store(dst, a, mask=mask)
        tl.store(dst + HALF, b, mask=mask)


@triton.jit(do_not_specialize=["M", "seg_iters"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    seg_iters,                    # K blocks per segment (NUMERICS)
    # _ROPE_KV only (see _store_tile): cos/sin [M, HALF] fp32, slots/positions [M], caches
    cos_ptr, sin_ptr, stride_cs, slots_ptr, pos_ptr, kc_ptr, vc_ptr,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, HALF,
    SEG_ITERS: tl.constexpr,      # the same, as a constant, on the split path only
    SPLIT: tl.constexpr,          # one program per (tile, segment)
    ONE_SEGMENT: tl.constexpr,    # fused path and K fits in one segment
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE: tl.constexpr = 0,   # _STORE, _SILU_MUL or _ROPE_KV
    HQ: tl.constexpr = 0, HKV: tl.constexpr = 0,
    LIBDEVICE: tl.constexpr = True,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N // 2) if EPILOGUE == 1 else tl.cdiv(N, BLOCK_N)
    # Grouped tile order (L2 reuse); which rows share a tile never changes a row's bits.
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n, mask_n = _tile_columns(pid_n, N, HALF, EPILOGUE, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm            # [BM, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn            # [1, BN]

    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SPLIT:
        # One segment; the host only splits when segments tile K exactly, and a constant
        # trip count keeps the wgmma pipeline asynchronous (ptxas C7515 otherwise).
        k_first = tl.program_id(1) * SEG_ITERS
        for i in range(0, SEG_ITERS):
            acc = _linear_step(acc, x_rows, w_cols, k_first + i, offs_k, mask_m, mask_n, K,
                               stride_xk, stride_wk, True, IEEE, UPCAST, BLOCK_K)
        total = total + acc
    else:
        k_iters = tl.cdiv(K, BLOCK_K)
        for ki in range(0, k_iters):
            acc = _linear_step(acc, x_rows, w_cols, ki, offs_k, mask_m, mask_n, K,
                               stride_xk, stride_wk, EVEN_K, IEEE, UPCAST, BLOCK_K)
            # End of a segment: fold it into the total, start the next chain from zero.
            if not ONE_SEGMENT and (((ki + 1) % seg_iters == 0) | (ki + 1 == k_iters)):
                total = total + acc
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if ONE_SEGMENT:
            total = total + acc

    if SPLIT:
        # Partial sums laid out [segment, tile, BM, BN]; rows past M are never touched.
        n_seg = tl.num_programs(1)
        n_tiles = tl.num_programs(0)
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_elems = BLOCK_M * BLOCK_N
        part_tile = part_ptr + pid.to(tl.int64) * tile_elems + in_tile
        seg_stride = n_tiles.to(tl.int64) * tile_elems
        tl.store(part_tile + tl.program_id(1) * seg_stride, total, mask=mask_m[:, None])
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == n_seg - 1:
            # Last program of this tile: add the segments in segment order.
            out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, n_seg):
                out = out + tl.load(part_tile + s * seg_stride, mask=mask_m[:, None],
                                    other=0.0, cache_modifier=".cg")
            tl.store(cnt_ptr + pid, 0)
            if HAS_BIAS:
                out = out + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            _store_tile(out, offs_m, mask_m, offs_n, mask_n, pid_n, N, y_ptr, stride_ym,
                        stride_yn, cos_ptr, sin_ptr, stride_cs, slots_ptr, pos_ptr, kc_ptr,
                        vc_ptr, stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch,
                        stride_vcs, HALF, HQ, HKV, EPILOGUE, LIBDEVICE, BLOCK_M, BLOCK_N,
                        x_ptr.dtype.element_ty)
    else:
        if HAS_BIAS:
            total = total + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        _store_tile(total, offs_m, mask_m, offs_n, mask_n, pid_n, N, y_ptr, stride_ym,
                    stride_yn, cos_ptr, sin_ptr, stride_cs, slots_ptr, pos_ptr, kc_ptr,
                    vc_ptr, stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch,
                    stride_vcs, HALF, HQ, HKV, EPILOGUE, LIBDEVICE, BLOCK_M, BLOCK_N,
                    x_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["M", "seg_iters"])
def _linear_tma_kernel(
    x_desc, w_desc, b_ptr, y_ptr,
    M, N, K, stride_ym, seg_iters,
    ONE_SEGMENT: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The fused path with tiles fetched by the Hopper tensor-memory accelerator (TMA).

    Same MMA chain and segment sums as ``_linear_kernel``'s fused path, so the same bits;
    only the loads differ (bulk tensor copies, out-of-bounds rows/columns read as zero).
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_iters = tl.cdiv(K, BLOCK_K)
    for ki in range(0, k_iters):
        a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])                      # [BM, BK]
        b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])                      # [BN, BK]
        acc = _mma(a, b.T, acc, False, UPCAST)
        if not ONE_SEGMENT and (((ki + 1) % seg_iters == 0) | (ki + 1 == k_iters)):
            total = total + acc
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ONE_SEGMENT:
        total = total + acc

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_BIAS:
        total = total + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & mask_n[None, :])


def _tma_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Bulk tensor copies need 16-bit types, a contiguous last dim, 16-byte aligned rows."""
    return (
        x.dtype != torch.float32
        and x.stride(1) == 1 and weight.stride(1) == 1
        and (x.stride(0) * x.element_size()) % 16 == 0
        and (weight.stride(0) * weight.element_size()) % 16 == 0
        and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    )


def _can_split(k: int, seg: int) -> bool:
    """Split only where segments tile K exactly: one constant trip count per program."""
    return k % seg == 0 and k // seg > 1


def _linear_path(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[_Tile, bool]:
    """(tile, split) for an [m, k] x [n, k]^T product. May depend on m: bits do not."""
    few, many = _tiles(dtype)
    seg = linear_k_segment(n, k, dtype)
    tile = few if (m <= _FEW_ROWS or few is many) else many
    split = (
        (tile is few or m <= _SPLIT_ROWS)
        and _can_split(k, seg)
        and triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n) < _SPLIT_TARGET_PROGRAMS
        and 4 * m * (k // seg) <= k  # partial sums stay well under the weight's bytes
    )
    if not split:
        return tile, False
    return (_split_tile(dtype) if m <= _FEW_ROWS else few), True


@dataclass(frozen=True)
class _RopeKV:
    """What the _ROPE_KV epilogue needs besides the product (see ``linear_rope_kv``)."""
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    n_q_heads: int
    n_kv_heads: int


def _launch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile: _Tile,
    split: bool,
    k_segment: int | None = None,
    tma: bool | None = None,
    epilogue: int = _STORE,
    rope: _RopeKV | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Run one path. ``k_segment`` overrides the NUMERICS policy (benchmarks only);
    ``tma`` forces the fused path's loads (None: TMA where the tensors allow it).
    ``epilogue`` _SILU_MUL or _ROPE_KV (``rope`` given) fuse the op after the product into
    the store (not on the TMA path); the result is then silu(gate) * up [m, n/2], or q.
    ``out_dtype`` float32: the product rounded to x's dtype, stored widened (not on TMA)."""
    m, k = x.shape
    n = weight.shape[0]
    # the kernel's N: the columns its tiles cover (_SILU_MUL: gate's, up's are beside them)
    cols_n = n // 2 if epilogue == _SILU_MUL else n
    out_n = cols_n
    if rope is not None:
        out_n = n // (rope.n_q_heads + 2 * rope.n_kv_heads) * rope.n_q_heads
    y = torch.empty((m, out_n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    seg = k_segment if k_segment is not None else linear_k_segment(n, k, x.dtype)
    assert seg % tile.block_k == 0, "K segment must be a multiple of BLOCK_K"
    seg_iters = seg // tile.block_k
    n_seg = triton.cdiv(k, seg)
    cols = tile.block_n // 2 if epilogue == _SILU_MUL else tile.block_n
    n_tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(cols_n, cols)
    split = split and _can_split(k, seg)
    interp = _interpreting()
    plain = epilogue == _STORE and y.dtype == x.dtype
    if tma is None:  # the many-rows tile only
        tma = plain and tile.block_m >= 128 and _tma_ok(x, weight)
    if not split and tma:
        assert plain, "the TMA path has no fused epilogue and no fp32 store"
        _linear_tma_kernel[(n_tiles,)](
            TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k]),
            TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k]),
            bias if bias is not None else y, y,
            m, n, k, y.stride(0), seg_iters,
            ONE_SEGMENT=n_seg == 1, HAS_BIAS=bias is not None,
            UPCAST=(interp and x.dtype == torch.bfloat16),
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            GROUP_M=tile.group_m,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
        return y
    if split:
        part = torch.empty(n_seg * n_tiles * tile.block_m * tile.block_n,
                           dtype=torch.float32, device=x.device)
        counters = _COUNTERS.get(x.device, n_tiles)
        grid: tuple[int, ...] = (n_tiles, n_seg)
    else:
        part = y  # unused
        counters = y
        grid = (n_tiles,)
    if rope is not None:
        kc, vc = rope.k_cache, rope.v_cache
        extra: tuple[object, ...] = (
            rope.cos, rope.sin, rope.cos.stride(0), rope.slots, rope.positions, kc, vc,
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            kc.shape[3] // 2)
        heads = {"HQ": rope.n_q_heads, "HKV": rope.n_kv_heads}
    else:
        extra = (y, y, 0, y, y, y, y, 0, 0, 0, 0, 0, 0, 0)
        heads = {}
    _linear_kernel[grid](
        x, weight, bias if bias is not None else y, y, part, counters,
        m, cols_n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        seg_iters, *extra,
        SEG_ITERS=seg_iters if split else 0,
        SPLIT=split,
        ONE_SEGMENT=(not split and n_seg == 1),
        HAS_BIAS=bias is not None,
        EVEN_K=(k % tile.block_k == 0),
        IEEE=(x.dtype == torch.float32),
        UPCAST=(interp and x.dtype == torch.bfloat16),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
        EPILOGUE=epilogue, LIBDEVICE=not interp, **heads,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        # the fused epilogues are the torch formulas' operations, each rounded; the product
        # has no multiply-add outside the MMA, so contraction off leaves its bits alone
        enable_fp_fusion=epilogue == _STORE,
    )
    return y


def _check_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str
) -> None:
    assert x.ndim == 2 and weight.ndim == 2 and x.shape[1] == weight.shape[1], \
        f"{name}: x[M,K], weight[N,K]: {tuple(x.shape)} vs {tuple(weight.shape)}"
    assert x.dtype == weight.dtype, f"{name}: x {x.dtype} vs weight {weight.dtype}"
    _check_dtype(x, name)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, f"{name}: bias[N]"


def bi_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x[M, K] @ weight[N, K]^T (+ bias[N]) -> [M, N] in x's dtype, fp32 accumulation."""
    _check_linear(x, weight, bias, "bi_linear")
    tile, split = _linear_path(x.shape[0], weight.shape[0], x.shape[1], x.dtype)
    return _launch_linear(x, weight, bias, tile, split)


def bi_linear_fp32(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``bi_linear(x, weight, bias).float()`` bit for bit (the LM head's logits), in one
    launch where the path is not TMA (few rows: every decode step)."""
    _check_linear(x, weight, bias, "bi_linear_fp32")
    path = _fusable(x, weight)
    if path is None or x.dtype == torch.float32:
        return bi_linear(x, weight, bias).float()
    return _launch_linear(x, weight, bias, *path, out_dtype=torch.float32)


#: Fuse silu(gate) * up and RoPE + the KV write into the linears before them where the path
#: allows (``linear_silu_mul``, ``linear_rope_kv``); 0 runs them as separate launches (the
#: same bits; benchmarks/engine_steps.py compares the two with ``FUSE_EPILOGUES=0``).
FUSE_EPILOGUES = 1


# Not numerics: the tiles silu(gate) * up's product runs on, fused, at 65-256 rows (a
# prompt forward, a mixed step), where bi_linear would take the TMA path and silu_mul a
# launch of its own. By the rows a tile pads least, then the wider one. H200, bf16, gate/up
# 28672x4096, us (TMA + silu_mul -> this): 128 rows 76.0 -> 68.8, 192 rows 139.1 -> 101.1,
# 256 rows 127.1 -> 117.3 (benchmarks/kernels_cuda.py "prompt tiles", each today's bits).
_SILU_MID_TILES = (
    (128, _Tile(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
    (192, _Tile(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)),
    (256, _Tile(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)),
)


def _fusable(x: torch.Tensor, weight: torch.Tensor, epilogue: int = _STORE
             ) -> tuple[_Tile, bool] | None:
    """(tile, split) of the product if its path can carry a fused epilogue (not TMA);
    for ``_SILU_MUL`` at 65-256 rows, where bi_linear's path is TMA, a ``_SILU_MID_TILES``
    tile instead."""
    if not FUSE_EPILOGUES:
        return None
    m = x.shape[0]
    tile, split = _linear_path(m, weight.shape[0], x.shape[1], x.dtype)
    if not split and tile.block_m >= 128 and _tma_ok(x, weight):
        if epilogue == _SILU_MUL and m > _FEW_ROWS:
            return next(((t, False) for rows, t in _SILU_MID_TILES if m <= rows), None)
        return None
    return tile, split


def linear_silu_mul(
    x: torch.Tensor, w_gate_up: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu_mul(*bi_linear(x, w_gate_up, bias).chunk(2, -1))`` bit for bit, [M, I]:
    w_gate_up [2I, K] holds the gate rows, then the up rows. One launch where the product
    runs on a non-TMA path (few rows: every decode step), else the two."""
    _check_linear(x, w_gate_up, bias, "linear_silu_mul")
    assert w_gate_up.shape[0] % 2 == 0, "linear_silu_mul: weight [2I, K]"
    path = _fusable(x, w_gate_up, _SILU_MUL)
    if path is None:
        gate, up = bi_linear(x, w_gate_up, bias).chunk(2, dim=-1)
        return silu_mul(gate, up)
    return _launch_linear(x, w_gate_up, bias, *path, epilogue=_SILU_MUL)


def linear_rope_kv(
    x: torch.Tensor, wqkv: torch.Tensor, bias: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, positions: torch.Tensor, n_q_heads: int, n_kv_heads: int,
) -> torch.Tensor:
    """``rope_qkv_to_cache(bi_linear(x, wqkv, bias), ...)`` bit for bit, returning q
    [T, Hq, D] (k is only written to the cache). One launch where the product runs on a
    non-TMA path whose tile holds whole rotation pairs, else the two."""
    _check_linear(x, wqkv, bias, "linear_rope_kv")
    t = x.shape[0]
    d = wqkv.shape[0] // (n_q_heads + 2 * n_kv_heads)
    assert d * (n_q_heads + 2 * n_kv_heads) == wqkv.shape[0] and d % 2 == 0
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (t, d // 2)
    assert cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert k_cache.shape == v_cache.shape and tuple(k_cache.shape[1::2]) == (n_kv_heads, d)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert slots.shape == positions.shape == (t,)
    path = _fusable(x, wqkv)
    if path is None or (d // 2) % (path[0].block_n // 2) != 0:
        q, _ = rope_qkv_to_cache(bi_linear(x, wqkv, bias), cos, sin, k_cache, v_cache,
                                 slots, positions, n_q_heads, n_kv_heads, return_k=False)
        return q
    rope = _RopeKV(cos, sin, slots, positions, k_cache, v_cache, n_q_heads, n_kv_heads)
    q = _launch_linear(x, wqkv, bias, *path, epilogue=_ROPE_KV, rope=rope)
    return q.view(t, n_q_heads, d)


# ----------------------------------------------------------------------------------------
# RMSNorm and log-softmax: one program per row
# ----------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_row(x, w_ptr, y_row, offs, mask, D, eps):
    """One row: x (fp32, zero past D) -> y_row, rounded to y's dtype."""
    mean_sq = tl.math.div_rn(tl.sum(x * x, axis=0), D.to(tl.float32))
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    # As Hugging Face / gpt-fast Llama: normalise in fp32, cast, then scale by the weight.
    normed = (x * rstd).to(y_row.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_row + offs, (normed * w).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, eps,
                     BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    _rms_norm_row(x, w_ptr, y_ptr + row * stride_y, offs, mask, D, eps)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, stride_x, stride_r, stride_s,
                         stride_y, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
    # torch's x + r: the sum in fp32, rounded once to the tensors' dtype.
    total = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * stride_s + offs, total, mask=mask)
    _rms_norm_row(total.to(tl.float32), w_ptr, y_ptr + row * stride_y, offs, mask, D, eps)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: (x * rsqrt(mean(x^2) + eps)) in fp32, cast, times weight."""
    assert x.ndim == 2 and weight.shape == (x.shape[1],), "bi_rms_norm: x[M,D], weight[D]"
    _check_dtype(x, "bi_rms_norm")
    m, d = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_d, warps = _norm_block(d, "bi_rms_norm")
    _rms_norm_kernel[(m,)](x, weight, y, x.stride(0), y.stride(0), d, eps,
                           BLOCK_D=block_d, num_warps=warps)
    return y


def _norm_block(d: int, name: str) -> tuple[int, int]:
    """(block, warps) of a one-program-per-row norm over D: a function of D only."""
    block_d = triton.next_power_of_2(d)
    assert block_d <= 65536, f"{name}: D too large for one block"
    return block_d, min(16, max(4, block_d // 512))


def bi_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, bi_rms_norm(s, weight, eps))`` with ``s = x + residual`` (torch's rounding), in
    one launch: the residual add and the norm after it (engine glue, not numerics: the bits
    of the two separate ops, checked on the GPU)."""
    assert x.ndim == 2 and residual.shape == x.shape and weight.shape == (x.shape[1],), \
        "bi_add_rms_norm: x[M,D], residual[M,D], weight[D]"
    assert residual.dtype == x.dtype, "bi_add_rms_norm: x and residual dtypes differ"
    _check_dtype(x, "bi_add_rms_norm")
    m, d = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual.stride(1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()
    total = torch.empty((m, d), dtype=x.dtype, device=x.device)
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return total, y
    block_d, warps = _norm_block(d, "bi_add_rms_norm")
    _add_rms_norm_kernel[(m,)](x, residual, weight, total, y, x.stride(0), residual.stride(0),
                               total.stride(0), y.stride(0), d, eps, BLOCK_D=block_d,
                               num_warps=warps)
    return total, y


@triton.jit
def _log_softmax_stats_kernel(x_ptr, stats_ptr, stride_x, V, BLOCK: tl.constexpr):
    """A row's max and log of the sum of exp(x - max): one program per row, lanes of BLOCK
    elements summed in V order, then one tree over the lanes (NUMERICS: BLOCK)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        run_max = tl.maximum(run_max, x)
    row_max = tl.max(run_max, axis=0)
    run_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        run_sum += tl.exp(x - row_max)
    tl.store(stats_ptr + row * 2, row_max)
    tl.store(stats_ptr + row * 2 + 1, tl.log(tl.sum(run_sum, axis=0)))


@triton.jit
def _log_softmax_out_kernel(x_ptr, stats_ptr, y_ptr, stride_x, stride_y, V,
                            BLOCK: tl.constexpr):
    """(x - max) - log_sum for one BLOCK of a row: elementwise, many programs per row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_max = tl.load(stats_ptr + row * 2)
    log_sum = tl.load(stats_ptr + row * 2 + 1)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (x - row_max) - log_sum, mask=offs < V)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of x[M, V], computed and returned in fp32.

    Two launches: each row's max and log-sum (one program per row: the reduction), then
    the output with many programs per row (one program per row wrote it before 2026-12-04,
    ~0.1 ms of every decode step at 64 x 128256 on an H200; the same bits, checked against
    that kernel in tests/engine/test_cuda_kernels.py)."""
    assert x.ndim == 2, "bi_log_softmax: x[M,V]"
    _check_dtype(x, "bi_log_softmax")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, v = x.shape
    y = torch.empty((m, v), dtype=torch.float32, device=x.device)
    if m == 0 or v == 0:
        return y
    block = min(4096, triton.next_power_of_2(v))  # NUMERICS: a function of V only
    stats = torch.empty((m, 2), dtype=torch.float32, device=x.device)
    _log_softmax_stats_kernel[(m,)](x, stats, x.stride(0), v, BLOCK=block, num_warps=8)
    out_block = 1024
    _log_softmax_out_kernel[(m, triton.cdiv(v, out_block))](
        x, stats, y, x.stride(0), y.stride(0), v, BLOCK=out_block, num_warps=4)
    return y


# ----------------------------------------------------------------------------------------
# silu(gate) * up in one launch (the MLP's activation)
# ----------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, N,
                     BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    x = g.to(tl.float32)
    # torch's silu functor: x / (1 + exp(-x)) in fp32 with an IEEE division and expf,
    # rounded to the input dtype; then torch's mul: the product in fp32, rounded.
    if LIBDEVICE:  # noqa: SIM108  (a constexpr branch; the JIT compiles one side)
        e = libdevice.exp(-x)
    else:                                   # the interpreter has no libdevice: numpy's exp
        e = tl.exp(-x)
    silu = tl.math.div_rn(x, 1.0 + e).to(g.dtype)
    tl.store(y_ptr + row * stride_y + offs,
             (silu.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` bit for bit, in one launch, for gate and up [M, I] (the two
    halves of the gate/up projection: row-strided views are fine).

    torch runs it as two elementwise kernels over strided views, ~14 us each at 64 x 14336
    on an H200 (0.9 ms of a Llama-3-8B decode step); this reads each input once. The bits
    are torch's (checked for every bf16 and fp16 gate value in tests/engine/
    test_cuda_kernels.py), so it changes no result and no kernel version."""
    _check_dtype(gate, "gate")
    assert gate.shape == up.shape and gate.dtype == up.dtype and gate.dim() == 2
    assert gate.stride(1) == 1 and up.stride(1) == 1, "rows must be contiguous"
    m, n = gate.shape
    y = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    if m == 0 or n == 0:
        return y
    block = 1024
    _silu_mul_kernel[(m, triton.cdiv(n, block))](
        gate, up, y, gate.stride(0), up.stride(0), y.stride(0), n, BLOCK=block,
        LIBDEVICE=not _interpreting(), num_warps=4, enable_fp_fusion=False)
    return y


# ----------------------------------------------------------------------------------------
# RoPE + KV-cache write: the attention glue between the qkv projection and attention
# ----------------------------------------------------------------------------------------


@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, pos_ptr, q_ptr, k_ptr,
                    kc_ptr, vc_ptr,
                    stride_qkv, stride_cs, stride_q, stride_k,
                    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
                    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                    BLOCK: tl.constexpr, WRITE_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)                       # q heads, then k heads, then v heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    src = qkv_ptr + t * stride_qkv + h * (2 * HALF)
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    if h < HQ + HKV:
        c = tl.load(cos_ptr + t * stride_cs + offs, mask=mask, other=0.0)
        s = tl.load(sin_ptr + t * stride_cs + offs, mask=mask, other=0.0)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        # The torch formula's operations, each rounded (launched with fp fusion off).
        o1 = (a * c - b * s).to(x1.dtype)
        o2 = (b * c + a * s).to(x1.dtype)
        if h < HQ:
            dst = q_ptr + t * stride_q + h * (2 * HALF)
            tl.store(dst + offs, o1, mask=mask)
            tl.store(dst + HALF + offs, o2, mask=mask)
        else:
            slot = tl.load(slots_ptr + t)
            pos = tl.load(pos_ptr + t)
            dst = kc_ptr + slot * stride_kcb + (h - HQ) * stride_kch + pos * stride_kcs
            tl.store(dst + offs, o1, mask=mask)
            tl.store(dst + HALF + offs, o2, mask=mask)
            if WRITE_K:
                dst = k_ptr + t * stride_k + (h - HQ) * (2 * HALF)
                tl.store(dst + offs, o1, mask=mask)
                tl.store(dst + HALF + offs, o2, mask=mask)
    else:
        slot = tl.load(slots_ptr + t)
        pos = tl.load(pos_ptr + t)
        dst = vc_ptr + slot * stride_vcb + (h - HQ - HKV) * stride_vch + pos * stride_vcs
        tl.store(dst + offs, x1, mask=mask)
        tl.store(dst + HALF + offs, x2, mask=mask)


def rope_qkv_to_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    return_k: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q and k (rotate-half RoPE in fp32, as ``workers.engine.model.apply_rope``) and
    write k and v into the cache at (slot, position), in one launch.

    qkv [T, (Hq + 2 Hkv) * D] (rows: q heads, k heads, v heads), cos/sin fp32 [T, D/2],
    caches [slots, Hkv, S, D], slots/positions int64 [T]. Returns q [T, Hq, D] and, if
    ``return_k``, the rotated k [T, Hkv, D]. Elementwise: every element is computed by the
    same instructions, and with fp contraction off they are the torch formula's operations,
    so the bits equal ``apply_rope``'s (checked in tests/engine/test_cuda_kernels.py).
    """
    t, width = qkv.shape
    head_dim = width // (n_q_heads + 2 * n_kv_heads)
    assert width == (n_q_heads + 2 * n_kv_heads) * head_dim and head_dim % 2 == 0
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (t, head_dim // 2)
    assert k_cache.shape == v_cache.shape and k_cache.shape[1] == n_kv_heads
    assert k_cache.shape[3] == head_dim and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert slots.shape == positions.shape == (t,)
    q = torch.empty((t, n_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = (torch.empty((t, n_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
         if return_k else None)
    if t == 0:
        return q, k
    half = head_dim // 2
    _rope_kv_kernel[(t, n_q_heads + 2 * n_kv_heads)](
        qkv, cos, sin, slots, positions, q, k if k is not None else q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), q.stride(0), k.stride(0) if k is not None else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=n_q_heads, HKV=n_kv_heads, HALF=half, BLOCK=triton.next_power_of_2(half),
        WRITE_K=k is not None, num_warps=1, enable_fp_fusion=False,
    )
    return q, k


# ----------------------------------------------------------------------------------------
# Decode attention: split-KV with a fixed split size, combined in split order
# ----------------------------------------------------------------------------------------

KV_SPLIT = 256          # NUMERICS: tokens per KV split
_DECODE_BLOCK_N = 64    # NUMERICS: keys per inner step
# Not numerics: rows with a slot each (prompt rows) run several to a program in
# _rows_attention_kernel, as many as their query heads fill the MMA's 16 rows; 0: one row per
# program in the decode kernel, as before.
_GROUP_SLOT_ROWS = 1


@triton.jit(do_not_specialize=["n_kv_heads", "max_splits"])
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, slots_ptr, o_ptr, part_o_ptr, part_ml_ptr, cnt_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    n_kv_heads, max_splits, scale_log2,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    # row b reads cache slot slots[b] (prompt rows), else slot b (decode)
    if HAS_SLOTS:  # noqa: SIM108  (a constexpr branch: compiled out)
        c = tl.load(slots_ptr + b).to(tl.int64)
    else:
        c = b
    start = split * SPLIT

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g                                         # [G_PAD]
    out_ptrs = o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    out_mask = mask_g[:, None] & mask_d[None, :]

    if start < seq_len:
        n_needed = tl.cdiv(seq_len, SPLIT)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=out_mask, other=0.0)                             # [G_PAD, D]
        k_base = k_ptr + c * stride_kb + kvh * stride_kh
        v_base = v_ptr + c * stride_vb + kvh * stride_vh
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
        end = tl.minimum(start + SPLIT, seq_len)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :],
                        mask=kv_mask, other=0.0)                          # [BN, D]
            qk = _mma(q, tl.trans(k), tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32),
                      IEEE, UPCAST)                                       # [G_PAD, BN]
            qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :],
                        mask=kv_mask, other=0.0)                          # [BN, D]
            acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
            m_i = m_new

        # Partials: o [B, Hq, max_splits, D], (m, l) [B, Hq, max_splits, 2], fp32.
        row_part = (b * n_kv_heads * GROUP + heads) * max_splits            # [G_PAD]
        tl.store(part_o_ptr + (row_part + split)[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=out_mask)
        tl.store(part_ml_ptr + (row_part + split) * 2, m_i, mask=mask_g)
        tl.store(part_ml_ptr + (row_part + split) * 2 + 1, l_i, mask=mask_g)
        tl.debug_barrier()
        cnt = cnt_ptr + b * n_kv_heads + kvh
        done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if done == n_needed - 1:
            # Last split of this (row, kv head): combine splits 0..n_needed-1 in order.
            m_all = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
            for s in range(0, n_needed):
                m_s = tl.load(part_ml_ptr + (row_part + s) * 2, mask=mask_g, other=0.0,
                              cache_modifier=".cg")
                m_all = tl.maximum(m_all, m_s)
            l_all = tl.zeros([G_PAD], dtype=tl.float32)
            o_all = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
            for s in range(0, n_needed):
                m_s = tl.load(part_ml_ptr + (row_part + s) * 2, mask=mask_g, other=0.0,
                              cache_modifier=".cg")
                l_s = tl.load(part_ml_ptr + (row_part + s) * 2 + 1, mask=mask_g, other=0.0,
                              cache_modifier=".cg")
                o_s = tl.load(part_o_ptr + (row_part + s)[:, None] * HEAD_DIM + offs_d[None, :],
                              mask=out_mask, other=0.0, cache_modifier=".cg")
                w = tl.exp2(m_s - m_all)
                l_all = l_all + l_s * w
                o_all = o_all + o_s * w[:, None]
            tl.store(cnt, 0)
            l_all = tl.where(mask_g, l_all, 1.0)  # padded heads: avoid 0/0
            tl.store(out_ptrs, (o_all / l_all[:, None]).to(o_ptr.dtype.element_ty),
                     mask=out_mask)
    elif split == 0:
        # Empty row (seq_len == 0): defined output instead of garbage.
        tl.store(out_ptrs, tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
                 .to(o_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["n_rows", "n_kv_heads", "max_splits"])
def _rows_attention_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, slots_ptr, o_ptr, part_o_ptr, part_ml_ptr, cnt_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    n_rows, n_kv_heads, max_splits, scale_log2,
    ROWS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``_decode_attention_kernel`` with a slot per row, ROWS rows per program: the rows
    of a prompt read the same slot, so one program loads each key and value block once for
    all of them (the query heads of ROWS rows fill the MMA's rows, which the decode kernel
    pads). Rows of another slot in the same program run in a pass of their own. Each row
    sums the same keys in the same blocks, splits and combine order as a decode row of its
    length (only the MMA row it occupies differs), so its bits are a decode row's.

    Lane i of the program: row first + i // GROUP, query head kvh * GROUP + i % GROUP.
    """
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    grp = tl.program_id(2)
    first = grp.to(tl.int64) * ROWS
    start = split * SPLIT

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lane_r = offs_g // GROUP
    rows = first + lane_r                                                # [G_PAD]
    valid = (lane_r < ROWS) & (rows < n_rows)
    heads = kvh * GROUP + offs_g % GROUP
    lens = tl.load(lens_ptr + rows, mask=valid, other=0)
    lane_slot = tl.load(slots_ptr + rows, mask=valid, other=-1)
    out_ptrs = o_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if split == 0:
        # Empty rows (length 0): defined output instead of garbage.
        empty = valid & (lens == 0)
        tl.store(out_ptrs, tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
                 .to(o_ptr.dtype.element_ty), mask=empty[:, None] & mask_d[None, :])
    max_len = tl.max(tl.where(valid, lens, 0), axis=0)
    if start < max_len:
        q = tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
        lane_end = tl.minimum(start + SPLIT, lens)                       # [G_PAD]
        working = valid & (start < lens)      # lanes with keys in this split
        m_out = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_out = tl.zeros([G_PAD], dtype=tl.float32)
        acc_out = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
        row_part = (rows * n_kv_heads * GROUP + heads) * max_splits         # [G_PAD]
        for r in tl.static_range(ROWS):
            # Pass r: the lanes of row r's slot, unless an earlier row had that slot.
            slot_r = tl.load(slots_ptr + first + r, mask=first + r < n_rows, other=-1)
            fresh = slot_r >= 0
            for e in tl.static_range(r):
                fresh = fresh & (tl.load(slots_ptr + first + e, mask=first + e < n_rows,
                                         other=-2) != slot_r)
            lanes = working & (lane_slot == slot_r)
            end = tl.max(tl.where(lanes, lane_end, 0), axis=0)
            if fresh & (end > start):
                c = slot_r.to(tl.int64)
                k_base = k_ptr + c * stride_kb + kvh * stride_kh
                v_base = v_ptr + c * stride_vb + kvh * stride_vh
                m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([G_PAD], dtype=tl.float32)
                acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
                for n0 in range(start, end, BLOCK_N):
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    mask_n = offs_n < end
                    kv_mask = mask_n[:, None] & mask_d[None, :]
                    k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_ks
                                + offs_d[None, :], mask=kv_mask, other=0.0)   # [BN, D]
                    qk = _mma(q, tl.trans(k), tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32),
                              IEEE, UPCAST)                                   # [G_PAD, BN]
                    keep = lanes[:, None] & (offs_n[None, :] < lane_end[:, None])
                    qk = tl.where(keep, qk * scale_log2, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                    # lanes outside the pass stay at -inf: subtract 0 there, not -inf
                    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_i - m_sub)
                    p = tl.exp2(qk - m_sub[:, None])
                    v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vs
                                + offs_d[None, :], mask=kv_mask, other=0.0)   # [BN, D]
                    # lanes whose keys ended before this block keep their state as it was
                    live = lanes & (n0 < lane_end)
                    l_i = tl.where(live, l_i * alpha + tl.sum(p, axis=1), l_i)
                    acc = tl.where(live[:, None],
                                   _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST),
                                   acc)
                    m_i = tl.where(live, m_new, m_i)
                m_out = tl.where(lanes, m_i, m_out)
                l_out = tl.where(lanes, l_i, l_out)
                acc_out = tl.where(lanes[:, None], acc, acc_out)
        # Partials as the decode kernel lays them out: o [B, Hq, max_splits, D], (m, l).
        wmask = working[:, None] & mask_d[None, :]
        tl.store(part_o_ptr + (row_part + split)[:, None] * HEAD_DIM + offs_d[None, :],
                 acc_out, mask=wmask)
        tl.store(part_ml_ptr + (row_part + split) * 2, m_out, mask=working)
        tl.store(part_ml_ptr + (row_part + split) * 2 + 1, l_out, mask=working)
        tl.debug_barrier()
        cnt = cnt_ptr + grp * n_kv_heads + kvh
        done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if done == tl.cdiv(max_len, SPLIT) - 1:
            # Last split program of these rows: each row combines its own splits in order.
            n_needed = tl.cdiv(lens, SPLIT)                                  # [G_PAD]
            live = valid & (lens > 0)
            m_all = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
            for s in range(0, tl.cdiv(max_len, SPLIT)):
                has = live & (s < n_needed)
                m_s = tl.load(part_ml_ptr + (row_part + s) * 2, mask=has, other=0.0,
                              cache_modifier=".cg")
                m_all = tl.where(has, tl.maximum(m_all, m_s), m_all)
            l_all = tl.zeros([G_PAD], dtype=tl.float32)
            o_all = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
            for s in range(0, tl.cdiv(max_len, SPLIT)):
                has = live & (s < n_needed)
                m_s = tl.load(part_ml_ptr + (row_part + s) * 2, mask=has, other=0.0,
                              cache_modifier=".cg")
                l_s = tl.load(part_ml_ptr + (row_part + s) * 2 + 1, mask=has, other=0.0,
                              cache_modifier=".cg")
                o_s = tl.load(part_o_ptr + (row_part + s)[:, None] * HEAD_DIM
                              + offs_d[None, :], mask=has[:, None] & mask_d[None, :],
                              other=0.0, cache_modifier=".cg")
                w = tl.exp2(m_s - tl.where(has, m_all, 0.0))
                l_all = tl.where(has, l_all + l_s * w, l_all)
                o_all = tl.where(has[:, None], o_all + o_s * w[:, None], o_all)
            tl.store(cnt, 0)
            l_all = tl.where(live, l_all, 1.0)   # rows past the end, empty rows: no 0/0
            tl.store(out_ptrs, (o_all / l_all[:, None]).to(o_ptr.dtype.element_ty),
                     mask=live[:, None] & mask_d[None, :])


def bi_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of attention per row: q[B,Hq,D] over the first seq_lens[b] positions
    of cache slot b, or of slot ``slots[b]`` (int64 [B]: prompt rows, any number per slot).

    k_cache/v_cache[slots, Hkv, S, D] may be strided views (last dim contiguous); without
    ``slots`` they have B slots. GQA: Hq is a multiple of Hkv. Returns [B, Hq, D] in q's
    dtype. A row's bits do not depend on which slot it reads or on S, only on the keys and
    values up to its length.
    """
    return _launch_decode_attention(q, k_cache, v_cache, seq_lens, scale, slots=slots)


def _launch_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    split_size: int = KV_SPLIT,
    block_n: int = _DECODE_BLOCK_N,
    num_warps: int = 4,
    num_stages: int | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bi_decode_attention`` with its launch constants as arguments (benchmarks only:
    ``split_size`` and ``block_n`` are NUMERICS, warps and stages are measured)."""
    assert q.ndim == 3 and k_cache.ndim == 4 and v_cache.shape == k_cache.shape, \
        "bi_decode_attention: q[B,Hq,D], k/v_cache[B,Hkv,S,D]"
    bsz, n_q_heads, head_dim = q.shape
    _, n_kv_heads, max_seq, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim, "cache shape mismatch"
    if slots is None:
        assert k_cache.shape[0] == bsz, "cache shape mismatch: one slot per row"
    else:
        assert slots.shape == (bsz,) and slots.dtype == torch.int64, "slots[B] int64"
    assert n_q_heads % n_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert seq_lens.shape == (bsz,) and seq_lens.dtype == torch.int32, "seq_lens[B] int32"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q/k/v dtypes differ"
    _check_dtype(q, "bi_decode_attention")
    if q.stride(2) != 1:
        q = q.contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache last dim must be contiguous"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if bsz == 0:
        return out
    group = n_q_heads // n_kv_heads
    max_splits = triton.cdiv(max_seq, split_size)
    part_o = torch.empty((bsz * n_q_heads * max_splits * head_dim,), dtype=torch.float32,
                         device=q.device)
    part_ml = torch.empty((bsz * n_q_heads * max_splits * 2,), dtype=torch.float32,
                          device=q.device)
    counters = _COUNTERS.get(q.device, bsz * n_kv_heads)
    interp = _interpreting()
    fp32 = q.dtype == torch.float32
    g_pad = max(16, triton.next_power_of_2(group))
    rows_per = g_pad // group if slots is not None and _GROUP_SLOT_ROWS else 1
    if rows_per > 1:
        _rows_attention_kernel[(max_splits, n_kv_heads, triton.cdiv(bsz, rows_per))](
            q, k_cache, v_cache, seq_lens, slots, out, part_o, part_ml, counters,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1),
            bsz, n_kv_heads, max_splits, scale * 1.4426950408889634,
            ROWS=rows_per, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), SPLIT=split_size, BLOCK_N=block_n,
            IEEE=fp32, UPCAST=(interp and q.dtype == torch.bfloat16),
            num_warps=num_warps,
            num_stages=num_stages if num_stages is not None else (2 if fp32 else 3),
        )
        return out
    grid = (max_splits, n_kv_heads, bsz)
    _decode_attention_kernel[grid](
        q, k_cache, v_cache, seq_lens, slots if slots is not None else seq_lens, out,
        part_o, part_ml, counters,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        n_kv_heads, max_splits, scale * 1.4426950408889634,
        GROUP=group, G_PAD=g_pad,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        SPLIT=split_size, BLOCK_N=block_n, IEEE=fp32,
        UPCAST=(interp and q.dtype == torch.bfloat16), HAS_SLOTS=slots is not None,
        num_warps=num_warps,
        num_stages=num_stages if num_stages is not None else (2 if fp32 else 3),
    )
    return out


# ----------------------------------------------------------------------------------------
# Prefill attention: causal flash attention over packed variable-length sequences
# ----------------------------------------------------------------------------------------

# NUMERICS: (block_m, block_n, num_warps, num_stages) per operand width.
_PREFILL_16 = (128, 64, 8, 3)
_PREFILL_32 = (32, 64, 8, 2)


@triton.jit
def _prefill_step(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, n0, offs_m, seq_len,
                  offs_d, mask_d, scale_log2,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < seq_len
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :],
                mask=kv_mask, other=0.0)                                      # [BN, D]
    qk = _mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), IEEE, UPCAST)
    qk = qk * scale_log2
    if MASKED:
        causal = (offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["n_seqs"])
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, o_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    n_seqs, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, B_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    head = tl.program_id(0)
    pid = tl.program_id(1)
    # Which (sequence, query block) this program owns; blocks are aligned to sequence starts.
    offs_b = tl.arange(0, B_PAD)
    starts = tl.load(cu_ptr + offs_b, mask=offs_b < n_seqs, other=0)
    ends = tl.load(cu_ptr + offs_b + 1, mask=offs_b < n_seqs, other=0)
    n_blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
    incl = tl.cumsum(n_blocks, axis=0)
    excl = incl - n_blocks
    hit = (pid >= excl) & (pid < incl)
    if tl.sum(hit.to(tl.int32), axis=0) > 0:
        seq_start = tl.sum(tl.where(hit, starts, 0), axis=0).to(tl.int64)
        seq_len = tl.sum(tl.where(hit, ends - starts, 0), axis=0)
        local = pid - tl.sum(tl.where(hit, excl, 0), axis=0)
        blk = tl.sum(tl.where(hit, n_blocks, 0), axis=0) - 1 - local   # longest blocks first
        kvh = head // GROUP

        offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)                  # positions in the seq
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < seq_len
        mask_d = offs_d < HEAD_DIM
        rows = seq_start + offs_m.to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)   # [BM, D]
        k_base = k_ptr + seq_start * stride_kt + kvh * stride_kh
        v_base = v_ptr + seq_start * stride_vt + kvh * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Key blocks entirely before this query block: no mask needed.
        lo = (blk * BLOCK_M) // BLOCK_N * BLOCK_N
        for n0 in range(0, lo, BLOCK_N):
            acc, l_i, m_i = _prefill_step(acc, l_i, m_i, q, k_base, v_base, stride_kt,
                                          stride_vt, n0, offs_m, seq_len, offs_d, mask_d,
                                          scale_log2, False, BLOCK_N, IEEE, UPCAST)
        # The diagonal: causal and length masks.
        hi = tl.minimum((blk + 1) * BLOCK_M, seq_len)
        for n0 in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _prefill_step(acc, l_i, m_i, q, k_base, v_base, stride_kt,
                                          stride_vt, n0, offs_m, seq_len, offs_d, mask_d,
                                          scale_log2, True, BLOCK_N, IEEE, UPCAST)
        out = acc / l_i[:, None]
        tl.store(o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def bi_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over packed sequences: q[T,Hq,D], k/v[T,Hkv,D] -> [T,Hq,D].

    cu_seqlens[B+1] (int32, cu_seqlens[0] == 0, cu_seqlens[B] == T) delimits the sequences;
    each attends only to itself.
    """
    assert q.ndim == 3 and k.ndim == 3 and v.shape == k.shape, \
        "bi_prefill_attention: q[T,Hq,D], k/v[T,Hkv,D]"
    n_tokens, n_q_heads, head_dim = q.shape
    assert k.shape[0] == n_tokens and k.shape[2] == head_dim, "q/k shape mismatch"
    assert n_q_heads % k.shape[1] == 0, "Hq must be a multiple of Hkv"
    assert cu_seqlens.ndim == 1 and cu_seqlens.dtype == torch.int32, "cu_seqlens[B+1] int32"
    assert q.dtype == k.dtype == v.dtype, "q/k/v dtypes differ"
    _check_dtype(q, "bi_prefill_attention")
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((n_tokens, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    n_seqs = cu_seqlens.numel() - 1
    if n_tokens == 0 or n_seqs <= 0:
        return out
    fp32 = q.dtype == torch.float32
    block_m, block_n, num_warps, num_stages = _PREFILL_32 if fp32 else _PREFILL_16
    grid = (n_q_heads, triton.cdiv(n_tokens, block_m) + n_seqs)
    _prefill_attention_kernel[grid](
        q, k, v, cu_seqlens, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        n_seqs, scale * 1.4426950408889634,
        GROUP=n_q_heads // k.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        B_PAD=max(128, triton.next_power_of_2(n_seqs + 1)),
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=fp32,
        UPCAST=(_interpreting() and q.dtype == torch.bfloat16),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
