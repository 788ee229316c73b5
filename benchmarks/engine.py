"""Reference engine throughput: batch-invariant mode vs the default mode, in the same run.

    PYTHONUNBUFFERED=1 python3 benchmarks/engine.py --device cuda [--out DIR]
    .venv/bin/python benchmarks/engine.py --device cpu

``--device cuda`` (issue 4, acceptance 4): Llama-3-8B shapes, bf16, random weights drawn on
the GPU; 64 requests of 512 random prompt tokens and 256 new tokens (greedy, ignore_eos),
run as one batch through ``ReferenceEngine.generate`` (prefill, CUDA-graph decode steps,
sampling, logprobs and per-step logits digests: the whole engine). Each mode runs
``--repeats`` times, alternating; the table shows medians. Also measured in the same run:
the device-to-device copy bandwidth (the roofline's ceiling) and the decode step alone
(the captured graph replayed at 64 rows and context 640, CUDA events).

Roofline: weight bytes read per decode step (every linear weight, the norms and the LM
head; the embedding rows are negligible) over the measured copy bandwidth. KV-cache reads
(~5 GB per step at the mean context of 640) come on top and are shown separately.

``--device cpu``: tiny-demo, 64 requests of 32 prompt and 32 new tokens, max_batch 1, 8
and 64, one intra-op thread (the engine default), fp32 (and bf16 at 64).

Needs only torch (+ triton on CUDA): no database, no ``ledger`` imports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine import ReferenceEngine, load_engine, ops
from workers.engine.api import GenerationRequest, SamplingParams
from workers.engine.config import LLAMA3_8B_CONFIG


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def make_requests(n: int, prompt: int, output: int, vocab: int, seed: int = 0
                  ) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [GenerationRequest(f"r{i}", tuple(rng.randrange(vocab) for _ in range(prompt)),
                              SamplingParams(max_tokens=output, ignore_eos=True))
            for i in range(n)]


def run_once(engine: ReferenceEngine, requests: list[GenerationRequest], max_batch: int,
             batch_invariant: bool) -> dict[str, float]:
    engine.batch_invariant = batch_invariant
    results = engine.generate(requests, max_batch=max_batch)
    s = engine.stats
    want = sum(r.sampling.max_tokens for r in requests)
    assert s.generated_tokens == want, (s.generated_tokens, want)
    assert all(len(r.logits_sha256) == len(r.token_ids) for r in results)
    return {
        "total_s": s.total_s, "prefill_s": s.prefill_s, "decode_s": s.decode_s,
        "digest_wait_s": s.digest_wait_s, "decode_steps": s.decode_steps,
        "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
        "prefill_tok_s": s.prompt_tokens / s.prefill_s,
        "decode_tok_s": s.generated_tokens / s.decode_s,
        "total_tok_s": s.generated_tokens / s.total_s,
        "step_ms": 1e3 * s.decode_s / max(s.decode_steps, 1),
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# --------------------------------------------------------------------------------- CUDA
def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _median_event_s(fn: Any, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        a, b = _timing_event(), _timing_event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return float(statistics.median(times))


def copy_bandwidth(nbytes: int = 2 << 30) -> dict[str, float]:
    """Device-to-device copy (bytes read + written), eager, CUDA events; best of two ways."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    out = {"copy_": 2 * nbytes / _median_event_s(lambda: dst.copy_(src)) / 1e12,
           "mul_kernel": 2 * nbytes / _median_event_s(lambda: torch.mul(src, 1, out=dst))
           / 1e12}
    out["tb_s"] = max(out.values())
    return out


