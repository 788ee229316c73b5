"""Host time per decode step of ``ReferenceEngine.generate``: this tree vs another one.

    git worktree add /tmp/old REV
    nice -n 10 python benchmarks/engine_host.py --baseline old=/tmp/old [--baseline ...]

A model so small (hidden 64, 1 layer, vocab 256) that a CPU step is almost all host work:
Python bookkeeping, sampler calls, tensor allocations, digests. 64 requests of 8 prompt
tokens run as one static batch with CUDA-graph-style static decode buffers
(``static_decode=True``, no graphs on CPU); per-step time is the difference of two runs
(``--short`` and ``--long`` new tokens) over the extra steps, so prefill and setup cancel.
"outside decode": that minus the time in ``engine._decode`` (the model; on CUDA the graph
launch). "sync->launch gap": host time from a step's last ``.cpu()`` to the next decode
launch: on CUDA the GPU has nothing queued meanwhile, so this is exposed per step.
Also counted per step: host reads of device tensors (``.cpu()``, ``.tolist()``,
``.item()``: each a device sync on CUDA) and ``torch.tensor`` calls (each a host-to-device
copy on CUDA). Each tree runs in its own subprocess, alternating, ``--repeats`` times;
the table shows medians. Needs only torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def child(batch: int, short: int, long: int, invariant: bool) -> dict[str, float]:
    import torch

    from workers.engine import ReferenceEngine
    from workers.engine.api import GenerationRequest, SamplingParams
    from workers.engine.config import ModelConfig
    from workers.engine.loader import random_transformer

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048)
    model = random_transformer(cfg)
    engine = ReferenceEngine(model, batch_invariant=invariant, static_decode=True)

    counts = {"syncs": 0, "h2d": 0, "decode_s": 0.0, "gap_s": 0.0}
    originals = {name: getattr(torch.Tensor, name) for name in ("cpu", "tolist", "item")}
    last_sync: list[float] = []

    def counting(name: str):  # type: ignore[no-untyped-def]
        fn = originals[name]

        def wrapper(self, *a, **k):  # type: ignore[no-untyped-def]
            counts["syncs"] += 1
            out = fn(self, *a, **k)
            if name == "cpu":
                last_sync[:] = [time.perf_counter()]
            return out
        return wrapper

    decode = engine._decode

    def timed_decode(*a, **k):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        if last_sync:       # host time from the last device read to this launch: on CUDA
            counts["gap_s"] += began - last_sync.pop()      # the GPU idles meanwhile
        out = decode(*a, **k)
        counts["decode_s"] += time.perf_counter() - began
        return out
    engine._decode = timed_decode  # type: ignore[method-assign]

    for name in originals:
        setattr(torch.Tensor, name, counting(name))
    make = torch.tensor

    def tensor(*a, **k):  # type: ignore[no-untyped-def]
        counts["h2d"] += 1
        return make(*a, **k)
    torch.tensor = tensor  # type: ignore[assignment]

    def run(new: int) -> tuple[float, dict[str, float]]:
        reqs = [GenerationRequest(f"r{i}", tuple((7 * i + j) % 256 for j in range(8)),
                                  SamplingParams(max_tokens=new, ignore_eos=True))
                for i in range(batch)]
        counts.update(syncs=0, h2d=0, decode_s=0.0, gap_s=0.0)
        began = time.perf_counter()
        engine.generate(reqs, max_batch=batch)
        return time.perf_counter() - began, dict(counts)

    run(short)                                      # warm-up
    steps = long - short
    best: dict[str, float] = {}
    for _ in range(3):                              # best of 3 of each (a noisy host)
        t_s, c_s = run(short)
        t_l, c_l = run(long)
        per = {"step_us": 1e6 * (t_l - t_s) / steps,
               "outside_us": 1e6 * (t_l - c_l["decode_s"] - t_s + c_s["decode_s"]) / steps,
               "gap_us": 1e6 * (c_l["gap_s"] - c_s["gap_s"]) / steps,
               "syncs_per_step": (c_l["syncs"] - c_s["syncs"]) / steps,
               "tensor_calls_per_step": (c_l["h2d"] - c_s["h2d"]) / steps}
        best = {k: min(v, best.get(k, v)) for k, v in per.items()}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", action="append", required=True, metavar="NAME=PATH",
                    help="another checkout (git worktree), repeatable")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=272)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.batch, args.short, args.long, args.child == "bi")))
        return
    trees = {name: Path(path).resolve() for name, _, path in
             (b.partition("=") for b in args.baseline)}
    trees["this tree"] = HERE
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for mode in ("bi", "default"):
            for name, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=str(tree))
                out = subprocess.run(
                    [sys.executable, __file__, "--baseline", "-", "--child", mode,
                     "--batch", str(args.batch), "--short", str(args.short),
                     "--long", str(args.long)],
                    cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
                runs.setdefault((mode, name), []).append(json.loads(out.splitlines()[-1]))
    print(f"batch {args.batch}, {args.long - args.short} extra steps, median of "
          f"{args.repeats}; " + ", ".join(f"{n}: {t}" for n, t in trees.items()))
    print("| mode | tree | us/step | outside decode us/step | sync->launch gap us | "
          "syncs/step | torch.tensor/step |")
    print("|---|---|---|---|---|---|---|")
    for (mode, name), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {'invariant' if mode == 'bi' else 'default'} | {name} | "
              f"{med['step_us']:.0f} | {med['outside_us']:.0f} | {med['gap_us']:.0f} | "
              f"{med['syncs_per_step']:.2f} | "
              f"{med['tensor_calls_per_step']:.2f} |")


if __name__ == "__main__":
    main()
