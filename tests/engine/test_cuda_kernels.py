"""Batch-invariant Triton kernels: invariance and accuracy.

Without a GPU these run the very same kernels under the Triton interpreter (CPU tensors,
small shapes); the interpreter's arithmetic is not the GPU's, so what they establish is the
kernels' structure: the same row gives the same bits whatever batch it sits in, every
execution path of ``bi_linear`` agrees bit for bit, and results match float64 references.
Tests marked ``gpu`` repeat the checks at Llama-3-8B shapes on CUDA.
(benchmarks/kernels_cuda.py is the full GPU run: every batch size 1..64, timings.)
"""

from __future__ import annotations

import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
_TRITON_ALREADY_IMPORTED = "triton" in sys.modules
if not CUDA:
    # Interpreter mode is fixed when triton's own @jit helpers (tl.max, tl.sum, ...) are
    # decorated, i.e. at the first `import triton` of the process.
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from workers.engine import cuda_kernels as ck  # noqa: E402

if not CUDA:
    if _TRITON_ALREADY_IMPORTED and not ck._interpreting():
        pytest.skip("triton was imported before interpreter mode could be set; run this file "
                    "on its own (pytest tests/engine/test_cuda_kernels.py)",
                    allow_module_level=True)
    import triton.runtime.interpreter as _interp

    if not getattr(_interp._patch_lang_tensor, "_numpy2", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_numpy2(tensor, scope):  # type: ignore[no-untyped-def]
            """Triton 3.6's interpreter int()s 1-element arrays; numpy >= 2.4 refuses."""
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__",
                           lambda self: int(self.handle.data.reshape(-1)[0]))

        _patch_numpy2._numpy2 = True  # type: ignore[attr-defined]
        _interp._patch_lang_tensor = _patch_numpy2

    if not getattr(_interp.InterpreterBuilder.create_dot, "_fixed_order", False):
        import numpy as np

        def _fixed_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
            """The interpreter's ``tl.dot`` is numpy's BLAS matmul, whose summation order
            depends on the block's shape and the CPU (OpenBLAS picks kernels by both: on
            AMD EPYC the 64- and 128-row tiles round differently). A GPU's MMA accumulates
            each output element over K in an order the tile shape does not change, which is
            what the kernels' batch invariance rests on; model that: k ascending, one
            rounding per multiply and per add, in the accumulator's dtype."""
            a_data, b_data = a.data, b.data
            if a_data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
                return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
            dtype = d.data.dtype
            acc = d.data.astype(dtype, copy=True)
            a_acc, b_acc = a_data.astype(dtype), b_data.astype(dtype)
            for k in range(a_acc.shape[1]):
                acc += np.multiply.outer(a_acc[:, k], b_acc[k, :])
            return _interp.TensorHandle(acc, d.dtype.scalar)

        _orig_dot = _interp.InterpreterBuilder.create_dot
        _fixed_order_dot._fixed_order = True  # type: ignore[attr-defined]
        _interp.InterpreterBuilder.create_dot = _fixed_order_dot

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Relative Frobenius error vs float64. The interpreter casts fp32 -> bf16 by truncation
# (the GPU rounds to nearest), hence the looser bf16 bound off-GPU.
TOL = {torch.bfloat16: 8e-3 if not CUDA else 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


# ----------------------------------------------------------------------------------------
# The NUMERICS policy (pure Python: no kernel runs)
# ----------------------------------------------------------------------------------------


def test_k_segments_for_llama3_8b_are_pinned() -> None:
    """Changing these changes output bits: bump KERNELS_VERSION together with this test."""
    assert ck.KERNELS_VERSION == "bi-triton-2"
    bf16 = torch.bfloat16
    assert ck.linear_k_segment(4096, 4096, bf16) == 1024       # q, o
    assert ck.linear_k_segment(1024, 4096, bf16) == 512        # k, v
    assert ck.linear_k_segment(6144, 4096, bf16) == 2048       # fused qkv
    assert ck.linear_k_segment(14336, 4096, bf16) == 4096      # gate, up
    assert ck.linear_k_segment(28672, 4096, bf16) == 4096      # fused gate_up
    assert ck.linear_k_segment(4096, 14336, bf16) == 3584      # down
    assert ck.linear_k_segment(128256, 4096, bf16) == 4096     # lm_head
    assert ck.KV_SPLIT == 256


def test_linear_paths_share_the_numerics_tile_fields() -> None:
    """The path may depend on M; each element's MMA chain (K steps of block_k) may not. The
    split path's tile is 64 wide (a wgmma's N does not change an element's bits: measured
    on the H200, and ``test_linear_paths_agree_bit_for_bit`` runs it). Past 64 rows a
    product splits with the few-row tile (a prompt forward's rows), past 256 it never does."""
    for n, k in [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]:
        paths = {ck._linear_path(m, n, k, torch.bfloat16) for m in (1, 64, 65, 128, 4096)}
        assert {t.block_k for t, _ in paths} == {64}
        assert {t.block_n for t, split in paths if not split} == {128}
        assert {t for t, split in paths if split} <= {ck._TILE_SPLIT_16, ck._TILE_FEW_16}
        assert any(split for _, split in paths) == (ck.linear_k_segment(n, k, torch.bfloat16) < k)
        assert not ck._linear_path(257, n, k, torch.bfloat16)[1]
    bf16 = torch.bfloat16
    assert ck._linear_path(128, 6144, 4096, bf16) == (ck._TILE_FEW_16, True)     # qkv
    assert ck._linear_path(192, 6144, 4096, bf16) == (ck._TILE_MANY_16, False)   # 96 tiles
    assert ck._linear_path(128, 4096, 14336, bf16) == (ck._TILE_FEW_16, True)    # down
    assert ck._linear_path(128, 28672, 4096, bf16) == (ck._TILE_MANY_16, False)  # one segment


# ----------------------------------------------------------------------------------------
# Linear
# ----------------------------------------------------------------------------------------


def _linear_rows_invariant(dtype: torch.dtype, n: int, k: int, sizes: list[int],
                           bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = randn(n, k, dtype=dtype, gen=gen) / math.sqrt(k)
    b = randn(n, dtype=dtype, gen=gen) if bias else None
    probe = randn(1, k, dtype=dtype, gen=gen)
    alone = ck.bi_linear(probe, w, b)[0]
    ref = probe.double() @ w.double().T + (b.double() if b is not None else 0)
    assert rel_err(alone[None], ref) < TOL[dtype]
    for m in sizes:
        pos = int(torch.randint(0, m, (1,), generator=gen))
        x = randn(m, k, dtype=dtype, gen=gen)
        x[pos] = probe[0]
        y = ck.bi_linear(x, w, b)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.equal(y[pos], alone), f"row differs at M={m}, position {pos}"
        full_ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
        assert rel_err(y, full_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_row_is_batch_invariant(dtype: torch.dtype) -> None:
    # K = 1024 -> two K segments of 512: exercises the split and the segmented fused paths
    assert ck.linear_k_segment(256, 1024, dtype) == 512
    _linear_rows_invariant(dtype, n=256, k=1024, sizes=[2, 64, 65, 130], bias=False, seed=0)


@pytest.mark.slow
def test_linear_ragged_shapes_with_bias() -> None:
    # N, K not multiples of the tile; K not a multiple of the segment: fused path only
    _linear_rows_invariant(torch.bfloat16, n=200, k=600, sizes=[3, 70], bias=True, seed=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_paths_agree_bit_for_bit(dtype: torch.dtype) -> None:
    """Split (with its last-program reduction) and fused, both tiles: identical outputs."""
    gen = torch.Generator().manual_seed(2)
    n, k = 256, 1024
    w = randn(n, k, dtype=dtype, gen=gen)
    few, many = ck._tiles(dtype)
    for m in (1, 70):
        x = randn(m, k, dtype=dtype, gen=gen)
        tiles = [few, many] + ([ck._TILE_SPLIT_16] if dtype != torch.float32 else [])
        outs = [ck._launch_linear(x, w, None, t, split)
                for t in dict.fromkeys(tiles) for split in (False, True)]
        if dtype != torch.float32:  # bulk tensor (TMA) loads on the fused path
            outs += [ck._launch_linear(x, w, None, t, False, tma=True) for t in (few, many)]
        for o in outs[1:]:
            assert torch.equal(o, outs[0])
    # the counters are left at zero for the next launch
    assert int(ck._COUNTERS.get(DEV, 1).abs().sum()) == 0


def test_linear_rejects_mixed_dtypes() -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(4, 8, dtype=torch.float16, device=DEV)
    with pytest.raises(AssertionError):
        ck.bi_linear(x, w)


# ----------------------------------------------------------------------------------------
# RMSNorm and log-softmax
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_invariant_and_accurate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    d = 300
    w = randn(d, dtype=dtype, gen=gen)
    x = randn(9, d, dtype=dtype, gen=gen) * 3
    y = ck.bi_rms_norm(x, w, 1e-5)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert y.dtype == dtype
    assert rel_err(y, ref) < 2 * TOL[dtype]  # two roundings: after normalising, after scaling
    for i in (0, 4, 8):
        assert torch.equal(ck.bi_rms_norm(x[i:i + 1], w, 1e-5)[0], y[i])
    assert torch.equal(ck.bi_rms_norm(x[2:7], w, 1e-5), y[2:7])


def _add_rms_norm_case(dtype: torch.dtype, m: int, d: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = randn(d, dtype=dtype, gen=gen)
    x = randn(m, d, dtype=dtype, gen=gen) * 3
    r = randn(m, d, dtype=dtype, gen=gen)
    total, y = ck.bi_add_rms_norm(x, r, w, 1e-5)
    if ck._interpreting() and dtype == torch.bfloat16:
        # The interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even):
        # check the structure, the norm of the kernel's own sum, and the sum to one bf16 ulp.
        torch.testing.assert_close(total, x + r, rtol=2 ** -7, atol=0)
        assert torch.equal(y, ck.bi_rms_norm(total, w, 1e-5))
        return
    assert torch.equal(total, x + r)                     # torch's rounding of the sum
    assert torch.equal(y, ck.bi_rms_norm(x + r, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_is_the_add_then_the_norm(dtype: torch.dtype) -> None:
    _add_rms_norm_case(dtype, m=7, d=300, seed=4)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_add_rms_norm_is_the_add_then_the_norm(dtype: torch.dtype) -> None:
    for m in (1, 64, 1000):
        _add_rms_norm_case(dtype, m=m, d=4096, seed=m)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_softmax_invariant_and_accurate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    x = randn(5, 5000, dtype=dtype, gen=gen) * 4
    y = ck.bi_log_softmax(x)
    assert y.dtype == torch.float32
    assert rel_err(y, torch.log_softmax(x.double(), -1)) < 1e-5
    for i in (0, 4):
        assert torch.equal(ck.bi_log_softmax(x[i:i + 1])[0], y[i])


@triton.jit
def _one_program_log_softmax(x_ptr, y_ptr, stride_x, stride_y, V, BLOCK: tl.constexpr):
    """bi_log_softmax as one kernel (one program per row, three passes), as it was until
    2026-12-04: the recorded logprobs' bits, which the two-launch version must keep."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
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
    log_sum = tl.log(tl.sum(run_sum, axis=0))
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=0.0).to(tl.float32)
        tl.store(y_row + v0 + offs, (x - row_max) - log_sum, mask=v0 + offs < V)


def _log_softmax_as_before(x: torch.Tensor) -> torch.Tensor:
    m, v = x.shape
    y = torch.empty((m, v), dtype=torch.float32, device=x.device)
    _one_program_log_softmax[(m,)](x, y, x.stride(0), y.stride(0), v,
                                   BLOCK=min(4096, triton.next_power_of_2(v)), num_warps=8)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_log_softmax_bits_are_the_one_kernel_version(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    for v in (5000, 4096, 9000):
        x = randn(3, v, dtype=dtype, gen=gen) * 6
        assert torch.equal(ck.bi_log_softmax(x), _log_softmax_as_before(x)), f"V={v}"


@gpu
@needs_cuda
def test_gpu_log_softmax_bits_are_the_one_kernel_version() -> None:
    """Llama-3's vocabulary, the decode batch: the logprobs' bits did not change."""
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(64, 128256, device="cuda", generator=g) * 8
    assert torch.equal(ck.bi_log_softmax(x).view(torch.int32),
                       _log_softmax_as_before(x).view(torch.int32))


# ----------------------------------------------------------------------------------------
# Decode attention
# ----------------------------------------------------------------------------------------


def ref_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: torch.Tensor,
               scale: float) -> torch.Tensor:
    g = q.shape[1] // kc.shape[1]
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        k = kc[b, :, :n].double().repeat_interleave(g, 0)
        v = vc[b, :, :n].double().repeat_interleave(g, 0)
        s = torch.einsum("hd,hsd->hs", q[b].double(), k) * scale
        outs.append(torch.einsum("hs,hsd->hd", torch.softmax(s, -1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_attention_invariant_and_accurate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, s_alloc = 8, 2, 64, 600
    scale = 1 / math.sqrt(d)
    # caches: strided views of a [layers, slots, Hkv, S + pad, D] buffer, as the engine holds
    kbuf = randn(2, 3, hkv, s_alloc + 40, d, dtype=dtype, gen=gen)
    vbuf = randn(2, 3, hkv, s_alloc + 40, d, dtype=dtype, gen=gen)
    kc, vc = kbuf[1, :, :, :s_alloc], vbuf[1, :, :, :s_alloc]
    q = randn(3, hq, d, dtype=dtype, gen=gen)
    lens = torch.tensor([1, 300, 600], dtype=torch.int32, device=DEV)  # 1, 2 and 3 KV splits
    out = ck.bi_decode_attention(q, kc, vc, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref_decode(q, kc, vc, lens, scale)) < TOL[dtype]
    # row 1 alone, in a smaller contiguous cache: same bits
    alone = ck.bi_decode_attention(q[1:2], kc[1:2, :, :320].contiguous(),
                                   vc[1:2, :, :320].contiguous(), lens[1:2], scale)
    assert torch.equal(alone[0], out[1])
    # row 2 in another slot, next to a row of another length
    kc2 = torch.cat([kc[:1], kc[2:3]]).contiguous()
    vc2 = torch.cat([vc[:1], vc[2:3]]).contiguous()
    q2 = torch.stack([q[1], q[2]])
    again = ck.bi_decode_attention(q2, kc2, vc2,
                                   torch.tensor([17, 600], dtype=torch.int32, device=DEV), scale)
    assert torch.equal(again[1], out[2])
    assert int(ck._COUNTERS.get(DEV, 1).abs().sum()) == 0


def _slots_read_the_slot_bits(dtype: torch.dtype, hq: int, hkv: int, d: int, slots_n: int,
                              s_alloc: int, rows: list[tuple[int, int]], seed: int) -> None:
    """Rows (slot, length) through ``slots=`` on the whole cache give the bits of the same
    rows each over its own slot's cache (the chunk path's stride-0 views, and a copy)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1 / math.sqrt(d)
    kbuf = randn(slots_n, hkv, s_alloc + 16, d, dtype=dtype, gen=gen)
    vbuf = randn(slots_n, hkv, s_alloc + 16, d, dtype=dtype, gen=gen)
    kc, vc = kbuf[:, :, :s_alloc], vbuf[:, :, :s_alloc]           # strided, as the engine's
    q = randn(len(rows), hq, d, dtype=dtype, gen=gen)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int64, device=DEV)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32, device=DEV)
    out = ck.bi_decode_attention(q, kc, vc, lens, scale, slots=slots)
    for r, (slot, n) in enumerate(rows):
        if n == 0:                               # an empty row: zeros, as a decode row's
            assert not out[r].any(), f"row {r} (length 0) is not zeros"
            continue
        stop = n + (r % 3) * 7                   # the chunk path's views end past the row
        view = ck.bi_decode_attention(q[r:r + 1], kc[slot:slot + 1, :, :stop],
                                      vc[slot:slot + 1, :, :stop], lens[r:r + 1], scale)
        assert torch.equal(out[r], view[0]), f"row {r} (slot {slot}, length {n}) differs"
    gathered = ck.bi_decode_attention(q, kc[slots], vc[slots], lens, scale)
    assert torch.equal(out, gathered)
    assert rel_err(out, ref_decode(q, kc[slots], vc[slots], lens, scale)) < TOL[dtype]
    assert int(ck._COUNTERS.get(DEV, 1).abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_with_slots_reads_each_rows_slot(dtype: torch.dtype) -> None:
    """Prompt rows of several slots in one launch (``ops.rows_attention``): several rows of
    one slot at consecutive lengths, 1 to 3 KV splits, slots out of order, an empty row;
    groups of ``_rows_attention_kernel`` with one slot, two, and rows at a split boundary."""
    rows = [(2, 1), (0, 300), (2, 299), (2, 300), (1, 600), (0, 17), (1, 0), (1, 256),
            (1, 257)]
    _slots_read_the_slot_bits(dtype, 8, 2, 64, 3, 600, rows, seed=11)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_decode_attention_with_slots_llama_shapes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    rows = [(int(torch.randint(0, 6, (1,), generator=gen)),
             int(torch.randint(1, 1000, (1,), generator=gen))) for _ in range(200)]
    rows += [(5, n) for n in range(380, 520)]          # a prompt chunk after a prefix hit
    _slots_read_the_slot_bits(dtype, 32, 8, 128, 6, 1024, rows, seed=12)
    # a mixed step: decode rows of distinct slots, then a 128-row prompt of one slot
    rows = [(s, 500 + 3 * s) for s in range(56)] + [(56, n) for n in range(385, 513)]
    _slots_read_the_slot_bits(dtype, 32, 8, 128, 57, 1024, rows, seed=14)


@gpu
@needs_cuda
def test_gpu_rows_attention_is_the_chunk_path() -> None:
    """``ops.rows_attention`` (the prompt forward's one launch per layer on CUDA) gives the
    bits ``ops.chunk_attention`` gave: chunks of three slots, starting at 0 and past it."""
    from workers.engine import ops

    gen = torch.Generator().manual_seed(13)
    hq, hkv, d, s_alloc = 32, 8, 128, 1024
    kc = randn(4, hkv, s_alloc, d, dtype=torch.bfloat16, gen=gen)
    vc = randn(4, hkv, s_alloc, d, dtype=torch.bfloat16, gen=gen)
    spans = [(1, 0, 61), (3, 384, 128), (0, 700, 1), (2, 0, 512)]   # (slot, p0, n)
    chunks, slots, positions, row = [], [], [], 0
    for slot, p0, n in spans:
        chunks.append((slot, row, n, p0))
        slots += [slot] * n
        positions += range(p0, p0 + n)
        row += n
    q = randn(row, hq, d, dtype=torch.bfloat16, gen=gen)
    pos = torch.tensor(positions, device=DEV)
    with ops.batch_invariant_mode(True):
        old = ops.chunk_attention(q, kc, vc, chunks, d ** -0.5)
        new = ops.rows_attention(q, kc, vc, torch.tensor(slots, device=DEV),
                                 (pos + 1).to(torch.int32), d ** -0.5)
    assert torch.equal(old, new)


# ----------------------------------------------------------------------------------------
# Prefill attention
# ----------------------------------------------------------------------------------------


def ref_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int],
                scale: float) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        qq = q[a:b].double().transpose(0, 1)
        kk = k[a:b].double().repeat_interleave(g, 1).transpose(0, 1)
        vv = v[a:b].double().repeat_interleave(g, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * scale
        n = b - a
        s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), 1),
                          float("-inf"))
        outs.append((torch.softmax(s, -1) @ vv).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prefill_attention_invariant_and_accurate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d = 4, 2, 32
    scale = 1 / math.sqrt(d)
    lens = [5, 130, 40]
    cu = [0, *torch.cumsum(torch.tensor(lens), 0).tolist()]
    t = cu[-1]
    q, k, v = (randn(t, h, d, dtype=dtype, gen=gen) for h in (hq, hkv, hkv))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    out = ck.bi_prefill_attention(q, k, v, cu_t, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref_prefill(q, k, v, cu, scale)) < TOL[dtype]
    # the 130-token sequence alone, and first in a different pack: same bits
    a, b = cu[1], cu[2]
    alone = ck.bi_prefill_attention(q[a:b], k[a:b], v[a:b],
                                    torch.tensor([0, b - a], dtype=torch.int32, device=DEV),
                                    scale)
    assert torch.equal(alone, out[a:b])
    q2, k2, v2 = (torch.cat([x[a:b], x[:a]]) for x in (q, k, v))
    repacked = ck.bi_prefill_attention(
        q2, k2, v2, torch.tensor([0, b - a, b], dtype=torch.int32, device=DEV), scale)
    assert torch.equal(repacked[: b - a], out[a:b])
    assert torch.equal(repacked[b - a:], out[:a])


# ----------------------------------------------------------------------------------------
# RoPE + KV-cache write
# ----------------------------------------------------------------------------------------


def _rope_case(dtype: torch.dtype, hq: int, hkv: int, d: int, t: int) -> None:
    """The fused kernel equals apply_rope + KVCache.write bit for bit (fp32 off-GPU: the
    interpreter truncates fp32 -> bf16 where the GPU and torch round)."""
    from workers.engine.config import LLAMA3_8B_CONFIG, ModelConfig
    from workers.engine.model import apply_rope, rope_table

    gen = torch.Generator().manual_seed(11)
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, gen=gen)
    positions = torch.randperm(300, generator=gen)[:t]   # distinct: each cache cell once
    slots = torch.randint(0, 5, (t,), generator=gen)
    cfg = ModelConfig.from_hf({**LLAMA3_8B_CONFIG, "head_dim": d})
    cos_all, sin_all = rope_table(cfg, 0, 300, DEV)
    cos, sin = cos_all[positions.to(DEV)], sin_all[positions.to(DEV)]
    shape = (5, hkv, 320, d)
    kc, vc = torch.zeros(shape, dtype=dtype, device=DEV), torch.zeros(shape, dtype=dtype,
                                                                       device=DEV)
    q, k = ck.rope_qkv_to_cache(qkv, cos, sin, kc, vc, slots.to(DEV), positions.to(DEV),
                                hq, hkv)
    q_ref = apply_rope(qkv[:, :hq * d].reshape(t, hq, d), cos, sin)
    k_ref = apply_rope(qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d), cos, sin)
    v_ref = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(vc)
    kc_ref[slots.to(DEV), :, positions.to(DEV)] = k_ref
    vc_ref[slots.to(DEV), :, positions.to(DEV)] = v_ref
    assert k is not None
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    q2, k2 = ck.rope_qkv_to_cache(qkv, cos, sin, kc, vc, slots.to(DEV), positions.to(DEV),
                                  hq, hkv, return_k=False)
    assert k2 is None and torch.equal(q2, q)


