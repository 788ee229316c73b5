"""Where a decode step's time goes inside ``ReferenceEngine.generate`` on CUDA (issue 16).

    PYTHONUNBUFFERED=1 python3 benchmarks/engine_steps.py [--variants base,nodigest,...]

``benchmarks/engine.py`` reports two step times that disagree: the engine's (decode wall
time over decode steps, ~9.2 ms at 64 rows on an H200) and the captured graph replayed
alone (~7.0 ms). This script runs the same workload (64 requests x (512 + N), Llama-3-8B
shapes, bf16, invariant mode) and splits each step, with CUDA events recorded on the
compute stream around every graph replay and host timers around every blocking call:

* graph ms: GPU time of the replay inside the loop (vs. alone: contention shows here);
* between ms: GPU time from one replay's end to the next one's start (sampling,
  log-softmax, the digest staging copy, and any idle gap while the host catches up);
* host wait ms: host time blocked in ``.cpu()`` (the step's one sync) and in the digest
  ring (waiting for hashing threads of an earlier step).

Variants change one thing each, to attribute the difference: ``base`` (as shipped),
``nodigest`` (logits digests replaced by a stub: no staging copy, no D2H, no hashing),
``threads1``/``threads16`` (hashing threads), ``ring8`` (digest ring depth 8), and
``torchsilu`` (torch's two kernels for silu(gate) * up instead of the one-launch kernel;
decode steps fuse it into the gate/up product unless ``FUSE_EPILOGUES=0`` is also set:
``FUSE_EPILOGUES=0`` alone runs the product and the op after it as two launches, for the
gate/up and the qkv projections),
``gcfreeze`` (``gc.freeze()`` first: collections skip everything alive before the run),
``profile`` (base under ``torch.profiler``: the top kernels and host ops outside the
graph), ``NAME=INT`` (``workers.engine.cuda_kernels.NAME`` set to INT for the run, e.g.
``_FEW_ROWS=32``; graphs are recaptured), ``splittile=few`` (the split path on the
fused path's 64x128 tile, as before 2026-12-03), ``addapart`` (each residual add and the
norm after it as two launches, as before 2026-12-03). Needs only torch + triton; no ``ledger``
imports.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine import ReferenceEngine, batching, digests
from workers.engine.api import GenerationRequest, SamplingParams
from workers.engine.config import LLAMA3_8B_CONFIG
from workers.engine.static_decode import StaticDecoder


def requests(n: int, prompt: int, output: int, vocab: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(0)
    return [GenerationRequest(f"r{i}", tuple(torch.randint(0, vocab, (prompt,), generator=g)
                                             .tolist()),
                              SamplingParams(max_tokens=output, ignore_eos=True))
            for i in range(n)]


class Probe:
    """Events around each graph replay; host timers around the blocking calls."""

    def __init__(self) -> None:
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_cpu_s = 0.0
        self.host_ring_s = 0.0
        self.active = False
        self.launched: list[float] = []

    def install(self) -> list[tuple[Any, str, Any]]:
        saved: list[tuple[Any, str, Any]] = []
        step = StaticDecoder.step
        probe = self

        def timed_step(self: StaticDecoder, tokens: torch.Tensor, positions: torch.Tensor
                       ) -> torch.Tensor:
            if not probe.active:
                return step(self, tokens, positions)
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            probe.launched.append(time.perf_counter())
            a.record()
            out = step(self, tokens, positions)
            b.record()
            probe.marks.append((a, b))
            return out

        saved.append((StaticDecoder, "step", step))
        StaticDecoder.step = timed_step  # type: ignore[method-assign]

        cpu = torch.Tensor.cpu

        def timed_cpu(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            t = time.perf_counter()
            out = cpu(self, *a, **k)
            probe.host_cpu_s += time.perf_counter() - t
            return out

        saved.append((torch.Tensor, "cpu", cpu))
        torch.Tensor.cpu = timed_cpu  # type: ignore[method-assign]

        slot = digests.CudaDigestRing.slot

        def timed_slot(self: digests.CudaDigestRing, rows: int, vocab: int) -> Any:
            t = time.perf_counter()
            out = slot(self, rows, vocab)
            probe.host_ring_s += time.perf_counter() - t
            return out

        saved.append((digests.CudaDigestRing, "slot", slot))
        digests.CudaDigestRing.slot = timed_slot  # type: ignore[method-assign]
        return saved

    def summary(self) -> dict[str, float]:
        torch.cuda.synchronize()
        graph = [a.elapsed_time(b) for a, b in self.marks]
        between = [self.marks[i][1].elapsed_time(self.marks[i + 1][0])
                   for i in range(len(self.marks) - 1)]
        host = [1e3 * (b - a) for a, b in zip(self.launched, self.launched[1:], strict=False)]
        return {"steps": len(graph), "graph_ms": statistics.median(graph),
                "launch_gap_ms": statistics.median(host) if host else 0.0,
                "launch_gap_max_ms": max(host) if host else 0.0,
                "launch_gaps_over_10ms": sum(h > 10 for h in host),
                "graph_mean_ms": statistics.fmean(graph),
                "between_ms": statistics.median(between) if between else 0.0,
                "between_mean_ms": statistics.fmean(between) if between else 0.0}


class _Stub:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def stage(self, logits: torch.Tensor) -> int:
        return int(logits.shape[0])

    def start(self, rows: int) -> list[Future[list[str]]]:
        f: Future[list[str]] = Future()
        f.set_result([""] * rows)
        return [f]


def run(engine: ReferenceEngine, reqs: list[GenerationRequest], variant: str
        ) -> dict[str, float]:
    probe = Probe()
    saved = probe.install()
    if variant == "nodigest":
        saved.append((batching, "CudaDigester", batching.CudaDigester))
        batching.CudaDigester = _Stub  # type: ignore[misc,assignment]
    if variant.startswith("threads"):
        n = int(variant[len("threads"):])
        saved.append((batching, "hashing_threads", batching.hashing_threads))
        batching.hashing_threads = lambda device: n  # type: ignore[assignment]
    if variant.startswith("ring"):
        saved.append((digests.CudaDigestRing, "RING", digests.CudaDigestRing.RING))
        digests.CudaDigestRing.RING = int(variant[len("ring"):])
        engine._digest_ring = None
    pauses: list[float] = []
    began: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[:] = [time.perf_counter()]
        elif began:
            pauses.append(time.perf_counter() - began[0])

    gc.callbacks.append(on_gc)
    from workers.engine import cuda_kernels as ck

    if "=" in variant:
        name, value = variant.split("=", 1)
        if name == "splittile":
            saved.append((ck, "_TILE_SPLIT_16", ck._TILE_SPLIT_16))
            ck._TILE_SPLIT_16 = ck._TILE_FEW_16  # type: ignore[misc]
        else:
            saved.append((ck, name, getattr(ck, name)))
            setattr(ck, name, int(value))
    if variant == "addapart":
        from workers.engine import ops

        def apart(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            total = x + r
            return total, ops.rms_norm(total, w, eps)

        saved.append((ops, "add_rms_norm", ops.add_rms_norm))
        ops.add_rms_norm = apart  # type: ignore[assignment]
    if (variant in ("torchsilu", "base", "addapart") or "=" in variant) \
            and engine._decoder is not None:
        engine._decoder._steps.clear()          # recapture the graphs with this variant's ops
    if variant == "torchsilu":
        from workers.engine import cuda_kernels, torch_kernels

        saved.append((cuda_kernels, "silu_mul", cuda_kernels.silu_mul))
        cuda_kernels.silu_mul = torch_kernels.fast_silu_mul  # type: ignore[assignment]
    warm = [GenerationRequest(r.id, r.prompt_token_ids, SamplingParams(max_tokens=4,
                                                                       ignore_eos=True))
            for r in reqs]
    engine.generate(warm, max_batch=len(warm))    # (re)captures this variant's graphs
    if variant == "gcfreeze":
        gc.collect()
        gc.freeze()
    try:
        probe.active = True
        if variant == "profile":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.generate(reqs, max_batch=len(reqs))
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        else:
            engine.generate(reqs, max_batch=len(reqs))
        probe.active = False
        s = engine.stats
        out = probe.summary()
        out.update({"engine_step_ms": 1e3 * s.decode_s / max(s.decode_steps, 1),
                    "total_s": s.total_s, "prefill_s": s.prefill_s, "decode_s": s.decode_s,
                    "host_cpu_wait_ms": 1e3 * probe.host_cpu_s / max(s.decode_steps, 1),
                    "host_ring_wait_ms": 1e3 * probe.host_ring_s / max(s.decode_steps, 1)})
        out["gc_pause_total_ms"] = 1e3 * sum(pauses)
        out["gc_pause_max_ms"] = 1e3 * max(pauses, default=0.0)
        return out
    finally:
        gc.callbacks.remove(on_gc)
        if variant == "gcfreeze":
            gc.unfreeze()
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        if variant.startswith("ring"):
            engine._digest_ring = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--variants", default="base,nodigest,threads1,threads16,ring8,base")
    p.add_argument("--default-mode", action="store_true", help="the default kernels")
    args = p.parse_args()
    engine = ReferenceEngine.random(LLAMA3_8B_CONFIG, device="cuda", dtype="bfloat16", seed=0)
    engine.batch_invariant = not args.default_mode
    reqs = requests(args.requests, args.prompt, args.output, engine.config.vocab_size)
    engine.generate(reqs, max_batch=len(reqs))   # the cache at its full size, graphs captured
    cols = ["variant", "engine_step_ms", "launch_gap_ms", "launch_gap_max_ms",
            "launch_gaps_over_10ms", "graph_ms", "between_ms", "host_cpu_wait_ms",
            "host_ring_wait_ms", "gc_pause_total_ms", "gc_pause_max_ms", "decode_s",
            "prefill_s", "total_s"]
    print(f"tracked objects before the variants: {len(gc.get_objects()):,} (all generations); "
          f"thresholds {gc.get_threshold()}")
    print(" | ".join(cols))
    for variant in args.variants.split(","):
        r = run(engine, reqs, variant)
        print(" | ".join([variant] + [f"{r[c]:.3f}" for c in cols[1:]]), flush=True)


if __name__ == "__main__":
    main()
