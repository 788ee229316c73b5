"""Batch-invariant kernels written in plain torch: the CPU path, and the CUDA fallback.

Each function returns, for every row, bits that depend only on that row's inputs (for the
attention functions: on that sequence's own tokens), never on how many other rows share
the call or where the row sits. Two building blocks make that hold:

* **Fixed shapes for library GEMMs.** ``bi_linear`` runs ``torch.mm`` on chunks of exactly
  :data:`LINEAR_CHUNK_ROWS` rows (the last chunk zero-padded). BLAS picks its blocking,
  threading and kernels from the shape, so a fixed shape fixes the reduction order. That a
  row's bits then do not depend on its position inside the chunk is an empirical property
  of MKL/oneDNN (and cuBLAS) that ``tests/engine/test_ops.py`` checks on every run.
* **Reductions made of elementwise ops.** ``tree_sum``/``tree_max`` reduce a dimension by
  halving it (``x[:h] + x[h:]``) with a pairing fixed by the dimension's length alone.
  A single IEEE add/mul/div/sqrt is correctly rounded wherever it runs (vectorised body,
  scalar tail, any thread), so such a reduction is invariant by construction. Only ops whose
  vector and scalar CPU paths agree bit for bit are used (+, -, *, /, sqrt, exp, log,
  max); ``torch.sigmoid``, ``F.silu`` and ``torch.rsqrt`` do not agree and are avoided.

The same code runs on any device; on CUDA the Triton kernels in
``workers.engine.cuda_kernels`` replace it when they can be imported (see ``ops``).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

#: Rows per GEMM call in ``bi_linear``. Part of the numerics: changing it changes bits.
LINEAR_CHUNK_ROWS = 32
#: Key/value positions per block in ``bi_decode_attention``.
DECODE_KV_BLOCK = 64
#: Query rows per block in ``bi_prefill_attention`` (bounds the score matrix's memory).
PREFILL_Q_BLOCK = 256


# --------------------------------------------------------------------------- reductions
def _pad_to_power_of_two(x: Tensor, dim: int, value: float) -> Tensor:
    n = x.shape[dim]
    p = 1 << max(n - 1, 0).bit_length()
    if p == n:
        return x
    shape = list(x.shape)
    shape[dim] = p - n
    return torch.cat([x, x.new_full(shape, value)], dim)


def tree_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum over ``dim`` by pairwise halving; the pairing depends only on ``x.shape[dim]``."""
    dim = dim % x.dim()
    x = _pad_to_power_of_two(x, dim, 0.0)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x.squeeze(dim)


def tree_max(x: Tensor, dim: int = -1) -> Tensor:
    """Max over ``dim`` by pairwise halving (max is exact; the fixed pairing pins ±0)."""
    dim = dim % x.dim()
    x = _pad_to_power_of_two(x, dim, float("-inf"))
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = torch.maximum(x.narrow(dim, 0, half), x.narrow(dim, half, half))
    return x.squeeze(dim)


def inclusive_scan(x: Tensor) -> Tensor:
    """Prefix sums over the last dim (Hillis-Steele): each level is one elementwise add."""
    shift = 1
    n = x.shape[-1]
    while shift < n:
        y = x.clone()
        y[..., shift:] = x[..., shift:] + x[..., :-shift]
        x = y
        shift *= 2
    return x


def argmax_first(x: Tensor) -> Tensor:
    """Index of the largest value per row; ties go to the smallest index. [M, V] -> [M].
    An index is exact whatever the reduction order, and ties to the first index are
    ``torch.argmax``'s documented rule: one reduction over the logits (an H200 decode step
    spent ~120 us of GPU time in the four it replaced: amax, eq, where, amin). A row holding
    NaN gives its first NaN's index."""
    return x.argmax(dim=-1)


# --------------------------------------------------------------------------- row ops
def bi_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` on fixed-shape row chunks. x [M, K], weight [N, K] -> [M, N]."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"bi_linear shapes {tuple(x.shape)} x {tuple(weight.shape)}"
    )
    m, k = x.shape
    n = weight.shape[0]
    c = LINEAR_CHUNK_ROWS
    padded = -(-m // c) * c
    xp = x.new_zeros((padded, k))          # fresh, aligned: every chunk starts on a 64-byte line
    xp[:m] = x
    out = x.new_empty((padded, n))
    wt = weight.t()
    for start in range(0, padded, c):
        torch.mm(xp[start:start + c], wt, out=out[start:start + c])
    y = out[:m]
    if bias is not None:
        y = y + bias
    return y


def bi_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm in fp32, cast back, times weight (as transformers). x [M, D] -> [M, D]."""
    x32 = x.float()
    mean_square = tree_sum(x32 * x32) / x.shape[-1]                       # [M]
    inv_rms = 1.0 / torch.sqrt(mean_square + eps)         # not rsqrt: see the module doc
    return weight * (x32 * inv_rms[:, None]).to(x.dtype)


def bi_log_softmax(x: Tensor) -> Tensor:
    """fp32 log-softmax over the last dim. x [M, V] -> fp32 [M, V]."""
    x32 = x.float()
    shifted = x32 - tree_max(x32)[:, None]
    return shifted - torch.log(tree_sum(torch.exp(shifted)))[:, None]


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` with silu in fp32 as ``g / (1 + exp(-g))``, rounded once."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g))).to(gate.dtype) * up


