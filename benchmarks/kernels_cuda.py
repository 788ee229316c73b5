"""Batch-invariant CUDA kernels: invariance, accuracy and speed on one GPU, in one run.

    PYTHONUNBUFFERED=1 python benchmarks/kernels_cuda.py --out DIR [--quick]

Sections (each independent; a failure is recorded and the run goes on):
  1. copy bandwidth (device-to-device copy, bytes read + written) for the roofline;
  2. invariance of every kernel (bf16, fp16, fp32): a probe row alone vs. inside batches of
     every size 1..64 (and large M for linear) at random positions, bit for bit; the default
     torch path (F.linear, SDPA) through the same test as a negative control; all linear
     execution paths compared bit for bit;
  3. accuracy against fp64 references (relative Frobenius error), next to torch's own;
  4. timings vs the default torch op at Llama-3-8B decode and prefill shapes: CUDA-graph
     replays over rotating buffers (weights come from HBM, not L2), CUDA events, medians;
     eager per-call wall time as well (Python launch overhead);
  5. an estimated Llama-3-8B step (64 requests, 512 prompt + 256 output) from the parts.
Writes DIR/kernels_cuda.json and DIR/kernels_cuda.txt (the printed tables).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if "--dry-run" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workers.engine import cuda_kernels as ck

if "--dry-run" in sys.argv:
    import triton.runtime.interpreter as _interp

    _patch = _interp._patch_lang_tensor

    def _patch_numpy2(tensor: Any, scope: Any) -> None:
        """Triton 3.6's interpreter int()s 1-element arrays, which numpy >= 2.4 rejects."""
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_numpy2



@dataclass
class Cfg:
    """Every size the run uses; ``dry()`` shrinks them for a CPU check of this script."""

    dev: torch.device = field(default_factory=lambda: torch.device("cuda"))
    hidden: int = 4096          # Llama-3-8B
    inter: int = 14336
    vocab: int = 128256
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=lambda: {
        "q_o": (4096, 4096),            # weight[N, K]
        "k_v": (1024, 4096),
        "qkv": (6144, 4096),
        "gate_up": (14336, 4096),
        "gate_up_fused": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    })
    max_batch: int = 64                 # invariance: every batch size 1..max_batch
    large_m: dict[str, list[int]] = field(default_factory=lambda: {
        "bf16": [65, 100, 128, 200, 256, 511, 1000, 2048, 4096, 8192, 32768],
        "fp16": [65, 128, 1000, 4096, 32768],
        "fp32": [65, 128, 1000, 4096],
    })
    lm_head_max_m: int = 8192
    path_ms: tuple[int, ...] = (1, 5, 33, 64, 130)
    tile_eq_shape: tuple[int, int] = (8192, 4096)
    tile_eq_ms: tuple[int, ...] = (1, 64, 300)
    rms_large: tuple[int, ...] = (100, 1000, 32768)
    lsm_rows: int = 1024
    dec_s: tuple[int, int, int] = (768, 2048, 4096)     # allocated cache lengths
    dec_probe_lens: tuple[int, ...] = (1, 255, 257, 600, 768)
    dec_err_shape: tuple[int, int] = (16, 1024)
    pre_max_len: int = 512
    pre_probe_lens: tuple[int, ...] = (1, 127, 300, 512)
    pre_err_lens: tuple[int, ...] = (1, 77, 128, 300, 512)
    decode_ms: tuple[int, ...] = (1, 16, 64)
    prefill_ms: tuple[int, ...] = (512, 4096, 32768)
    batch: int = 64                     # the target workload: 64 x (512 + 256)
    prompt: int = 512
    mean_ctx: int = 640
    variant_m: int = 8192
    rotate_bytes: int = 512 << 20       # rotate inputs past the 60 MB L2
    copy_bytes: int = 4 << 30
    timing_reps: int = 15
    dry: bool = False

    @classmethod
    def dry_run(cls) -> Cfg:
        return cls(
            dev=torch.device("cpu"), hidden=64, inter=96, vocab=1000, n_layers=2, n_heads=4,
            n_kv_heads=2, head_dim=16,
            linear_shapes={"q_o": (64, 64), "k_v": (32, 64), "qkv": (128, 64),
                           "gate_up": (96, 64), "gate_up_fused": (192, 64), "down": (64, 96),
                           "lm_head": (1000, 64)},
            max_batch=3, large_m={"bf16": [5, 9], "fp16": [5], "fp32": [5]}, lm_head_max_m=8,
            path_ms=(1, 5), tile_eq_shape=(256, 128), tile_eq_ms=(1, 3), rms_large=(7,),
            lsm_rows=8, dec_s=(24, 40, 64), dec_probe_lens=(1, 9, 24), dec_err_shape=(3, 32),
            pre_max_len=16, pre_probe_lens=(1, 9, 16), pre_err_lens=(1, 5, 16),
            decode_ms=(1, 4), prefill_ms=(64,), batch=4, prompt=16, mean_ctx=20, variant_m=16,
            rotate_bytes=1 << 16, copy_bytes=1 << 20, timing_reps=2, dry=True,
        )


C = Cfg()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

RESULTS: dict[str, Any] = {}
LINES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


def section(name: str, fn: Callable[[], Any]) -> None:
    log(f"\n=== {name} ===")
    t0 = time.time()
    try:
        RESULTS[name] = fn()
    except Exception as exc:  # noqa: BLE001 - record the failure, run the next section
        RESULTS[name] = {"error": repr(exc), "traceback": traceback.format_exc()}
        log(f"!! {name} failed: {exc!r}")
        log(traceback.format_exc())
    log(f"({name}: {time.time() - t0:.1f} s)")


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------


def sync() -> None:
    if C.dev.type == "cuda":
        torch.cuda.synchronize()