def weight_bytes_per_step(engine: ReferenceEngine) -> int:
    m = engine.model
    tensors = [m.norm, m.lm_head]
    for layer in m.layers:
        tensors += [layer.attn_norm, layer.wqkv, layer.wo, layer.ffn_norm, layer.w_gate_up,
                    layer.w_down]
        tensors += [t for t in (layer.bqkv, layer.bo, layer.q_norm, layer.k_norm)
                    if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_per_step(engine: ReferenceEngine, batch: int, context: int) -> int:
    c = engine.config
    return (2 * batch * context * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
            * engine.model.embed.element_size())


def graph_step_ms(engine: ReferenceEngine, batch: int, context: int, batch_invariant: bool,
                  n: int = 30) -> float:
    """The decode step alone: the captured graph (inputs copied in, replayed), events."""
    decoder = engine._decoder
    assert decoder is not None, "run generate first"
    tokens = torch.randint(0, engine.config.vocab_size, (batch,), device="cuda")
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device="cuda")
    times = []
    with torch.inference_mode(), ops.batch_invariant_mode(batch_invariant):
        for _ in range(3):
            decoder.step(tokens, positions)
        for _ in range(n):
            a, b = _timing_event(), _timing_event()
            a.record()
            decoder.step(tokens, positions)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return float(statistics.median(times))


def bench_cuda(args: argparse.Namespace) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    import triton

    info = {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "cuda": torch.version.cuda, "triton": triton.__version__,
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
    }
    log(f"device: {info}")
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    log(f"copy bandwidth (read + write): {bw}")
    t0 = time.perf_counter()
    engine = ReferenceEngine.random(LLAMA3_8B_CONFIG, device="cuda", dtype="bfloat16", seed=0)
    torch.cuda.synchronize()
    log(f"random Llama-3-8B-shaped weights on the GPU in {time.perf_counter() - t0:.1f} s")
    info["attention_backend"] = {True: ops.backend_name("cuda", True),
                                 False: ops.backend_name("cuda", False)}
    requests = make_requests(args.requests, args.prompt, args.output,
                             engine.config.vocab_size)
    warm = [GenerationRequest(r.id, r.prompt_token_ids,
                              SamplingParams(max_tokens=4, ignore_eos=True)) for r in requests]
    for mode in (True, False):      # compile Triton kernels, capture the 64-row graphs
        t0 = time.perf_counter()
        run_once(engine, warm, args.requests, mode)
        log(f"warm-up ({'invariant' if mode else 'default'}): "
            f"{time.perf_counter() - t0:.1f} s")
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    for rep in range(args.repeats):
        for mode in (True, False):
            r = run_once(engine, requests, args.requests, mode)
            runs[mode].append(r)
            log(f"rep {rep} {'invariant' if mode else 'default  '}: total {r['total_s']:.3f} s"
                f" prefill {r['prefill_s']:.3f} decode {r['decode_s']:.3f} (step "
                f"{r['step_ms']:.2f} ms) digest wait {r['digest_wait_s']:.3f}")
    for mode in (True, False):      # one more run of each, to compare the tokens
        engine.batch_invariant = mode
        tokens[mode] = [r.token_ids for r in engine.generate(requests[:8], max_batch=8)]
    context = args.prompt + args.output // 2
    step_graph = {mode: graph_step_ms(engine, args.requests, context, mode)
                  for mode in (True, False)}
    assert engine._decoder is not None
    captured = engine._decoder.captured
    wbytes = weight_bytes_per_step(engine)
    kvbytes = kv_bytes_per_step(engine, args.requests, context)
    roof_ms = wbytes / (bw["tb_s"] * 1e12) * 1e3
    med = {mode: medians(runs[mode]) for mode in (True, False)}
    out = {"info": info, "copy_bandwidth": bw, "weight_bytes_per_step": wbytes,
           "kv_bytes_per_step_at_mean_context": kvbytes, "roofline_step_ms": roof_ms,
           "graph_step_ms": {str(k): v for k, v in step_graph.items()},
           "captured_graphs": captured,
           "runs": {str(k): v for k, v in runs.items()},
           "medians": {str(k): v for k, v in med.items()},
           "same_tokens_first_8": sum(a == b for a, b in zip(tokens[True], tokens[False],
                                                              strict=True)),
           "config": vars(args)}
    bi, fast = med[True], med[False]
    rows = []
    for name, m in (("batch-invariant (Triton)", bi), ("default (cuBLAS, SDPA)", fast)):
        mode = m is bi
        rows.append([name, round(m["prefill_tok_s"]), round(m["decode_tok_s"]),
                     round(m["total_tok_s"]), m["prefill_s"], m["decode_s"], m["total_s"],
                     m["step_ms"], step_graph[mode],
                     f"{100 * roof_ms / step_graph[mode]:.0f}%",
                     f"{100 * roof_ms / m['step_ms']:.0f}%"])
    overhead = 100 * (bi["total_s"] / fast["total_s"] - 1)
    lines = [
        f"Engine, {info['gpu']}, torch {info['torch']}, CUDA {info['cuda']}, Triton "
        f"{info['triton']}; Llama-3-8B shapes, bf16, random weights; {args.requests} requests "
        f"x ({args.prompt} prompt + {args.output} output), greedy, one batch; medians of "
        f"{args.repeats}",
        table(["mode", "prefill tok/s", "decode tok/s", "total tok/s", "prefill s",
               "decode s", "total s", "engine step ms", "graph step ms",
               "roofline % (graph)", "roofline % (engine)"], rows),
        f"invariant-mode overhead (total time): {overhead:+.1f}% (prefill "
        f"{100 * (bi['prefill_s'] / fast['prefill_s'] - 1):+.1f}%, decode "
        f"{100 * (bi['decode_s'] / fast['decode_s'] - 1):+.1f}%, graph step "
        f"{100 * (step_graph[True] / step_graph[False] - 1):+.1f}%)",
        f"copy bandwidth {bw['tb_s']:.3f} TB/s (copy_ {bw['copy_']:.3f}, mul kernel "
        f"{bw['mul_kernel']:.3f}); weights per step {wbytes / 1e9:.2f} GB -> roofline "
        f"{roof_ms:.2f} ms; KV read at context {context}: {kvbytes / 1e9:.2f} GB more "
        f"(weights + KV floor {(wbytes + kvbytes) / (bw['tb_s'] * 1e12) * 1e3:.2f} ms)",
        f"digest wait after the last step: invariant {bi['digest_wait_s']:.3f} s, default "
        f"{fast['digest_wait_s']:.3f} s; graphs captured (invariant, bucket): {captured}; "
        f"identical tokens between modes (first 8 requests): {out['same_tokens_first_8']}/8",
    ]
    out["overhead_pct"] = overhead
    out["table"] = "\n".join(lines)
    return out


