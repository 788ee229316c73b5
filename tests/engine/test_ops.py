"""Row invariance of each batch-invariant op, and the scoping of the mode."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.engine import ops, torch_kernels
from workers.engine.reference import top_logprobs

DTYPES = [torch.float32, torch.bfloat16]
ROWS = (1, 2, 3, 16, 31, 32, 33, 64, 100)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_row_invariant(fn, row: torch.Tensor, make_others, rows=ROWS) -> None:
    """fn(batch)[i] must equal fn(row alone) bit for bit wherever the row sits."""
    g = torch.Generator().manual_seed(0)
    alone = fn(row[None])[0]
    for m in rows:
        batch = make_others(m)
        position = int(torch.randint(0, m, (1,), generator=g))
        batch[position] = row
        got = fn(batch)[position]
        assert torch.equal(bits(got), bits(alone)), f"row changed at M={m}, position {position}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [(64, 352), (100, 264), (256, 1024)])
def test_linear_row_invariant(dtype: torch.dtype, k: int, n: int) -> None:
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    assert_row_invariant(lambda x: torch_kernels.bi_linear(x, w, b), torch.randn(k).to(dtype),
                         lambda m: torch.randn(m, k).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_softmax_silu_row_invariant(dtype: torch.dtype) -> None:
    w = torch.rand(96).to(dtype) + 0.5
    others = lambda m: torch.randn(m, 96).to(dtype) * 3  # noqa: E731
    row = torch.randn(96).to(dtype) * 3
    assert_row_invariant(lambda x: torch_kernels.bi_rms_norm(x, w, 1e-6), row, others)
    assert_row_invariant(torch_kernels.bi_log_softmax, row, others)
    assert_row_invariant(lambda x: torch_kernels.silu_mul(x, x), row, others)


def test_ops_match_fast_path_numerically() -> None:
    x, w = torch.randn(37, 64), torch.randn(80, 64)
    torch.testing.assert_close(torch_kernels.bi_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    nw = torch.rand(64) + 0.5
    torch.testing.assert_close(torch_kernels.bi_rms_norm(x, nw, 1e-5),
                               torch_kernels.fast_rms_norm(x, nw, 1e-5))
    torch.testing.assert_close(torch_kernels.bi_log_softmax(x), torch.log_softmax(x, -1))
    torch.testing.assert_close(torch_kernels.silu_mul(x, x), torch.nn.functional.silu(x) * x)


def _decode_inputs(b: int, lens: list[int], s: int = 200, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(len(lens))
    q = torch.randn(b, 8, 16, generator=g).to(dtype)
    k = torch.randn(b, 2, s, 16, generator=g).to(dtype)
    v = torch.randn(b, 2, s, 16, generator=g).to(dtype)
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_row_invariant(dtype: torch.dtype) -> None:
    q, k, v, lens = _decode_inputs(1, [70], dtype=dtype)
    alone = torch_kernels.bi_decode_attention(q, k[:, :, :128], v[:, :, :128], lens, 0.25)
    for b, position in [(2, 1), (5, 0), (9, 4), (33, 20)]:
        bq, bk, bv, blens = _decode_inputs(b, [int(x) for x in torch.randint(1, 200, (b,))],
                                           dtype=dtype)
        bq[position], bk[position], bv[position], blens[position] = q[0], k[0], v[0], 70
        got = torch_kernels.bi_decode_attention(bq, bk, bv, blens, 0.25)[position]
        assert torch.equal(bits(got), bits(alone[0])), f"B={b}"
    fast = torch_kernels.fast_decode_attention(q, k, v, lens, 0.25)
    torch.testing.assert_close(alone.float(), fast.float(), rtol=2e-2, atol=2e-2)


def test_prefill_attention_depends_on_own_sequence_only() -> None:
    g = torch.Generator().manual_seed(3)
    lengths = [5, 300, 1, 17]
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 16, generator=g) for h in (8, 2, 2))
    cu = torch.tensor([0, 5, 305, 306, 323], dtype=torch.int32)
    packed = torch_kernels.bi_prefill_attention(q, k, v, cu, 0.25)
    alone = torch_kernels.bi_prefill_attention(q[5:305], k[5:305], v[5:305],
                                               torch.tensor([0, 300], dtype=torch.int32), 0.25)
    assert torch.equal(packed[5:305], alone)
    fast = torch_kernels.fast_prefill_attention(q, k, v, cu, 0.25)
    torch.testing.assert_close(packed, fast, rtol=1e-4, atol=1e-5)


def test_tree_and_scan_helpers() -> None:
    x = torch.randn(3, 37, dtype=torch.float64)
    torch.testing.assert_close(torch_kernels.tree_sum(x), x.sum(-1))
    torch.testing.assert_close(torch_kernels.tree_sum(x, dim=0), x.sum(0))
    assert torch.equal(torch_kernels.tree_max(x), x.amax(-1))
    torch.testing.assert_close(torch_kernels.inclusive_scan(x), x.cumsum(-1))
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert torch_kernels.argmax_first(ties).tolist() == [1, 0]


def test_argmax_first_gives_the_first_of_tied_maxima() -> None:
    """The rule the greedy pick has always had (the largest value, the smallest index
    among equals, +0.0 equal to -0.0), on rows long enough for a parallel reduction."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-4, 4, (64, 128_256), generator=g).float()    # many exact ties
    x[3] = float("-inf")                                             # every token masked
    x[4, 100] = x[4, 7] = 9.0
    x[5], x[5, 11], x[5, 2] = -1.0, 0.0, -0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = x.to(dtype)
        best = y.amax(dim=-1, keepdim=True)
        index = torch.arange(y.shape[-1]).expand_as(y)
        first = torch.where(y == best, index, y.shape[-1]).amin(dim=-1)
        picked = torch_kernels.argmax_first(y)
        assert torch.equal(picked, first), dtype
        assert picked[[3, 4, 5]].tolist() == [0, 7, 2]