def graph_time_us(calls: list[Callable[[], Any]], min_ms: float = 3.0) -> float:
    """Median microseconds per call: the calls captured in one CUDA graph, replayed."""
    if C.dry:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    for c in calls:
        c()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    end.synchronize()
    est_ms = max(start.elapsed_time(end) / len(calls), 1e-3)
    inner = max(1, min(2000 // len(calls), math.ceil(min_ms / (est_ms * len(calls)))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(C.timing_reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (inner * len(calls)))
    del graph
    return statistics.median(times)


def eager_us(call: Callable[[], Any], n: int = 200) -> float:
    """Wall-clock microseconds per call issued back to back (launch overhead included)."""
    n = 3 if C.dry else n
    for _ in range(3):
        call()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    sync()
    return (time.perf_counter() - t0) * 1e6 / n


def n_sets(bytes_per_set: int) -> int:
    return max(1, min(32, math.ceil(C.rotate_bytes / max(bytes_per_set, 1))))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.double()
    if not torch.isfinite(out64).all():
        return float("nan")
    return ((out64 - ref).norm() / ref.norm()).item()


def randn(*shape: int, dt: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=C.dev, dtype=dt)


# ---------------------------------------------------------------------------------------
# 1. copy bandwidth
# ---------------------------------------------------------------------------------------


def copy_bandwidth() -> dict[str, Any]:
    """Device-to-device copy rate (bytes read + written), three ways; the best is the ceiling."""
    n = C.copy_bytes
    src = randn(n // 2, dt=torch.bfloat16)
    dst = torch.empty_like(src)
    out: dict[str, Any] = {"bytes_moved": 2 * n}
    out["memcpy_graph_us"] = graph_time_us([lambda: dst.copy_(src)], min_ms=20)
    out["memcpy_eager_us"] = event_time_us(lambda: dst.copy_(src), n=10)
    out["kernel_graph_us"] = graph_time_us([lambda: torch.mul(src, 1, out=dst)], min_ms=20)
    out["read_only_graph_us"] = graph_time_us([lambda: src.sum(dtype=torch.float32)], min_ms=20)
    rates = {k[:-3]: 2 * n / (v * 1e-6) / 1e12 for k, v in out.items() if k.endswith("_us")}
    rates["read_only_graph"] /= 2  # bytes read only
    out["tb_s"] = rates
    out["copy_tb_s"] = max(v for k, v in rates.items() if k != "read_only_graph")
    log(f"copy of {n >> 20} MiB, TB/s (bytes read + written): " +
        " ".join(f"{k}={v:.3f}" for k, v in rates.items()) +
        f" -> copy bandwidth {out['copy_tb_s']:.3f} TB/s")
    return out


# ---------------------------------------------------------------------------------------
# 2 + 3. invariance and accuracy
# ---------------------------------------------------------------------------------------


def probe_sizes(large: list[int] | tuple[int, ...] = ()) -> list[int]:
    return list(range(1, C.max_batch + 1)) + list(large)


def row_invariance(
    make_batch: Callable[[int, int], Callable[[], torch.Tensor]],
    sizes: list[int],
    gen: torch.Generator,
) -> dict[str, Any]:
    """make_batch(size, pos) -> run; run() returns the probe's output in that batch.

    The first size's result is the reference; every other size must match it bit for bit.
    """
    ref = None
    differs = []
    for size in sizes:
        pos = int(torch.randint(0, size, (1,), generator=gen))
        out = make_batch(size, pos)()
        if ref is None:
            ref = out.clone()
        elif not torch.equal(out, ref):
            differs.append(size)
    return {"sizes_tested": len(sizes), "max_size": max(sizes), "differs_at": differs,
            "invariant": not differs}


def short(xs: list[int], n: int = 8) -> str:
    return str(xs[:n])[:-1] + (", ...]" if len(xs) > n else "]")


def linear_invariance() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {}
    plans = {
        "bf16": ["q_o", "k_v", "gate_up", "down", "lm_head"],
        "fp16": ["q_o", "down"],
        "fp32": ["q_o", "down"],
    }
    for dname, shapes in plans.items():
        dt = DTYPES[dname]
        torch.backends.cuda.matmul.allow_tf32 = False
        for sname in shapes:
            n, k = C.linear_shapes[sname]
            w = randn(n, k, dt=dt) / math.sqrt(k)
            probe = randn(1, k, dt=dt)
            sizes = probe_sizes([m for m in C.large_m[dname]
                                 if not (sname == "lm_head" and m > C.lm_head_max_m)])
            big = randn(max(sizes), k, dt=dt)

            def make(size: int, pos: int, fn: Callable[..., torch.Tensor],
                     big: torch.Tensor = big, probe: torch.Tensor = probe,
                     w: torch.Tensor = w) -> Callable[[], torch.Tensor]:
                x = big[:size].clone()
                x[pos] = probe[0]
                return lambda: fn(x, w)[pos]

            res: dict[str, Any] = {
                "bi_linear": row_invariance(
                    lambda s, p, make=make: make(s, p, ck.bi_linear), sizes, gen),
                "F.linear": row_invariance(
                    lambda s, p, make=make: make(s, p, F.linear), sizes, gen),
                "k_segment": ck.linear_k_segment(n, k, dt),
            }
            # every execution path, bit for bit, on fresh inputs (a race shows up here)
            few, many = ck._tiles(dt)
            mism = checks = 0
            for m in C.path_ms:
                for _ in range(3):
                    x = randn(m, k, dt=dt)
                    outs = [ck._launch_linear(x, w, None, t, sp, tma=False)
                            for t in dict.fromkeys([few, many]) for sp in (False, True)]
                    if dt != torch.float32:
                        outs += [ck._launch_linear(x, w, None, t, False, tma=True)
                                 for t in (few, many)]
                    checks += 1
                    mism += sum(not torch.equal(o, outs[0]) for o in outs[1:])
            res["paths_equal"] = {"checks": checks, "mismatches": mism}
            # accuracy against fp64, next to torch's own
            x = randn(64, k, dt=dt)
            ref = x.double() @ w.double().T
            res["rel_err"] = rel_err(ck.bi_linear(x, w), ref)
            res["rel_err_torch"] = rel_err(F.linear(x, w), ref)
            out[f"{dname}/{sname}"] = res
            bi, tc = res["bi_linear"], res["F.linear"]
            log(f"linear {dname:4s} {sname:8s} seg={res['k_segment']:5d} "
                f"bi invariant={bi['invariant']} (M 1..{bi['max_size']}) | "
                f"F.linear differs at M={short(tc['differs_at'])} | "
                f"paths mismatches={mism}/{checks} | err {res['rel_err']:.2e} "
                f"(torch {res['rel_err_torch']:.2e})")
            del w, big
    return out


def tile_equivalence() -> dict[str, Any]:
    """Tiles and warp counts outside the NUMERICS set: same bits? (informative)."""
    out = {}
    for dname in ("bf16", "fp16"):
        dt = DTYPES[dname]
        n, k = C.tile_eq_shape
        w = randn(n, k, dt=dt) / math.sqrt(k)
        tiles = {
            "64x128w4": (ck._TILE_FEW_16, False),
            "128x128w8": (ck._TILE_MANY_16, False),
            "128x256w8": (ck._Tile(128, 256, 64, 8, 3), False),
            "tma128x256w8": (ck._Tile(128, 256, 64, 8, 3), True),
        }
        mism = dict.fromkeys(tiles, 0)
        for m in C.tile_eq_ms:
            x = randn(m, k, dt=dt)
            ref = ck._launch_linear(x, w, None, ck._TILE_FEW_16, False, k_segment=k, tma=False)
            for name, (t, tma) in tiles.items():
                y = ck._launch_linear(x, w, None, t, False, k_segment=k, tma=tma)
                mism[name] += int(not torch.equal(y, ref))
        out[dname] = mism
        log(f"{dname}: calls differing from 64x128w4 ({len(C.tile_eq_ms)} each): {mism}")
    return out


def norm_softmax_invariance() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    out: dict[str, Any] = {}
    for dname, dt in DTYPES.items():
        w = randn(C.hidden, dt=dt)
        probe = randn(1, C.hidden, dt=dt) * 3
        big = randn(max(probe_sizes(C.rms_large)), C.hidden, dt=dt)

        def make_rms(size: int, pos: int, big: torch.Tensor = big, probe: torch.Tensor = probe,
                     w: torch.Tensor = w) -> Callable[[], torch.Tensor]:
            x = big[:size].clone()
            x[pos] = probe[0]
            return lambda: ck.bi_rms_norm(x, w, 1e-5)[pos]

        rms = row_invariance(make_rms, probe_sizes(C.rms_large), gen)
        x = randn(64, C.hidden, dt=dt)
        xd = x.double()
        ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        xf = x.float()
        torch_rms = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt) * w
        rms["rel_err"] = rel_err(ck.bi_rms_norm(x, w, 1e-5), ref)
        rms["rel_err_torch"] = rel_err(torch_rms, ref)
        rms["max_abs_vs_torch_formula"] = (
            ck.bi_rms_norm(x, w, 1e-5).float() - torch_rms.float()).abs().max().item()

        vbig = randn(max(C.lsm_rows, C.max_batch), C.vocab, dt=dt) * 4
        vprobe = randn(1, C.vocab, dt=dt) * 4

        def make_lsm(size: int, pos: int, vbig: torch.Tensor = vbig,
                     vprobe: torch.Tensor = vprobe) -> Callable[[], torch.Tensor]:
            x = vbig[:size].clone()
            x[pos] = vprobe[0]
            return lambda: ck.bi_log_softmax(x)[pos]

        lsm = row_invariance(make_lsm, probe_sizes([C.lsm_rows]), gen)
        x = vbig[:64]
        ref = torch.log_softmax(x.double(), -1)
        lsm["rel_err"] = rel_err(ck.bi_log_softmax(x), ref)
        lsm["rel_err_torch"] = rel_err(torch.log_softmax(x.float(), -1), ref)
        out[dname] = {"rms_norm": rms, "log_softmax": lsm}
        log(f"rms_norm    {dname}: invariant={rms['invariant']} (M 1..{rms['max_size']}) "
            f"err {rms['rel_err']:.2e} (torch {rms['rel_err_torch']:.2e}, max |bi - torch "
            f"formula| {rms['max_abs_vs_torch_formula']:.3g})")
        log(f"log_softmax {dname}: invariant={lsm['invariant']} (M 1..{lsm['max_size']}) "
            f"err {lsm['rel_err']:.2e} (torch {lsm['rel_err_torch']:.2e})")
        del big, vbig
    return out


def sdpa_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: torch.Tensor,
                scale: float) -> torch.Tensor:
    """The default path: SDPA over the whole cache with a length mask (gpt-fast style)."""
    s = kc.shape[2]
    mask = torch.arange(s, device=q.device)[None, :] < lens[:, None].long()   # [B, S]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=mask[:, None, None, :],
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)


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