# --------------------------------------------------------------------------------- CPU
def bench_cpu(args: argparse.Namespace) -> dict[str, Any]:
    rows, raw = [], []
    configs = [("float32", 1), ("float32", 8), ("float32", 64), ("bfloat16", 64)]
    for dtype, max_batch in configs:
        engine = load_engine("tiny-demo", dtype=dtype)      # threads=1, the default
        requests = make_requests(64, 32, 32, engine.config.vocab_size)
        run_once(engine, requests[:max_batch], max_batch, True)      # warm-up
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for mode in (True, False):
                runs[mode].append(run_once(engine, requests, max_batch, mode))
        bi, fast = medians(runs[True]), medians(runs[False])
        raw.append({"dtype": dtype, "max_batch": max_batch, "invariant": bi, "default": fast})
        rows.append([dtype, max_batch, torch.get_num_threads(), round(bi["total_tok_s"]),
                     round(fast["total_tok_s"]), f"{fast['total_tok_s'] / bi['total_tok_s']:.2f}x",
                     f"{100 * (bi['total_s'] / fast['total_s'] - 1):+.0f}%"])
        log(f"{dtype} max_batch {max_batch}: invariant {bi['total_tok_s']:.0f} tok/s, "
            f"default {fast['total_tok_s']:.0f} tok/s")
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = "\n".join([
        f"Engine, CPU ({cpu}, {os.cpu_count()} cores), torch {torch.__version__}; tiny-demo, "
        f"64 requests x (32 prompt + 32 output), greedy; output tokens/s, medians of "
        f"{args.repeats}",
        table(["dtype", "max_batch", "threads", "invariant tok/s", "default tok/s",
               "default / invariant", "invariant overhead"], rows),
    ])
    return {"runs": raw, "table": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write engine_<device>.json/.txt")
    args = parser.parse_args()
    out = bench_cuda(args) if args.device == "cuda" else bench_cpu(args)
    print(out["table"], flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"engine_{args.device}.json").write_text(
            json.dumps(out, indent=1, default=str))
        (args.out / f"engine_{args.device}.txt").write_text(out["table"] + "\n")


if __name__ == "__main__":
    main()