def test_top_logprobs_orders_ties_by_token_id() -> None:
    lp = torch.tensor([[-1.0, -0.5, -1.0, -0.5, -3.0, float("-inf")]])
    ids, values = top_logprobs(lp, 4)
    assert ids.tolist() == [[1, 3, 0, 2]]
    assert values.tolist() == [[-0.5, -0.5, -1.0, -1.0]]
    assert top_logprobs(lp, 6)[0].tolist() == [[1, 3, 0, 2, 4, 5]]


def test_mode_is_scoped_and_restored_on_error() -> None:
    assert not ops.is_batch_invariant()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with pytest.raises(RuntimeError), ops.batch_invariant_mode(True):
            assert ops.is_batch_invariant()
            assert torch.backends.cuda.matmul.allow_tf32 is False
            with ops.batch_invariant_mode(False):
                assert not ops.is_batch_invariant()
            assert ops.is_batch_invariant()
            raise RuntimeError("boom")
        assert not ops.is_batch_invariant()
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_mode_does_not_leak_into_other_threads() -> None:
    seen: list[bool] = []
    with ops.batch_invariant_mode(True):
        thread = threading.Thread(target=lambda: seen.append(ops.is_batch_invariant()))
        thread.start()
        thread.join()
    assert seen == [False]


def test_dispatch_follows_the_mode() -> None:
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with ops.batch_invariant_mode(True):
        assert torch.equal(ops.linear(x, w), torch_kernels.bi_linear(x, w))
        assert ops.backend_name("cpu", True) == "torch-bi"
    assert ops.backend_name("cpu", False) == "torch-sdpa"


def test_cuda_fast_path_functions_agree_with_the_cpu_ones() -> None:
    """The default-mode CUDA functions (graph-safe masked SDPA decode, grouped causal SDPA
    prefill, F.rms_norm) are plain torch: run them on CPU tensors against the CPU ones."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, s = 8, 2, 16, 96
    lens = torch.tensor([1, 37, 96, 5, 37], dtype=torch.int32)
    q = torch.randn(5, hq, d, generator=g)
    kc, vc = torch.randn(5, hkv, s, d, generator=g), torch.randn(5, hkv, s, d, generator=g)
    want = torch_kernels.fast_decode_attention(q, kc, vc, lens, 0.25)
    got = torch_kernels.fast_decode_attention_cuda(q, kc, vc, lens, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    lengths = [7, 3, 7, 1, 12, 3]                 # repeated lengths, not contiguous
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    want = torch_kernels.fast_prefill_attention(q, k, v, cu, 0.25)
    got = torch_kernels.fast_prefill_attention_cuda(q, k, v, cu, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    x, w = torch.randn(4, 64, generator=g), torch.randn(64, generator=g)
    torch.testing.assert_close(torch_kernels.fast_rms_norm_cuda(x, w, 1e-5),
                               torch_kernels.fast_rms_norm(x, w, 1e-5))