def decode_attention_invariance() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {}
    scale = 1 / math.sqrt(C.head_dim)
    s_small, s_mid, s_big = C.dec_s
    plen_max = max(C.dec_probe_lens)
    hkv, hq, d = C.n_kv_heads, C.n_heads, C.head_dim
    for dname, dt in DTYPES.items():
        res: dict[str, Any] = {}
        # One random [2 layers, slots, Hkv, S + pad, D] cache pair; every batch below is a
        # strided view of layer 1 (other rows: whatever earlier probes left there).
        kbuf = randn(2, C.max_batch, hkv, s_mid + 16, d, dt=dt)
        vbuf = randn(2, C.max_batch, hkv, s_mid + 16, d, dt=dt)
        qbuf = randn(C.max_batch, hq, d, dt=dt)
        for probe_len in C.dec_probe_lens:
            pq = randn(hq, d, dt=dt)
            pk = randn(hkv, plen_max, d, dt=dt)
            pv = randn(hkv, plen_max, d, dt=dt)

            def make(size: int, pos: int, fn: Callable[..., torch.Tensor], s_alloc: int,
                     kbuf: torch.Tensor = kbuf, vbuf: torch.Tensor = vbuf,
                     pq: torch.Tensor = pq, pk: torch.Tensor = pk, pv: torch.Tensor = pv,
                     probe_len: int = probe_len) -> Callable[[], torch.Tensor]:
                kc, vc = kbuf[1, :size, :, :s_alloc], vbuf[1, :size, :, :s_alloc]
                kc[pos, :, :plen_max] = pk
                vc[pos, :, :plen_max] = pv
                q = qbuf[:size]  # noqa: B023 (called within this iteration)
                q[pos] = pq
                lens = torch.randint(1, s_alloc + 1, (size,), generator=gen).to(torch.int32)
                lens[pos] = probe_len
                lens = lens.to(C.dev)
                return lambda: fn(q, kc, vc, lens, scale)[pos]

            for s_alloc in (s_small, s_mid):
                res[f"len{probe_len}/S{s_alloc}"] = row_invariance(
                    lambda s, p, s_alloc=s_alloc, make=make: make(
                        s, p, ck.bi_decode_attention, s_alloc),
                    probe_sizes(), gen)
            res[f"len{probe_len}/sdpa"] = row_invariance(
                lambda s, p, make=make: make(s, p, sdpa_decode, s_small), probe_sizes(), gen)
            # the same probe in a contiguous cache of s_big slots, 5 rows, slot 3
            kc = randn(5, hkv, s_big, d, dt=dt)
            vc = torch.randn_like(kc)
            kc[3, :, :plen_max], vc[3, :, :plen_max] = pk, pv
            q = randn(5, hq, d, dt=dt)
            q[3] = pq
            lens = torch.tensor([s_big, 1, 7, probe_len, s_big - 5], dtype=torch.int32,
                                device=C.dev)
            r_big = ck.bi_decode_attention(q, kc, vc, lens, scale)[3]
            r_small = make(1, 0, ck.bi_decode_attention, s_small)()
            res[f"len{probe_len}/S{s_small}_vs_S{s_big}_equal"] = bool(torch.equal(r_small, r_big))
        bsz, s_err = C.dec_err_shape
        q = randn(bsz, hq, d, dt=dt)
        kc = randn(bsz, hkv, s_err, d, dt=dt)
        vc = torch.randn_like(kc)
        lens = torch.randint(1, s_err + 1, (bsz,), generator=gen).to(torch.int32).to(C.dev)
        ref = ref_decode(q, kc, vc, lens, scale)
        res["rel_err"] = rel_err(ck.bi_decode_attention(q, kc, vc, lens, scale), ref)
        res["rel_err_torch"] = rel_err(sdpa_decode(q, kc, vc, lens, scale), ref)
        bi_ok = all(v["invariant"] for kk, v in res.items()
                    if isinstance(v, dict) and "/S" in kk)
        cross_ok = all(v for kk, v in res.items() if kk.endswith("_equal"))
        sdpa_diff = {kk.split("/")[0]: short(v["differs_at"], 5) for kk, v in res.items()
                     if isinstance(v, dict) and kk.endswith("/sdpa")}
        log(f"decode_attention {dname}: bi invariant (B 1..{C.max_batch}, S {s_small}/{s_mid}, "
            f"probe lens {C.dec_probe_lens})={bi_ok}, same at S={s_big}/other slot={cross_ok} | "
            f"err {res['rel_err']:.2e} (sdpa {res['rel_err_torch']:.2e})")
        log(f"  sdpa (masked, full cache) probe differs at B={sdpa_diff}")
        res["summary"] = {"bi_invariant": bi_ok, "bi_same_across_S": cross_ok}
        out[dname] = res
    return out


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


def prefill_attention_invariance() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4)
    out: dict[str, Any] = {}
    scale = 1 / math.sqrt(C.head_dim)
    hkv, hq, d = C.n_kv_heads, C.n_heads, C.head_dim
    max_t = C.max_batch * C.pre_max_len
    for dname, dt in DTYPES.items():
        res: dict[str, Any] = {}
        qbuf = randn(max_t, hq, d, dt=dt)
        kbuf = randn(max_t, hkv, d, dt=dt)
        vbuf = randn(max_t, hkv, d, dt=dt)
        for probe_len in C.pre_probe_lens:
            pq = randn(probe_len, hq, d, dt=dt)
            pk = randn(probe_len, hkv, d, dt=dt)
            pv = randn(probe_len, hkv, d, dt=dt)

            def make(size: int, pos: int, pq: torch.Tensor = pq, pk: torch.Tensor = pk,
                     pv: torch.Tensor = pv, probe_len: int = probe_len,
                     ) -> Callable[[], torch.Tensor]:
                lens = torch.randint(1, C.pre_max_len + 1, (size,), generator=gen)
                lens[pos] = probe_len
                cu = [0, *torch.cumsum(lens, 0).tolist()]
                t = cu[-1]
                q, k, v = qbuf[:t], kbuf[:t], vbuf[:t]  # noqa: B023 (called right away)
                a, b = cu[pos], cu[pos + 1]
                q[a:b], k[a:b], v[a:b] = pq, pk, pv
                cu_t = torch.tensor(cu, dtype=torch.int32, device=C.dev)
                return lambda: ck.bi_prefill_attention(q, k, v, cu_t, scale)[a:b]

            res[f"len{probe_len}"] = row_invariance(make, probe_sizes(), gen)
        lens = list(C.pre_err_lens)
        cu = [0, *torch.cumsum(torch.tensor(lens), 0).tolist()]
        t = cu[-1]
        q, k, v = randn(t, hq, d, dt=dt), randn(t, hkv, d, dt=dt), randn(t, hkv, d, dt=dt)
        ref = ref_prefill(q, k, v, cu, scale)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=C.dev)
        bi = ck.bi_prefill_attention(q, k, v, cu_t, scale)
        res["rel_err"] = rel_err(bi, ref)
        # SDPA on the last sequence alone, for scale
        a, b = cu[-2], cu[-1]
        sd = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
            v[a:b].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1)
        res["rel_err_torch_last_seq"] = rel_err(sd, ref[a:b])
        res["rel_err_bi_last_seq"] = rel_err(bi[a:b], ref[a:b])
        ok = all(v_["invariant"] for kk, v_ in res.items() if kk.startswith("len"))
        res["summary"] = {"bi_invariant": ok}
        log(f"prefill_attention {dname}: invariant (packs of 1..{C.max_batch}, probe lens "
            f"{C.pre_probe_lens})={ok} | err {res['rel_err']:.2e} (last seq: bi "
            f"{res['rel_err_bi_last_seq']:.2e}, sdpa {res['rel_err_torch_last_seq']:.2e})")
        out[dname] = res
    return out


