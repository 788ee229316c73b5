"""What a request joining a running batch costs the requests already decoding (issue 16).

    PYTHONUNBUFFERED=1 python3 benchmarks/join_step.py --device cuda [--running 24]
    .venv/bin/python benchmarks/join_step.py --device cpu      # tiny-demo, a dry run

``benchmarks/serve.py`` at 16 requests/s shows an inter-token latency p95 of 30-46 ms for
our engine against ~10 ms for vLLM's default: about one step in twelve has a request
joining, and those steps are the slow ones. This script isolates them: ``--running``
requests decode (prompts of ``--prompt`` tokens, the first ``--shared`` from one shared
prefix, so the prefix cache holds it), then ``--joins`` times a request joins; each
``ContinuousBatcher.step`` is timed on the host the way a server loop sees it (a step
returns once its tokens are on the host). Per kind of step: the median wall time, and the
engine's own prefill time (from queueing the prompt forward to its end, so it includes the
rest of the decode step already running on the device). ``--profile`` adds a
``torch.profiler`` table of one join step (kernels by device time, host ops by host time).
``--mixed`` (``ReferenceEngine.mixed_steps``): the prompt rides in the next step's forward
with the decode tokens, so compare "join" + "step after join" between the two runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _knobs
from workers.engine import ReferenceEngine, load_engine
from workers.engine.api import GenerationRequest, SamplingParams
from workers.engine.config import LLAMA3_8B_CONFIG
from workers.engine.prefix_cache import PrefixCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--running", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--shared", type=int, default=None)
    parser.add_argument("--joins", type=int, default=8)
    parser.add_argument("--together", default="1,4", help="requests joining in one step")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--mixed", action="store_true",
                        help="mixed steps: the decode tokens ride in the prompt forward")
    parser.add_argument("--set", default="", metavar="NAME=INT,...", help=_knobs.HELP)
    args = parser.parse_args()
    _knobs.apply(args.set)
    cuda = args.device == "cuda"
    running = args.running or (24 if cuda else 4)
    prompt_len = args.prompt or (512 if cuda else 48)
    shared = args.shared if args.shared is not None else (384 if cuda else 32)
    if cuda:
        engine = ReferenceEngine.random(LLAMA3_8B_CONFIG, device="cuda", dtype="bfloat16")
    else:
        torch.set_num_threads(1)
        engine = load_engine("tiny-demo")
    engine.prefix_cache = PrefixCache(pages=4096)
    engine.mixed_steps = args.mixed
    vocab = engine.config.vocab_size
    rng = random.Random(0)
    prefix = tuple(rng.randrange(vocab) for _ in range(shared))
    # long enough to outlast the measurement (they are aborted at the end)
    budget = min(2048, engine.config.max_position_embeddings - prompt_len - 1)
    sampling = SamplingParams(max_tokens=budget, ignore_eos=True)
    count = 0

    def request() -> GenerationRequest:
        nonlocal count
        count += 1
        rest = tuple(rng.randrange(vocab) for _ in range(prompt_len - shared))
        return GenerationRequest(f"j{count}", prefix + rest, sampling)

    def timed_step() -> tuple[float, float]:
        p0 = engine.stats.prefill_s
        t0 = time.perf_counter()
        batcher.step()
        return time.perf_counter() - t0, engine.stats.prefill_s - p0

    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}; "
          f"{running} running, prompts {prompt_len} ({shared} shared), chunk {args.chunk}"
          f"{'; ' + args.set if args.set else ''}{'; mixed steps' if args.mixed else ''}")
    rows: list[tuple[str, float, float]] = []
    with engine.batcher(max_batch=64, prefill_chunk=args.chunk) as batcher:
        for _ in range(running):
            batcher.add(request())
        for _ in range(20):                      # prefill all, then settle into decoding
            batcher.step()
        for together in [int(x) for x in args.together.split(",")]:
            decode, join, after, prefill = [], [], [], []
            for _ in range(args.joins):
                for _ in range(4):
                    decode.append(timed_step()[0])
                for _ in range(together):
                    batcher.add(request())
                wall, pre = timed_step()
                join.append(wall)
                prefill.append(pre)
                after.append(timed_step()[0])
                batcher.step()
            rows.append((f"decode ({running} rows)", statistics.median(decode), 0.0))
            rows.append((f"join of {together}", statistics.median(join),
                         statistics.median(prefill)))
            rows.append((f"step after join of {together}", statistics.median(after), 0.0))
            for ticket in range(count - together * args.joins, count):   # back to
                batcher.abort(ticket)                                      # `running`
            for _ in range(3):
                batcher.step()
                batcher.take_finished()
        print("| step | wall ms (median) | of it prefill ms |\n|---|---|---|")
        for name, wall, pre in rows:
            print(f"| {name} | {wall * 1e3:.2f} | {pre * 1e3:.2f} |")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            for _ in range(3):
                batcher.step()
            with profile(activities=acts) as prof:
                batcher.add(request())
                batcher.step()
                batcher.step()
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        for ticket in range(count):          # tickets are given in order, from 0
            batcher.abort(ticket)
        batcher.run()


if __name__ == "__main__":
    main()