# --------------------------------------------------------------------------- attention
def bi_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """One query token per sequence against its cache.

    q [B, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; seq_lens [B] (incl. the current token).
    Scores are tree sums over D; positions are combined in blocks of DECODE_KV_BLOCK, each
    block a tree sum, blocks added in order and only while the block holds a valid
    position of that row, so co-tenants' longer sequences change nothing. -> [B, Hq, D]
    """
    b, hq, d = q.shape
    hkv, s_cache = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    blk = DECODE_KV_BLOCK
    s_used = int(seq_lens.max().item())
    assert s_used <= s_cache, f"seq_len {s_used} exceeds the cache length {s_cache}"
    n_blocks = -(-s_used // blk)
    q32 = q.float().view(b, hkv, g, 1, d)                                 # [B, Hkv, G, 1, D]
    lens = seq_lens.to(torch.int64).view(b, 1, 1, 1)
    offsets = torch.arange(blk, device=q.device)

    def block(kv: Tensor, start: int) -> Tensor:
        """kv[:, :, start:start+blk] in fp32, zero-padded to blk positions. [B, Hkv, blk, D]"""
        part = kv[:, :, start:start + blk].float()
        if part.shape[2] < blk:
            part = F.pad(part, (0, 0, 0, blk - part.shape[2]))
        return part

    scores = []
    for i in range(n_blocks):
        k = block(k_cache, i * blk).unsqueeze(2)                          # [B, Hkv, 1, blk, D]
        s = tree_sum(q32 * k) * scale                                     # [B, Hkv, G, blk]
        valid = (i * blk + offsets) < lens                                # [B, 1, 1, blk]
        scores.append(s.masked_fill(~valid, float("-inf")))
    row_max = tree_max(torch.cat(scores, dim=-1))                         # [B, Hkv, G] exact max

    denom = torch.zeros_like(row_max)                                     # [B, Hkv, G]
    acc = q32.new_zeros((b, hkv, g, d))                                   # [B, Hkv, G, D]
    for i in range(n_blocks):
        valid = (i * blk + offsets) < lens                                # [B, 1, 1, blk]
        p = torch.exp(scores[i] - row_max[..., None])                     # [B, Hkv, G, blk]
        v = block(v_cache, i * blk).unsqueeze(2)                          # [B, Hkv, 1, blk, D]
        pv = torch.where(valid[..., None], p[..., None] * v, 0.0)         # [B, Hkv, G, blk, D]
        live = (i * blk) < lens                                           # [B, 1, 1, 1]
        denom = torch.where(live[..., 0], denom + tree_sum(p), denom)
        acc = torch.where(live, acc + tree_sum(pv, dim=-2), acc)
    out = acc / denom[..., None]                                          # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)                              # [B, Hq, D]


def bi_prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float
) -> Tensor:
    """Causal attention over packed sequences, one sequence at a time.

    q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1]. Every GEMM's shape is a function of
    the sequence's own length (and fixed query blocks), so a token's output depends only on
    its own sequence. -> [T, Hq, D]
    """
    _, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    bounds = [int(c) for c in cu_seqlens.tolist()]
    for start, end in itertools.pairwise(bounds):
        n = end - start
        if n == 0:
            continue
        qs = q[start:end].float().view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        ks = k[start:end].float().permute(1, 2, 0)[:, None]               # [Hkv, 1, D, n]
        vs = v[start:end].float().permute(1, 0, 2)[:, None]               # [Hkv, 1, n, D]
        for qb in range(0, n, PREFILL_Q_BLOCK):
            qe = min(qb + PREFILL_Q_BLOCK, n)
            scores = torch.matmul(qs[:, :, qb:qe], ks) * scale            # [Hkv, G, qe-qb, n]
            rows = torch.arange(qb, qe, device=q.device)[:, None]
            cols = torch.arange(n, device=q.device)[None, :]
            scores = scores.masked_fill(cols > rows, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, vs)                                   # [Hkv, G, qe-qb, D]
            o = o.permute(2, 0, 1, 3).reshape(qe - qb, hq, d)            # [qe-qb, Hq, D]
            out[start + qb:start + qe] = o.to(q.dtype)
    return out


# --------------------------------------------------------------------------- fast path
def fast_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Ordinary RMSNorm (torch reductions; numerics may depend on the batch shape)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fast_log_softmax(x: Tensor) -> Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def fast_silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def fast_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """SDPA over the batch's longest sequence with a padding mask. -> [B, Hq, D]"""
    hq = q.shape[1]
    g = hq // k_cache.shape[1]
    s_used = int(seq_lens.max().item())
    k = k_cache[:, :, :s_used].repeat_interleave(g, dim=1)                # [B, Hq, S, D]
    v = v_cache[:, :, :s_used].repeat_interleave(g, dim=1)
    mask = torch.arange(s_used, device=q.device)[None, :] < seq_lens[:, None]   # [B, S]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale
    )                                                                     # [B, Hq, 1, D]
    return out.squeeze(2)