# ---------------------------------------------------------------------------------------
# 4. timings
# ---------------------------------------------------------------------------------------


def time_linear_case(dt: torch.dtype, m: int, n: int, k: int,
                     fns: dict[str, Callable[..., torch.Tensor]]) -> dict[str, float]:
    sets = n_sets((n * k + m * k) * dt.itemsize)
    ws = [randn(n, k, dt=dt) / math.sqrt(k) for _ in range(sets)]
    xs = [randn(m, k, dt=dt) for _ in range(sets)]
    res = {}
    for name, fn in fns.items():
        res[name] = graph_time_us(
            [lambda x=x, w=w, fn=fn: fn(x, w) for x, w in zip(xs, ws, strict=True)])
    del ws, xs
    return res


def linear_timings() -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, Any] = {}
    big_m = max(C.prefill_ms)
    cases: list[tuple[str, str, int]] = []
    for sname in C.linear_shapes:
        cases += [("bf16", sname, m) for m in C.decode_ms]
        if sname != "lm_head":
            cases += [("bf16", sname, m) for m in C.prefill_ms]
    cases += [("fp16", "q_o", C.batch), ("fp16", "gate_up", C.batch), ("fp16", "q_o", big_m),
              ("fp16", "gate_up", big_m), ("fp32", "q_o", C.batch),
              ("fp32", "q_o", min(C.prefill_ms))]
    log(f"{'dtype':5s} {'shape':20s} {'M':>6s} {'bi us':>9s} {'torch us':>9s} {'ratio':>6s} "
        f"{'bi TB/s':>8s} {'bi TFLOP/s':>10s} {'torch TFLOP/s':>13s}  path")
    for dname, sname, m in cases:
        dt = DTYPES[dname]
        n, k = C.linear_shapes[sname]
        r: dict[str, Any] = dict(time_linear_case(dt, m, n, k,
                                                  {"bi": ck.bi_linear, "torch": F.linear}))
        wbytes = n * k * dt.itemsize
        r["bi_tb_s"] = (wbytes + m * (n + k) * dt.itemsize) / (r["bi"] * 1e-6) / 1e12
        r["torch_tb_s"] = (wbytes + m * (n + k) * dt.itemsize) / (r["torch"] * 1e-6) / 1e12
        r["bi_tflops"] = 2 * m * n * k / (r["bi"] * 1e-6) / 1e12
        r["torch_tflops"] = 2 * m * n * k / (r["torch"] * 1e-6) / 1e12
        r["ratio"] = r["bi"] / r["torch"]
        tile, split = ck._linear_path(m, n, k, dt)
        tma = tile.block_m >= 128 and dt != torch.float32
        r["path"] = (f"{tile.block_m}x{tile.block_n}w{tile.num_warps}"
                     f"{' split' if split else ''}{' tma' if tma else ''}")
        out[f"{dname}/{sname}/{m}"] = r
        log(f"{dname:5s} {sname + f' {n}x{k}':20s} {m:6d} {r['bi']:9.1f} {r['torch']:9.1f} "
            f"{r['ratio']:6.2f} {r['bi_tb_s']:8.2f} {r['bi_tflops']:10.1f} "
            f"{r['torch_tflops']:13.1f}  {r['path']}")
    return out


def linear_variants() -> dict[str, Any]:
    """Speed of alternatives (different bits!): K-segment counts at decode, tiles at prefill."""
    out: dict[str, Any] = {}
    dt = torch.bfloat16
    few, many = ck._tiles(dt)
    log("decode, bf16: us per call by number of K segments S (split path; S1 = fused)")
    for sname in ("q_o", "k_v", "qkv", "gate_up", "down"):
        n, k = C.linear_shapes[sname]
        for m in (1, C.batch):
            fns: dict[str, Callable[..., torch.Tensor]] = {}
            for segs in (1, 2, 4, 8, 16):
                seg = k // segs
                if seg % few.block_k or k % segs:
                    continue
                fns[f"S{segs}"] = (lambda x, w, seg=seg: ck._launch_linear(
                    x, w, None, few, True, k_segment=seg))
            fns["torch"] = F.linear
            r = time_linear_case(dt, m, n, k, fns)
            out[f"segments/{sname}/{m}"] = r
            log(f"  {sname:8s} M={m:3d} " + " ".join(f"{kk}={v:.1f}" for kk, v in r.items()))
    log("decode, bf16, one-segment weights: us per call, pointer loads vs TMA (few-row tile)")
    for sname in ("gate_up_fused", "lm_head"):
        n, k = C.linear_shapes[sname]
        for m in (1, C.batch):
            r = time_linear_case(dt, m, n, k, {
                "pointer": lambda x, w: ck._launch_linear(x, w, None, few, False, tma=False),
                "tma": lambda x, w: ck._launch_linear(x, w, None, few, False, tma=True),
                "torch": F.linear})
            out[f"decode_tma/{sname}/{m}"] = r
            log(f"  {sname:14s} M={m:3d} " + " ".join(f"{kk}={v:.1f}" for kk, v in r.items()))
    log(f"prefill, bf16, M={C.variant_m}: TFLOP/s by tile and loads (fused path)")
    tiles = {"ptr128x128w8s4": (many, False), "tma128x128w8s4": (many, True),
             "tma128x128w8s3": (ck._Tile(128, 128, 64, 8, 3), True),
             "tma128x256w8s3": (ck._Tile(128, 256, 64, 8, 3), True),
             "tma64x128w4s4": (few, True)}
    for sname in ("q_o", "qkv", "down", "gate_up_fused"):
        n, k = C.linear_shapes[sname]
        m = C.variant_m
        one_seg = ck.linear_k_segment(n, k, dt) >= k
        fns = {name: (lambda x, w, t=t, tma=tma: ck._launch_linear(x, w, None, t, False,
                                                                   tma=tma))
               for name, (t, tma) in tiles.items() if t.block_n != 256 or one_seg}
        fns["torch"] = F.linear
        r = time_linear_case(dt, m, n, k, fns)
        tfl = {kk: 2 * m * n * k / (v * 1e-6) / 1e12 for kk, v in r.items()}
        out[f"tiles/{sname}/{m}"] = {"us": r, "tflops": tfl}
        log(f"  {sname:14s} " + " ".join(f"{kk}={v:.0f}" for kk, v in tfl.items()))
    return out


# Launch variants at the decode sizes: (block_n, block_k, warps, stages) of the few-row tile
# (the first is the fused path's; the split path's is 64x64x64, 4 warps, 6 stages), and (split
# size, keys per step, warps, stages) of decode attention (the first is today's). Each output
# is compared with bi_linear's / bi_decode_attention's.
DECODE_LINEAR_TILES = [(128, 64, 4, 4), (128, 64, 4, 5), (128, 64, 4, 6), (128, 128, 4, 3),
                       (128, 128, 4, 4), (64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 4),
                       (64, 128, 4, 5), (32, 128, 4, 4), (32, 64, 4, 6), (256, 64, 8, 3),
                       (256, 64, 8, 4), (128, 64, 8, 4)]
DECODE_ATTENTION_LAUNCHES = [(256, 64, 4, 3), (256, 64, 4, 2), (256, 64, 4, 4), (256, 64, 8, 3),
                             (256, 32, 4, 3), (256, 128, 4, 3), (256, 128, 8, 3),
                             (256, 128, 4, 2), (128, 64, 4, 3), (512, 64, 4, 3),
                             (512, 128, 8, 3)]


def _launch_errors() -> tuple[type[Exception], ...]:
    """What a launch variant the GPU cannot run raises (shared memory, registers)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return (OutOfResources, CompilationError, RuntimeError)


def _linear_inputs(sname: str, m: int, dt: torch.dtype) -> tuple[
        int, int, int, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(n, k, K segment, inputs, weights, bi_linear's outputs of the first three) for one
    of ``C.linear_shapes`` at ``m`` rows; enough input sets to rotate past the L2."""
    n, k = C.linear_shapes[sname]
    sets = n_sets((n * k + m * k) * dt.itemsize)
    ws = [randn(n, k, dt=dt) / math.sqrt(k) for _ in range(sets)]
    xs = [randn(m, k, dt=dt) for _ in range(sets)]
    refs = [ck.bi_linear(xs[i], ws[i]) for i in range(min(3, sets))]
    return n, k, ck.linear_k_segment(n, k, dt), xs, ws, refs