def test_rope_kv_write_matches_torch() -> None:
    _rope_case(torch.float32, hq=4, hkv=2, d=32, t=37)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_rope_kv_write_matches_torch(dtype: torch.dtype) -> None:
    _rope_case(dtype, hq=32, hkv=8, d=128, t=250)


# ----------------------------------------------------------------------------------------
# Fused epilogues: the linear's product and the op after it in one launch
# ----------------------------------------------------------------------------------------


def _epilogue_paths(dtype: torch.dtype) -> list[tuple[object, bool]]:
    """Every (tile, split) a fused epilogue can run on (the non-TMA paths)."""
    few, many = ck._tiles(dtype)
    tiles = [few, many] + ([ck._TILE_SPLIT_16] if dtype != torch.float32 else [])
    return [(t, split) for t in dict.fromkeys(tiles) for split in (False, True)]


def _silu_mul_case(dtype: torch.dtype, i: int, k: int, rows: list[int], bias: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    w = randn(2 * i, k, dtype=dtype, gen=gen) / math.sqrt(k) * 4
    b = randn(2 * i, dtype=dtype, gen=gen) if bias else None
    for m in rows:
        x = randn(m, k, dtype=dtype, gen=gen)
        want = ck.silu_mul(*ck.bi_linear(x, w, b).chunk(2, dim=-1))
        assert torch.equal(ck.linear_silu_mul(x, w, b), want), f"M={m}"
        mid = [(t, False) for _, t in ck._SILU_MID_TILES] if dtype != torch.float32 else []
        for tile, split in _epilogue_paths(dtype) + mid:
            got = ck._launch_linear(x, w, b, tile, split, epilogue=ck._SILU_MUL)
            assert got.shape == (m, i)
            assert torch.equal(got, want), f"M={m}, {tile}, split={split}"
    assert int(ck._COUNTERS.get(DEV, 1).abs().sum()) == 0


def _fp32_store_case(dtype: torch.dtype, n: int, k: int, rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(13)
    w = randn(n, k, dtype=dtype, gen=gen) / math.sqrt(k)
    for m in rows:
        x = randn(m, k, dtype=dtype, gen=gen)
        want = ck.bi_linear(x, w).float()
        got = ck.bi_linear_fp32(x, w)
        assert got.dtype == torch.float32 and torch.equal(got, want), f"M={m}"
        for tile, split in _epilogue_paths(dtype):
            got = ck._launch_linear(x, w, None, tile, split, out_dtype=torch.float32)
            assert torch.equal(got, want), f"M={m}, {tile}, split={split}"


def test_linear_fp32_store_is_the_linear_then_float() -> None:
    """The LM head's logits stored widened in the product's launch: ``.float()``'s bits."""
    _fp32_store_case(torch.bfloat16, n=300, k=1024, rows=[1, 5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_silu_mul_is_the_linear_then_silu_mul(dtype: torch.dtype) -> None:
    """Gate and up columns of one tile, silu(gate) * up in the store: the bits of the two
    launches on every path (split and fused, every tile, the prompt rows' tiles too), with a
    bias and ragged I."""
    _silu_mul_case(dtype, i=160, k=1024, rows=[1, 5, 70], bias=True)


def _rope_fused_case(dtype: torch.dtype, hq: int, hkv: int, d: int, k: int, rows: list[int],
                     bias: bool) -> None:
    from workers.engine.config import LLAMA3_8B_CONFIG, ModelConfig
    from workers.engine.model import rope_table

    gen = torch.Generator().manual_seed(12)
    n = (hq + 2 * hkv) * d
    w = randn(n, k, dtype=dtype, gen=gen) / math.sqrt(k) * 4
    b = randn(n, dtype=dtype, gen=gen) if bias else None
    cfg = ModelConfig.from_hf({**LLAMA3_8B_CONFIG, "head_dim": d})
    cos_all, sin_all = rope_table(cfg, 0, 300, DEV)
    for t in rows:
        x = randn(t, k, dtype=dtype, gen=gen)
        positions = torch.randint(0, 300, (t,), generator=gen).to(DEV)
        slots = torch.randperm(t + 2, generator=gen)[:t].to(DEV)
        cos, sin = cos_all[positions], sin_all[positions]
        shape = (t + 2, hkv, 320, d)
        kc_ref = torch.zeros(shape, dtype=dtype, device=DEV)
        vc_ref = torch.zeros_like(kc_ref)
        q_ref, _ = ck.rope_qkv_to_cache(ck.bi_linear(x, w, b), cos, sin, kc_ref, vc_ref,
                                        slots, positions, hq, hkv, return_k=False)
        paths = [(t_, sp) for t_, sp in _epilogue_paths(dtype)
                 if (d // 2) % (t_.block_n // 2) == 0]
        assert paths
        for path in [None, *paths]:
            kc, vc = torch.zeros_like(kc_ref), torch.zeros_like(vc_ref)
            if path is None:                      # the public entry point
                q = ck.linear_rope_kv(x, w, b, cos, sin, kc, vc, slots, positions, hq, hkv)
            else:
                rope = ck._RopeKV(cos, sin, slots, positions, kc, vc, hq, hkv)
                q = ck._launch_linear(x, w, b, *path, epilogue=ck._ROPE_KV,
                                      rope=rope).view(t, hq, d)
            assert torch.equal(q, q_ref), f"T={t}, {path}"
            assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"T={t}, {path}"
    assert int(ck._COUNTERS.get(DEV, 1).abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_rope_kv_is_the_linear_then_rope(dtype: torch.dtype) -> None:
    """A tile holds the two halves that rotate together; RoPE and the KV write in the store:
    q, the k cache and the v cache have the bits of the linear and ``rope_qkv_to_cache``."""
    _rope_fused_case(dtype, hq=2, hkv=1, d=128, k=1024, rows=[1, 6], bias=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_fused_epilogues_llama_shapes(dtype: torch.dtype) -> None:
    """Llama-3-8B's gate/up and qkv at decode batches, 100 rows (qkv: the fallback) and a
    prompt forward's 150-256 rows (gate/up: its own tiles)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _silu_mul_case(dtype, i=14336, k=4096, rows=[1, 7, 64, 100, 150, 192, 256], bias=False)
    _rope_fused_case(dtype, hq=32, hkv=8, d=128, k=4096, rows=[1, 7, 64, 100], bias=False)
    if dtype != torch.float32:
        _fp32_store_case(dtype, n=128256, k=4096, rows=[1, 64, 100])


# ----------------------------------------------------------------------------------------
# GPU: Llama-3-8B shapes
# ----------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
                         ids=str)
def test_gpu_linear_invariant_llama_shapes(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    n, k = shape
    _linear_rows_invariant(dtype, n, k, sizes=[*range(2, 65), 65, 128, 1000, 4096],
                           bias=False, seed=7)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_decode_attention_invariant(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    hq, hkv, d, s_alloc = 32, 8, 128, 1024
    scale = 1 / math.sqrt(d)
    pq = randn(hq, d, dtype=dtype, gen=gen)
    pk = randn(hkv, 700, d, dtype=dtype, gen=gen)
    pv = randn(hkv, 700, d, dtype=dtype, gen=gen)
    alone = None
    for bsz in (1, 2, 5, 16, 64):
        pos = int(torch.randint(0, bsz, (1,), generator=gen))
        kc = randn(bsz, hkv, s_alloc, d, dtype=dtype, gen=gen)
        vc = randn(bsz, hkv, s_alloc, d, dtype=dtype, gen=gen)
        kc[pos, :, :700], vc[pos, :, :700] = pk, pv
        q = randn(bsz, hq, d, dtype=dtype, gen=gen)
        q[pos] = pq
        lens = torch.randint(1, s_alloc + 1, (bsz,), generator=gen).to(torch.int32)
        lens[pos] = 700
        out = ck.bi_decode_attention(q, kc, vc, lens.to(DEV), scale)[pos]
        alone = out if alone is None else alone
        assert torch.equal(out, alone), f"probe differs at B={bsz}"


# ----------------------------------------------------------------------------------------
# silu(gate) * up
# ----------------------------------------------------------------------------------------


def test_silu_mul_matches_torch_on_strided_halves() -> None:
    """The kernel on the gate/up halves of one projection output (row-strided views), in
    the interpreter off-GPU: torch's formula up to the last bit of numpy's exp."""
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(5, 2 * 300, generator=g) * 6).to(DEV)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = ck.silu_mul(gate, up)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_silu_mul_bits_equal_torch_for_every_gate_value(dtype: torch.dtype) -> None:
    """Every 16-bit gate value (NaN, inf, subnormals included) against several up values:
    the fused kernel's bits are ``F.silu(gate) * up``'s, so using it changes no result."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16) \
        .view(dtype).to("cuda")                                                 # [65536]
    ups = torch.tensor([1.0, -1.0, 0.5, 3.140625, -1e-3, 65504.0 if dtype == torch.float16
                        else 3e38, 0.0], dtype=dtype, device="cuda")
    gate = every[None, :].expand(len(ups), -1).contiguous()                     # [7, 65536]
    up = ups[:, None].expand(-1, every.numel()).contiguous()
    want = torch.nn.functional.silu(gate) * up
    got = ck.silu_mul(gate, up)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
@needs_cuda
def test_gpu_silu_mul_bits_equal_torch_fp32_llama_shape() -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = torch.randn(64, 2 * 14336, device="cuda", generator=g) * 8
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(ck.silu_mul(gate, up).view(torch.int32), want.view(torch.int32))


@gpu
@needs_cuda
def test_gpu_argmax_first_equals_the_four_op_pick() -> None:
    """The greedy pick (``torch.argmax``) against the amax/eq/where/amin formula it
    replaced, on tie-heavy rows at the vocabulary of Llama 3, every batch shape class."""
    from workers.engine.torch_kernels import argmax_first

    g = torch.Generator(device="cuda").manual_seed(1)
    for rows in (1, 3, 17, 64, 200):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for spread in (2, 8, 1000):
                x = torch.randint(-spread, spread, (rows, 128256), generator=g,
                                  device="cuda").to(dtype)
                best = x.amax(dim=-1, keepdim=True)
                index = torch.arange(x.shape[-1], device="cuda").expand_as(x)
                first = torch.where(x == best, index, x.shape[-1]).amin(dim=-1)
                assert torch.equal(argmax_first(x), first), (rows, dtype, spread)