def fast_prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float
) -> Tensor:
    """SDPA on the packed batch padded to its longest sequence. -> [T, Hq, D]"""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bounds = [int(c) for c in cu_seqlens.tolist()]
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    b, longest = len(lengths), max(lengths)
    seq = torch.repeat_interleave(
        torch.arange(b, device=q.device), torch.tensor(lengths, device=q.device)
    )                                                                     # [T]
    pos = torch.arange(t, device=q.device) - cu_seqlens.to(torch.int64)[seq]
    qp = q.new_zeros((b, longest, hq, d))
    kp = k.new_zeros((b, longest, hkv, d))
    vp = v.new_zeros((b, longest, hkv, d))
    qp[seq, pos], kp[seq, pos], vp[seq, pos] = q, k, v
    qp = qp.transpose(1, 2)                                               # [B, Hq, L, D]
    kp = kp.transpose(1, 2).repeat_interleave(g, dim=1)                   # [B, Hq, L, D]
    vp = vp.transpose(1, 2).repeat_interleave(g, dim=1)
    ar = torch.arange(longest, device=q.device)
    valid = ar[None, :] < torch.tensor(lengths, device=q.device)[:, None]     # [B, L]
    mask = (ar[None, :] <= ar[:, None])[None] & valid[:, None, :]        # [B, L, L]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)[seq, pos]                                  # [T, Hq, D]


# --------------------------------------------------------------------------- fast path, CUDA
# The ordinary fast path on CUDA: fused torch kernels, no host syncs in decode (the engine
# captures decode steps in CUDA graphs in both modes, so the two modes compare like with
# like). Numerics may depend on the batch; CPU keeps the functions above.
def fast_rms_norm_cuda(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``F.rms_norm`` (one fused kernel)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fast_decode_attention_cuda(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """SDPA over the whole allocated cache with a length mask: static shapes, no host sync.

    GQA without copying the cache: the G query heads of a KV head are G query rows of one
    attention "head" ([B, Hkv, G, D] against [B, Hkv, S, D]). -> [B, Hq, D]
    """
    b, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    mask = torch.arange(s, device=q.device)[None, :] < seq_lens.to(torch.int64)[:, None]
    out = F.scaled_dot_product_attention(
        q.reshape(b, hkv, hq // hkv, d), k_cache, v_cache,
        attn_mask=mask[:, None, None, :], scale=scale,
    )                                                                     # [B, Hkv, G, D]
    return out.reshape(b, hq, d)


def fast_prefill_attention_cuda(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float
) -> Tensor:
    """Causal SDPA (flash) on groups of equal-length sequences, no padding. -> [T, Hq, D]"""
    _, hq, d = q.shape
    g = hq // k.shape[1]
    bounds = [int(c) for c in cu_seqlens.tolist()]
    groups: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            groups.setdefault(end - start, []).append(start)
    out = torch.empty_like(q)
    for length, starts in groups.items():
        n = len(starts)
        rows: slice | Tensor
        if starts == list(range(starts[0], starts[0] + n * length, length)):
            rows = slice(starts[0], starts[0] + n * length)               # one contiguous run
        else:
            index = torch.tensor(starts)[:, None] + torch.arange(length)[None, :]
            rows = index.reshape(-1).to(q.device)                         # [n * L]
        qs, ks, vs = q[rows], k[rows], v[rows]
        qs = qs.view(n, length, hq, d).transpose(1, 2)                    # [n, Hq, L, D]
        ks = ks.view(n, length, -1, d).transpose(1, 2).repeat_interleave(g, dim=1)
        vs = vs.view(n, length, -1, d).transpose(1, 2).repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[rows] = o.transpose(1, 2).reshape(n * length, hq, d)
    return out


def fast_chunk_attention(q: Tensor, k: Tensor, v: Tensor, p0: int, scale: float) -> Tensor:
    """SDPA of one chunk's queries (positions p0..p0+n-1) over k/v [Hkv, p0+n, D] of its
    sequence, causal. q [n, Hq, D] -> [n, Hq, D] (numerics depend on the chunking)."""
    n, hq, d = q.shape
    hkv, end = k.shape[0], k.shape[1]
    g = hq // hkv
    rows = torch.arange(p0, p0 + n, device=q.device)[:, None]
    mask = torch.arange(end, device=q.device)[None, :] <= rows                # [n, end]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).reshape(hkv, g, n, d),                              # [Hkv, G, n, D]
        k[:, None].expand(hkv, g, end, d), v[:, None].expand(hkv, g, end, d),
        attn_mask=mask, scale=scale,
    )                                                                         # [Hkv, G, n, D]
    return out.reshape(hq, n, d).transpose(0, 1)