def decode_tiles() -> dict[str, Any]:
    """At the decode batch: each launch variant's time and whether its bits equal today's.

    Linear variants keep the segment policy (it is computed from the default tile), so any
    bit difference comes from the tile itself; attention variants with another split size
    or keys per step are expected to differ (NUMERICS), warps and stages are not.
    """
    errors = _launch_errors()
    out: dict[str, Any] = {}
    dt = torch.bfloat16
    m = C.batch
    log(f"decode linears, bf16, M={m}: us per call (mismatching outputs of 3 vs today's path)")
    for sname in ("qkv", "q_o", "down", "gate_up_fused", "lm_head"):
        n, k, seg, xs, ws, refs = _linear_inputs(sname, m, dt)
        row: dict[str, Any] = {}
        for bn, bk, warps, stages in DECODE_LINEAR_TILES if not C.dry else DECODE_LINEAR_TILES[:2]:
            if seg % bk:
                continue
            tile = ck._Tile(64, bn, bk, warps, stages)
            for split in ((True, False) if ck._can_split(k, seg) else (False,)):
                name = f"{bn}x{bk}w{warps}s{stages}{'split' if split else 'fused'}"

                def fn(x: torch.Tensor, w: torch.Tensor, tile: ck._Tile = tile,
                       split: bool = split) -> torch.Tensor:
                    return ck._launch_linear(x, w, None, tile, split, tma=False)

                try:
                    bad = sum(not torch.equal(fn(xs[i], ws[i]), r) for i, r in enumerate(refs))
                    us = graph_time_us([lambda x=x, w=w, fn=fn: fn(x, w)
                                        for x, w in zip(xs, ws, strict=True)])
                except errors as exc:  # out of shared memory, registers: record it
                    row[name] = {"error": str(exc).splitlines()[0][:120]}
                    continue
                row[name] = {"us": us, "mismatch": bad,
                             "tb_s": (n * k + m * (n + k)) * dt.itemsize / (us * 1e-6) / 1e12}
        row["torch"] = {"us": graph_time_us([lambda x=x, w=w: F.linear(x, w)
                                             for x, w in zip(xs, ws, strict=True)])}
        out[f"linear/{sname}/{m}"] = row
        log(f"  {sname} {n}x{k} (segment {seg}): " + " ".join(
            f"{kk}={v['us']:.1f}" + (f"!{v['mismatch']}" if v.get("mismatch") else "")
            if "us" in v else f"{kk}=ERR" for kk, v in row.items()))
        del ws, xs, refs
    scale = 1 / math.sqrt(C.head_dim)
    hkv, hq, d = C.n_kv_heads, C.n_heads, C.head_dim
    s_alloc = 1024 if not C.dry else C.dec_s[0]
    lo, hi = (C.prompt, C.prompt + 256) if not C.dry else (4, s_alloc)
    gen = torch.Generator(device="cpu").manual_seed(7)
    args = []
    for _ in range(n_sets(2 * m * hkv * s_alloc * d * 2)):
        kc = randn(m, hkv, s_alloc, d, dt=dt)
        lens = torch.randint(lo, hi + 1, (m,), generator=gen, dtype=torch.int32)
        args.append((randn(m, hq, d, dt=dt), kc, torch.randn_like(kc), lens.to(C.dev)))
    kv_bytes = sum(2 * hkv * int(a[3].sum()) * d * 2 for a in args) / len(args)
    refs_a = [ck.bi_decode_attention(*a, scale) for a in args[:3]]
    row = {}
    for split, bn, warps, stages in (DECODE_ATTENTION_LAUNCHES if not C.dry
                                     else DECODE_ATTENTION_LAUNCHES[:2]):
        name = f"split{split}n{bn}w{warps}s{stages}"

        def fa(a: tuple[torch.Tensor, ...], split: int = split, bn: int = bn,
               warps: int = warps, stages: int = stages) -> torch.Tensor:
            return ck._launch_decode_attention(*a, scale, split_size=split, block_n=bn,
                                               num_warps=warps, num_stages=stages)

        try:
            bad = sum(not torch.equal(fa(a), r) for a, r in zip(args, refs_a, strict=False))
            us = graph_time_us([lambda a=a, fa=fa: fa(a) for a in args])
        except errors as exc:
            row[name] = {"error": str(exc).splitlines()[0][:120]}
            continue
        row[name] = {"us": us, "mismatch": bad, "kv_tb_s": kv_bytes / (us * 1e-6) / 1e12}
    out[f"decode_attention/B{m}/L{lo}-{hi}/S{s_alloc}"] = row
    log(f"  decode attention B={m} lens {lo}..{hi} S={s_alloc} (KV {kv_bytes / 1e6:.0f} MB): " +
        " ".join(f"{kk}={v['us']:.1f}/{v['kv_tb_s']:.2f}TB/s"
                 + (f"!{v['mismatch']}" if v.get("mismatch") else "")
                 if "us" in v else f"{kk}=ERR" for kk, v in row.items()))
    return out


#: (block_m, block_n, warps, stages, split, tma) tried at a prompt forward's row counts
#: (block_k 64 and the segment policy stay, so every variant should give today's bits).
PROMPT_TILES = [(128, 128, 8, 4, False, True), (128, 128, 8, 4, False, False),
                (64, 64, 4, 6, True, False), (64, 128, 4, 4, True, False),
                (128, 64, 4, 4, True, False), (128, 128, 8, 4, True, False),
                (128, 128, 4, 4, True, False), (64, 128, 4, 4, False, False),
                (64, 64, 4, 6, False, False), (128, 64, 4, 4, False, False),
                # 2026-12-04, session 14: wider tiles and fewer stages for 160-256 rows
                (128, 256, 8, 3, False, True), (128, 256, 8, 3, False, False),
                (64, 256, 4, 3, False, False), (64, 128, 4, 3, False, False),
                (64, 128, 8, 4, False, False), (128, 128, 8, 3, False, False),
                (256, 128, 8, 3, False, False), (64, 128, 4, 5, True, False),
                (128, 128, 8, 3, True, False), (64, 256, 4, 3, True, False)]
#: Row counts of the prompt-tiles section: a 128-token prompt; mixed steps of decode rows
#: and one prompt (152 rows pad to the 192-row bucket); two prompts.
PROMPT_ROWS = (128, 160, 192, 256)


def prompt_tiles() -> dict[str, Any]:
    """At a prompt forward's row counts (a 128-token prompt, a mixed step of 64 decode rows
    and one, two prompts): each tile's time per layer linear and whether its bits equal
    bi_linear's (they should: tiles, splits and loads only decide which rows and columns run
    together). Until 2026-12-04 the 128-row tile ran all of them unsplit (48, 32 and 32
    programs for qkv, o and down at 128 rows, on 132 SMs); "today" names bi_linear's path."""
    out: dict[str, Any] = {}
    dt = torch.bfloat16
    for m in (PROMPT_ROWS if not C.dry else (5, 9)):
        log(f"prompt linears, bf16, M={m}: us per call (!n: mismatching outputs of 3; "
            "gate_up with its silu * up epilogue, TMA then silu_mul: two launches)")
        total: dict[str, float] = {}
        for sname in ("qkv", "q_o", "gate_up_fused", "down"):
            n, k, seg, xs, ws, refs = _linear_inputs(sname, m, dt)
            silu = sname == "gate_up_fused"
            if silu:  # what the engine runs: the product and silu(gate) * up
                refs = [ck.linear_silu_mul(xs[i], ws[i]) for i in range(len(refs))]
            tile_now, split_now = ck._linear_path(m, n, k, dt)
            row: dict[str, Any] = {}
            variants = PROMPT_TILES if not C.dry else PROMPT_TILES[:3]
            for bm, bn, warps, stages, split, tma in variants:
                if split and not ck._can_split(k, seg):
                    continue
                if tma and C.dry:
                    continue
                tile = ck._Tile(bm, bn, 64, warps, stages)
                name = (f"{bm}x{bn}w{warps}s{stages}{'split' if split else ''}"
                        f"{'tma' if tma else ''}")

                def fn(x: torch.Tensor, w: torch.Tensor, tile: ck._Tile = tile,
                       split: bool = split, tma: bool = tma, silu: bool = silu
                       ) -> torch.Tensor:
                    if silu and tma:
                        return ck.silu_mul(*ck._launch_linear(x, w, None, tile, split,
                                                              tma=True).chunk(2, dim=-1))
                    return ck._launch_linear(x, w, None, tile, split, tma=tma,
                                             epilogue=ck._SILU_MUL if silu else ck._STORE)

                def bad(fn: Callable[..., torch.Tensor] = fn, xs: list[torch.Tensor] = xs,
                        ws: list[torch.Tensor] = ws, refs: list[torch.Tensor] = refs) -> int:
                    return sum(not torch.equal(fn(xs[i], ws[i]), r) for i, r in enumerate(refs))

                _time_variant(row, name, fn, xs, ws, bad)
                if "us" in row[name]:
                    total[name] = total.get(name, 0.0) + row[name]["us"]
            row["torch"] = {"us": graph_time_us([lambda x=x, w=w: F.linear(x, w)
                                                 for x, w in zip(xs, ws, strict=True)])}
            total["torch"] = total.get("torch", 0.0) + row["torch"]["us"]
            row["today"] = (f"{tile_now.block_m}x{tile_now.block_n}w{tile_now.num_warps}"
                            f"{' split' if split_now else ''}")
            out[f"prompt_linear/{sname}/{m}"] = row
            _log_row(f"  {sname} {n}x{k} (segment {seg}; today {row['today']}): ",
                     {kk: v for kk, v in row.items() if kk != "today"})
            del ws, xs, refs
        out[f"prompt_layer/{m}"] = total
        log("  sum of the four (us per layer): " + " ".join(
            f"{kk}={v:.1f}" for kk, v in sorted(total.items(), key=lambda kv: kv[1])))
    return out


#: (block_n, warps, stages) of the few-row tile tried for each fused epilogue at the decode
#: batch (block_m 64, block_k 64: the NUMERICS fields stay).
EPILOGUE_TILES = [(128, 4, 4), (128, 4, 5), (64, 4, 6), (64, 4, 4), (128, 8, 4)]


def fused_epilogues() -> dict[str, Any]:
    """At the decode batch: the gate/up product with silu(gate) * up in its store, and the
    qkv product with RoPE + the KV write in its store, against the two launches each (us
    per pair of ops in a graph; mismatching outputs of 3 vs the two launches)."""
    out: dict[str, Any] = {}
    dt, m = torch.bfloat16, C.batch
    hq, hkv, d = C.n_heads, C.n_kv_heads, C.head_dim
    n, k = C.linear_shapes["gate_up_fused"]
    sets = n_sets((n * k + m * k) * dt.itemsize)
    ws = [randn(n, k, dt=dt) / math.sqrt(k) * 4 for _ in range(sets)]
    xs = [randn(m, k, dt=dt) for _ in range(sets)]

    def two(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ck.silu_mul(*ck.bi_linear(x, w).chunk(2, dim=-1))

    refs = [two(xs[i], ws[i]) for i in range(min(3, sets))]
    row: dict[str, Any] = {"two launches": {"us": graph_time_us(
        [lambda x=x, w=w: two(x, w) for x, w in zip(xs, ws, strict=True)])}}
    for bn, warps, stages in EPILOGUE_TILES if not C.dry else EPILOGUE_TILES[:1]:
        tile = ck._Tile(64, bn, 64, warps, stages)

        def one(x: torch.Tensor, w: torch.Tensor, tile: ck._Tile = tile) -> torch.Tensor:
            return ck._launch_linear(x, w, None, tile, False, epilogue=ck._SILU_MUL)

        _time_variant(row, f"fused {bn}w{warps}s{stages}", one, xs, ws,
                      lambda one=one, xs=xs, ws=ws, refs=refs: sum(
                          not torch.equal(one(xs[i], ws[i]), r) for i, r in enumerate(refs)))
    out[f"gate_up+silu_mul/{m}"] = row
    _log_row(f"  gate_up {n}x{k} + silu_mul, M={m}: ", row)
    del ws, xs, refs

    n, k = C.linear_shapes["qkv"]
    s_alloc = 1024 if not C.dry else C.dec_s[0]
    sets = n_sets((n * k + m * k) * dt.itemsize)
    ws = [randn(n, k, dt=dt) / math.sqrt(k) * 4 for _ in range(sets)]
    xs = [randn(m, k, dt=dt) for _ in range(sets)]
    pos = torch.randint(0, s_alloc, (m,), device=C.dev)
    slots = torch.arange(m, device=C.dev)
    ang = torch.rand(m, d // 2, device=C.dev) * 6.28
    cos, sin = ang.cos(), ang.sin()
    kc, vc = torch.zeros(m, hkv, s_alloc, d, dtype=dt, device=C.dev), \
        torch.zeros(m, hkv, s_alloc, d, dtype=dt, device=C.dev)

    def two_r(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q, _ = ck.rope_qkv_to_cache(ck.bi_linear(x, w), cos, sin, kc, vc, slots, pos, hq, hkv,
                                    return_k=False)
        return q

    def state(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return q.clone(), kc[slots, :, pos].clone(), vc[slots, :, pos].clone()

    refs_r = [state(two_r(xs[i], ws[i])) for i in range(min(3, sets))]
    row = {"two launches": {"us": graph_time_us(
        [lambda x=x, w=w: two_r(x, w) for x, w in zip(xs, ws, strict=True)])}}
    rope = ck._RopeKV(cos, sin, slots, pos, kc, vc, hq, hkv)
    variants = [(ck._split_tile(dt), True)] + [
        (ck._Tile(64, bn, 64, warps, stages), split)
        for bn, warps, stages in (EPILOGUE_TILES[:3] if not C.dry else [])
        for split in (True, False)]
    for tile, split in variants:
        if (d // 2) % (tile.block_n // 2):
            continue

        def one_r(x: torch.Tensor, w: torch.Tensor, tile: ck._Tile = tile,
                  split: bool = split) -> torch.Tensor:
            return ck._launch_linear(x, w, None, tile, split, epilogue=ck._ROPE_KV, rope=rope)

        def bad_r(one_r: Callable[..., torch.Tensor] = one_r) -> int:
            return sum(any(not torch.equal(a, b) for a, b in
                           zip(state(one_r(xs[i], ws[i]).view(m, hq, d)), r, strict=True))
                       for i, r in enumerate(refs_r))

        _time_variant(row, f"fused {tile.block_n}w{tile.num_warps}s{tile.num_stages}"
                      f"{'split' if split else ''}", one_r, xs, ws, bad_r)
    out[f"qkv+rope_kv/{m}"] = row
    _log_row(f"  qkv {n}x{k} + RoPE/KV write, M={m}: ", row)
    return out


def _time_variant(row: dict[str, Any], name: str, fn: Callable[..., torch.Tensor],
                  xs: list[torch.Tensor], ws: list[torch.Tensor],
                  mismatches: Callable[[], int]) -> None:
    """row[name]: fn's us per call over the input sets and its mismatching outputs (or the
    error of a launch the GPU cannot run)."""
    try:
        bad = mismatches()
        us = graph_time_us([lambda x=x, w=w: fn(x, w) for x, w in zip(xs, ws, strict=True)])
    except _launch_errors() as exc:
        row[name] = {"error": str(exc).splitlines()[0][:120]}
        return
    row[name] = {"us": us, "mismatch": bad}


def _log_row(label: str, row: dict[str, Any]) -> None:
    log(label + " ".join(
        f"{kk}={v['us']:.1f}" + (f"!{v['mismatch']}" if v.get("mismatch") else "")
        if "us" in v else f"{kk}=ERR" for kk, v in row.items()))


def other_timings() -> dict[str, Any]:
    out: dict[str, Any] = {}
    dt = torch.bfloat16
    scale = 1 / math.sqrt(C.head_dim)
    hkv, hq, d = C.n_kv_heads, C.n_heads, C.head_dim
    big_t = C.batch * C.prompt
    for m in (C.batch, big_t):
        xs = [randn(m, C.hidden, dt=dt) for _ in range(n_sets(m * C.hidden * 2))]
        w = randn(C.hidden, dt=dt)

        def torch_rms(x: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt) * w

        r = {
            "bi": graph_time_us([lambda x=x, w=w: ck.bi_rms_norm(x, w, 1e-5) for x in xs]),
            "torch_eager_formula": graph_time_us([lambda x=x: torch_rms(x) for x in xs]),
            "F.rms_norm": graph_time_us([lambda x=x, w=w: F.rms_norm(x, (C.hidden,), w, 1e-5)
                                         for x in xs]),
        }
        out[f"rms_norm/{m}"] = r
        log(f"rms_norm M={m}: " + " ".join(f"{kk}={v:.1f}us" for kk, v in r.items()))
    for m in (1, C.batch):
        xs = [randn(m, C.vocab, dt=dt) for _ in range(n_sets(m * C.vocab * 2))]
        r = {"bi": graph_time_us([lambda x=x: ck.bi_log_softmax(x) for x in xs]),
             "torch": graph_time_us([lambda x=x: torch.log_softmax(x.float(), -1) for x in xs])}
        out[f"log_softmax/{m}"] = r
        log(f"log_softmax M={m}: " + " ".join(f"{kk}={v:.1f}us" for kk, v in r.items()))
    s_alloc = C.prompt + 256 if not C.dry else C.dec_s[0]
    for b, seq, s in ((1, C.mean_ctx, s_alloc), (8, C.mean_ctx, s_alloc),
                      (C.batch, C.prompt, s_alloc), (C.batch, C.mean_ctx, s_alloc),
                      (C.batch, s_alloc, s_alloc), (C.batch, C.mean_ctx, C.dec_s[2])):
        args = []
        for _ in range(n_sets(2 * b * hkv * s * d * 2)):
            kc = randn(b, hkv, s, d, dt=dt)
            args.append((randn(b, hq, d, dt=dt), kc, torch.randn_like(kc),
                         torch.full((b,), seq, dtype=torch.int32, device=C.dev)))
        r = {
            "bi": graph_time_us([lambda a=a: ck.bi_decode_attention(*a, scale) for a in args]),
            "sdpa_masked_full_cache": graph_time_us(
                [lambda a=a: sdpa_decode(*a, scale) for a in args]),
            "sdpa_exact_len": graph_time_us([
                lambda a=a, seq=seq: F.scaled_dot_product_attention(
                    a[0].unsqueeze(2), a[1][:, :, :seq], a[2][:, :, :seq], scale=scale,
                    enable_gqa=True) for a in args]),
        }
        r["bi_tb_s"] = 2 * b * hkv * seq * d * 2 / (r["bi"] * 1e-6) / 1e12
        out[f"decode_attention/B{b}/L{seq}/S{s}"] = r
        log(f"decode_attention B={b} L={seq} S={s}: " +
            " ".join(f"{kk}={v:.1f}" for kk, v in r.items()))
        del args

    def packed(b: int, seq: int) -> tuple[torch.Tensor, ...]:
        t = b * seq
        return (randn(t, hq, d, dt=dt), randn(t, hkv, d, dt=dt), randn(t, hkv, d, dt=dt),
                torch.arange(0, t + 1, seq, dtype=torch.int32, device=C.dev))

    for b in (1, C.batch):
        seq = C.prompt
        q, k, v, cu = packed(b, seq)
        qb = q.view(b, seq, hq, d).transpose(1, 2)
        kb = k.view(b, seq, hkv, d).transpose(1, 2)
        vb = v.view(b, seq, hkv, d).transpose(1, 2)
        kb_rep = kb.repeat_interleave(hq // hkv, 1)
        vb_rep = vb.repeat_interleave(hq // hkv, 1)
        r = {  # each lambda is timed before the next iteration rebinds its tensors
            "bi": graph_time_us([lambda: ck.bi_prefill_attention(
                q, k, v, cu, scale)]),  # noqa: B023
            "sdpa_gqa": graph_time_us([lambda: F.scaled_dot_product_attention(
                qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)]),  # noqa: B023
            "sdpa_repeated_kv": graph_time_us([lambda: F.scaled_dot_product_attention(
                qb, kb_rep, vb_rep, is_causal=True, scale=scale)]),  # noqa: B023
        }
        r["bi_tflops"] = 4 * b * hq * d * seq * seq / 2 / (r["bi"] * 1e-6) / 1e12
        out[f"prefill_attention/B{b}/L{seq}"] = r
        log(f"prefill_attention B={b} L={seq}: " +
            " ".join(f"{kk}={v_:.1f}" for kk, v_ in r.items()))
    # prefill attention tiles (different bits: informative)
    base = ck._PREFILL_16
    alts = {}
    q, k, v, cu = packed(C.batch, C.prompt)
    try:
        for cfg in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)):
            ck._PREFILL_16 = cfg
            alts[str(cfg)] = graph_time_us([lambda: ck.bi_prefill_attention(q, k, v, cu, scale)])
    finally:
        ck._PREFILL_16 = base
    out["prefill_attention_tiles"] = alts
    log("prefill_attention tiles (BM, BN, warps, stages) us: " +
        " ".join(f"{kk}={v_:.1f}" for kk, v_ in alts.items()))
    return out


def eager_overhead() -> dict[str, Any]:
    dt = torch.bfloat16
    n, k = C.linear_shapes["k_v"]
    x, w = randn(1, k, dt=dt), randn(n, k, dt=dt)
    xs, wn = randn(1, C.hidden, dt=dt), randn(C.hidden, dt=dt)
    q = randn(1, C.n_heads, C.head_dim, dt=dt)
    kc = randn(1, C.n_kv_heads, C.dec_s[0], C.head_dim, dt=dt)
    lens = torch.full((1,), 7, dtype=torch.int32, device=C.dev)
    r = {
        "bi_linear": eager_us(lambda: ck.bi_linear(x, w)),
        "F.linear": eager_us(lambda: F.linear(x, w)),
        "bi_rms_norm": eager_us(lambda: ck.bi_rms_norm(xs, wn, 1e-5)),
        "bi_decode_attention": eager_us(lambda: ck.bi_decode_attention(q, kc, kc, lens, 0.1)),
        "sdpa_decode": eager_us(lambda: sdpa_decode(q, kc, kc, lens, 0.1)),
    }
    log("eager wall us per call (tiny shapes: launch cost): " +
        " ".join(f"{kk}={v:.1f}" for kk, v in r.items()))
    return r


def event_time_us(call: Callable[[], Any], n: int = 20) -> float:
    """Median device+host microseconds per call, timed eagerly (for ops with host syncs)."""
    if C.dry:
        return graph_time_us([call])
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(n):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / n)
    return statistics.median(times)


def engine_default_timings() -> dict[str, Any]:
    """The reference engine's own default (non-invariant) ops, where they exist.

    ``workers.engine.torch_kernels.fast_*`` sync with the host (``.item()``/``.tolist()``),
    so they are timed eagerly, not in a CUDA graph.
    """
    from workers.engine import torch_kernels as tk

    out: dict[str, Any] = {}
    dt = torch.bfloat16
    scale = 1 / math.sqrt(C.head_dim)
    hkv, hq, d = C.n_kv_heads, C.n_heads, C.head_dim
    b, big_t = C.batch, C.batch * C.prompt
    s_alloc = C.prompt + 256 if not C.dry else C.dec_s[0]
    kc = randn(b, hkv, s_alloc, d, dt=dt)
    vc = torch.randn_like(kc)
    q = randn(b, hq, d, dt=dt)
    lens = torch.full((b,), C.mean_ctx, dtype=torch.int32, device=C.dev)
    out["fast_decode_attention"] = event_time_us(
        lambda: tk.fast_decode_attention(q, kc, vc, lens, scale))
    out["bi_decode_attention"] = event_time_us(
        lambda: ck.bi_decode_attention(q, kc, vc, lens, scale))
    qp, kp, vp = (randn(big_t, h, d, dt=dt) for h in (hq, hkv, hkv))
    cu = torch.arange(0, big_t + 1, C.prompt, dtype=torch.int32, device=C.dev)
    out["fast_prefill_attention"] = event_time_us(
        lambda: tk.fast_prefill_attention(qp, kp, vp, cu, scale), n=3)
    out["bi_prefill_attention"] = event_time_us(
        lambda: ck.bi_prefill_attention(qp, kp, vp, cu, scale), n=3)
    x, w = randn(b, C.hidden, dt=dt), randn(C.hidden, dt=dt)
    out["fast_rms_norm"] = event_time_us(lambda: tk.fast_rms_norm(x, w, 1e-5))
    n, k = C.linear_shapes["q_o"]
    xl, wl = randn(b, k, dt=dt), randn(n, k, dt=dt)
    out["torch_kernels.bi_linear_q_o"] = event_time_us(lambda: tk.bi_linear(xl, wl))
    out["bi_linear_q_o"] = event_time_us(lambda: ck.bi_linear(xl, wl))
    out["F.linear_q_o"] = event_time_us(lambda: F.linear(xl, wl))
    log("engine default ops (eager, events) us: " +
        " ".join(f"{kk}={v:.1f}" for kk, v in out.items()))
    return out


# ---------------------------------------------------------------------------------------
# 5. Llama-3-8B step estimate
# ---------------------------------------------------------------------------------------


def step_estimate() -> dict[str, Any]:
    lt = RESULTS["linear timings"]
    ot = RESULTS["other timings"]
    bw = RESULTS.get("copy bandwidth", {}).get("copy_tb_s")
    b, big_t = C.batch, C.batch * C.prompt
    s_alloc = C.prompt + 256 if not C.dry else C.dec_s[0]

    def lin(sname: str, m: int, which: str) -> float:
        return float(lt[f"bf16/{sname}/{m}"][which])

    eng = RESULTS.get("engine default timings", {})
    out: dict[str, Any] = {}
    variants = [
        ("bi", "bi", "bi", "bi", "bi"),
        ("torch", "sdpa_masked_full_cache", "torch_eager_formula", "torch", "sdpa_gqa"),
    ]
    if "fast_decode_attention" in eng:
        variants.append(("engine_fast", "fast_decode_attention", "torch_eager_formula", "torch",
                         "fast_prefill_attention"))
    for which, attn_key, rms_key, lsm_key, p_attn in variants:
        lin_key = "bi" if which == "bi" else "torch"
        rms_d, rms_p = ot[f"rms_norm/{b}"][rms_key], ot[f"rms_norm/{big_t}"][rms_key]
        dec_attn = ot[f"decode_attention/B{b}/L{C.mean_ctx}/S{s_alloc}"]
        pre_attn = ot[f"prefill_attention/B{b}/L{C.prompt}"]
        decode_parts = {
            "rms_norm x2": 2 * rms_d,
            "qkv": lin("qkv", b, lin_key),
            "attention": eng[attn_key] if attn_key.startswith("fast") else dec_attn[attn_key],
            "o": lin("q_o", b, lin_key),
            "gate_up": lin("gate_up_fused", b, lin_key),
            "down": lin("down", b, lin_key),
        }
        final = rms_d + lin("lm_head", b, lin_key) + ot[f"log_softmax/{b}"][lsm_key]
        decode_us = C.n_layers * sum(decode_parts.values()) + final
        prefill_parts = {
            "rms_norm x2": 2 * rms_p,
            "qkv": lin("qkv", big_t, lin_key),
            "attention": eng[p_attn] if p_attn.startswith("fast") else pre_attn[p_attn],
            "o": lin("q_o", big_t, lin_key),
            "gate_up": lin("gate_up_fused", big_t, lin_key),
            "down": lin("down", big_t, lin_key),
        }
        prefill_us = C.n_layers * sum(prefill_parts.values()) + final
        out[which] = {"decode_step_us": decode_us, "decode_layer_parts_us": decode_parts,
                      "decode_final_us": final, "prefill_us": prefill_us,
                      "prefill_layer_parts_us": prefill_parts,
                      "total_ms": (prefill_us + 256 * decode_us) / 1000}
    h, i, kv = C.hidden, C.inter, C.linear_shapes["k_v"][0]
    wbytes = 2 * (C.n_layers * (h * (h + 2 * kv) + h * h + 3 * h * i) + C.vocab * h)
    out["weight_bytes"] = wbytes
    roof_us = wbytes / (bw * 1e12) * 1e6 if bw else float("nan")
    out["roofline_decode_step_us"] = roof_us
    names = [v[0] for v in variants]
    for which in names:
        out[which]["roofline_fraction"] = roof_us / out[which]["decode_step_us"]
    for base in names[1:]:
        sfx = "" if base == "torch" else f"_{base}"
        out[f"overhead_vs_torch{sfx}"] = out["bi"]["total_ms"] / out[base]["total_ms"] - 1
        out[f"decode_overhead_vs_torch{sfx}"] = (
            out["bi"]["decode_step_us"] / out[base]["decode_step_us"] - 1)
        out[f"prefill_overhead_vs_torch{sfx}"] = (
            out["bi"]["prefill_us"] / out[base]["prefill_us"] - 1)
    log(f"Llama-3-8B, {b} x ({C.prompt} prompt + 256 output), bf16, sum of kernel times "
        f"(CUDA graphs; rope, embedding, sampling, KV writes excluded; attention at the mean "
        f"context {C.mean_ctx}):")
    for which in names:
        o = out[which]
        log(f"  {which:11s}: decode step {o['decode_step_us']:.0f} us "
            f"({100 * o['roofline_fraction']:.0f}% of roofline), "
            f"prefill {o['prefill_us'] / 1000:.1f} ms, total {o['total_ms']:.0f} ms")
        log("         decode layer: " + " ".join(
            f"{kk}={v:.0f}" for kk, v in o["decode_layer_parts_us"].items()) +
            f" | final {o['decode_final_us']:.0f}")
        log("         prefill layer: " + " ".join(
            f"{kk}={v:.0f}" for kk, v in o["prefill_layer_parts_us"].items()))
    log(f"  roofline decode step: {roof_us:.0f} us ({wbytes / 1e9:.2f} GB of weights at "
        f"{bw} TB/s)")
    for base in names[1:]:
        sfx = "" if base == "torch" else f"_{base}"
        log(f"  invariant-mode overhead vs {base}: total "
            f"{100 * out[f'overhead_vs_torch{sfx}']:.1f}%, decode "
            f"{100 * out[f'decode_overhead_vs_torch{sfx}']:.1f}%, prefill "
            f"{100 * out[f'prefill_overhead_vs_torch{sfx}']:.1f}%")
    return out


def main() -> None:
    global C
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--only", default="", help="comma-separated section name prefixes")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU (Triton interpreter): checks this script only")
    args = ap.parse_args()
    if args.dry_run:
        C = Cfg.dry_run()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    RESULTS["env"] = {
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "kernels_version": ck.KERNELS_VERSION, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if C.dev.type == "cuda":
        props = torch.cuda.get_device_properties(C.dev)
        RESULTS["env"].update(gpu=props.name, sms=props.multi_processor_count,
                              l2_mb=getattr(props, "L2_cache_size", 0) / 2**20)
    log(json.dumps(RESULTS["env"]))
    sections = [
        ("copy bandwidth", copy_bandwidth),
        ("linear invariance", linear_invariance),
        ("tile equivalence", tile_equivalence),
        ("norm/softmax invariance", norm_softmax_invariance),
        ("decode attention invariance", decode_attention_invariance),
        ("prefill attention invariance", prefill_attention_invariance),
        ("eager overhead", eager_overhead),
        ("linear timings", linear_timings),
        ("other timings", other_timings),
        ("engine default timings", engine_default_timings),
        ("step estimate", step_estimate),
        ("linear variants", linear_variants),
        ("decode tiles", decode_tiles),
        ("fused epilogues", fused_epilogues),
        ("prompt tiles", prompt_tiles),
    ]
    only = [s for s in args.only.split(",") if s]
    for name, fn in sections:
        if only and not any(name.startswith(o) for o in only):
            continue
        section(name, fn)
        (args.out / "kernels_cuda.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        (args.out / "kernels_cuda.txt").write_text("\n".join(LINES) + "\n")
        if C.dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
