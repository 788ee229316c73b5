"""Serving benchmark: Poisson arrivals, shared-prefix prompts, continuous batching.

    # CPU (tiny-demo; small rates, short prompts):
    .venv/bin/python benchmarks/serve.py --device cpu
    # H200 (Llama-3-8B shapes, bf16, random weights; 512-token prompts, 256 new tokens):
    PYTHONUNBUFFERED=1 python3 benchmarks/serve.py --device cuda --rates 2,4,8,16 \
        --requests 128 [--vllm-model /root/ckpt/llama3-8b-shape --vllm default,flag]

Workload: ``--requests`` requests arrive as a Poisson process at each rate (requests/s,
``--seed`` fixes the arrival times and prompts). Prompts of ``--prompt`` tokens: the first
``--shared`` tokens come from one of ``--prefixes`` shared prefixes (a system prompt), the
rest are random; ``--new`` new tokens each, greedy, ``ignore_eos``.

Targets, each at every rate:

* ``reference-bi`` (and ``reference-default``, the same-run baseline; ``--modes``): our
  engine in batch-invariant mode (and its fast mode), in process, as ``ledger engine serve``
  runs it (``ContinuousBatcher``: admission by arrival at the next step, ``--max-batch``
  running, prompts prefilled in ``--chunk``-token chunks next to the decodes, a prefix cache
  of ``--prefix-pages`` 16-token pages; ``--mixed``: mixed steps). One thread adds the
  requests whose arrival time has passed between steps, as the server's batcher thread
  does; no HTTP.
* ``vllm-default`` / ``vllm-flag`` (``--vllm-model``): ``vllm serve`` started here (vLLM as
  shipped; with ``VLLM_BATCH_INVARIANT=1`` and the adapter's numerics flags, scheduler left
  at vLLM's defaults so it batches: the deterministic channel itself admits one sequence at
  a time, see docs/engine.md), measured over HTTP with streamed token-ID completions.
* ``ledger-serve-bi`` (``--modes ...,serve``): our engine in batch-invariant mode behind
  its OpenAI server (``workers.serve.app``, what ``ledger engine serve`` runs: the same
  engine, batching, chunk and prefix cache as ``reference-bi``), in a child process and
  measured over HTTP with streamed completions exactly as vLLM is: the same-footing
  comparison (the in-process ``reference-*`` targets pay no HTTP, SSE or tokenisation).
* ``http`` (``--url``): any OpenAI-compatible server already running, the same way.

Per target and rate: completed requests, new tokens/s (all new tokens / time from the first
arrival to the last completion), TTFT p50/p95 (arrival -> first token), inter-token
latency p95 (gaps between a request's consecutive tokens), the time from the last first
token to the last completion and the ITL p50 in it (decode steps alone: no prompt joins
then; at 64/s on the H200 that part, not the joins, holds most of the gap to vLLM),
prefix-cache hit share. With ``--repeat N`` each rate runs N times per target, and a
summary gives medians, ranges and our server's ratios to the other targets (on the H200
one 64/s run of the same code moves by up to 10% from the next).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

from benchmarks import _knobs  # noqa: E402  (after the path fix above)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Timing:
    arrival: float
    tokens: list[float] = field(default_factory=list)    # time of each token


def workload(args: argparse.Namespace, vocab: int, rate: float
             ) -> list[tuple[float, tuple[int, ...]]]:
    """(arrival offset s, prompt) per request."""
    rng = random.Random(args.seed)
    prefixes = [tuple(rng.randrange(vocab) for _ in range(args.shared))
                for _ in range(args.prefixes)]
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(rate)
        prompt = rng.choice(prefixes) + tuple(rng.randrange(vocab)
                                              for _ in range(args.prompt - args.shared))
        out.append((t, prompt))
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, -(-len(ordered) * q // 100)) - 1]


def summarize(target: str, rate: float, timings: list[Timing], extra: dict[str, Any]
              ) -> dict[str, Any]:
    done = [t for t in timings if t.tokens]
    first = min(t.arrival for t in timings)
    last = max(t.tokens[-1] for t in done) if done else first
    new = sum(len(t.tokens) for t in done)
    ttft = [t.tokens[0] - t.arrival for t in done]
    gaps = [(a, b - a) for t in done for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    itl = [gap for _, gap in gaps]
    # After every request's first token no prompt runs any more: the gaps from then on are
    # decode steps alone (and the end of the run's bookkeeping), the ones before include
    # the steps a prompt joined.
    settled = max(t.tokens[0] for t in done) if done else first
    tail = [gap for a, gap in gaps if a >= settled]
    return {"target": target, "rate": rate, "requests": len(timings), "completed": len(done),
            "new_tokens": new, "new_tok_s": new / (last - first) if last > first else None,
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "itl_p95_s": pct(itl, 95), "itl_after_joins_p50_s": pct(tail, 50),
            "after_joins_s": last - settled if done else None, **extra}


# ---------------------------------------------------------------------- our engine
def make_engine(args: argparse.Namespace) -> Any:
    import torch

    from workers.engine import ReferenceEngine, load_engine
    from workers.engine.config import LLAMA3_8B_CONFIG
    from workers.engine.prefix_cache import PrefixCache

    _knobs.apply(args.set)

    if args.device == "cuda":
        engine = ReferenceEngine.random(LLAMA3_8B_CONFIG, device="cuda", dtype="bfloat16")
    else:
        torch.set_num_threads(1)
        engine = load_engine("tiny-demo")
    engine.prefix_cache = PrefixCache(pages=args.prefix_pages) if args.prefix_pages else None
    engine.mixed_steps = args.mixed
    return engine


def run_reference(engine: Any, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    from workers.engine.api import GenerationRequest, SamplingParams

    target = "reference-bi" if engine.batch_invariant else "reference-default"
    sampling = SamplingParams(max_tokens=args.new, ignore_eos=True)
    plan = workload(args, engine.config.vocab_size, rate)
    engine.stats.prefix_hit_tokens = engine.stats.prompt_tokens = 0
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    timings: dict[int, Timing] = {}
    with engine.batcher(max_batch=args.max_batch, prefill_chunk=args.chunk) as batcher:
        start = time.perf_counter()
        pending = list(enumerate(plan))
        while pending or not batcher.idle:
            now = time.perf_counter() - start
            while pending and pending[0][1][0] <= now:
                i, (offset, prompt) = pending.pop(0)
                ticket = batcher.add(GenerationRequest(f"q{i}", prompt, sampling))
                timings[ticket] = Timing(arrival=start + offset)
            if batcher.waiting or batcher.running:
                batcher.step()
            elif pending:
                time.sleep(min(0.005, max(0.0, pending[0][1][0] - now)))
            for f in batcher.take_finished():
                timings[f.ticket].tokens = list(f.token_times)
    hits = engine.stats.prefix_hit_tokens / max(1, engine.stats.prompt_tokens)
    return summarize(target, rate, list(timings.values()),
                     {"prefix_hit_share": round(hits, 3)})


# ---------------------------------------------------------------------- over HTTP
def run_http(url: str, model: str, vocab: int, args: argparse.Namespace, rate: float,
             target: str) -> dict[str, Any]:
    """``plan``'s requests against an OpenAI-compatible server, streamed token-ID
    completions. ``--client async`` (default): one asyncio loop and one pooled
    ``httpx.AsyncClient``, as load generators such as vLLM's ``bench serve`` work.
    ``--client threads``: a thread and a fresh ``httpx.Client`` per request (what this
    benchmark used before 2026-12-02). A fresh ``httpx.Client`` costs ~55 ms of CPU under
    the GIL on the 2-core development VM (its TLS context), while the other threads are
    timing their tokens: at 64 requests/s that is more than a core, so that client itself
    delayed first tokens and stretched the run, for every server it measured."""
    plan = workload(args, vocab, rate)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if args.client == "threads":
        timings = _http_threads(url, model, args, plan)
    else:
        timings = asyncio.run(_http_async(url, model, args, plan))
    # the client's own CPU share of one core: near 1.0, its timestamps lag the server
    client_cpu = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    return summarize(target, rate, timings,
                     {"client": args.client, "client_cpu": round(client_cpu, 2)})


def warm_http(url: str, model: str, vocab: int, args: argparse.Namespace) -> None:
    """An unrecorded burst before a server's first measured rate: its first requests pay
    for compilation, graph capture and allocator growth, which the reference engine's
    in-process warm-up already pays. Another seed, so no measured prefix is cached."""
    log(f"warm-up of {url}")
    run_http(url, model, vocab, argparse.Namespace(
        **{**vars(args), "requests": 16, "seed": args.seed + 1_000_003}), 100.0, "warm-up")


def _body(model: str, args: argparse.Namespace, prompt: tuple[int, ...]) -> dict[str, Any]:
    return {"model": model, "prompt": list(prompt), "max_tokens": args.new,
            "temperature": 0.0, "ignore_eos": True, "stream": True}


def _is_token(line: str) -> bool:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    return bool(json.loads(line[6:]).get("choices"))


async def _http_async(url: str, model: str, args: argparse.Namespace,
                      plan: list[tuple[float, tuple[int, ...]]]) -> list[Timing]:
    import httpx

    timings = [Timing(arrival=0.0) for _ in plan]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter() + 0.2

        async def one(i: int, offset: float, prompt: tuple[int, ...]) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            timings[i].arrival = time.perf_counter()
            async with client.stream("POST", "/v1/completions",
                                     json=_body(model, args, prompt)) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if _is_token(line):
                        timings[i].tokens.append(time.perf_counter())

        await asyncio.gather(*(one(i, off, p) for i, (off, p) in enumerate(plan)))
    return timings


def _http_threads(url: str, model: str, args: argparse.Namespace,
                  plan: list[tuple[float, tuple[int, ...]]]) -> list[Timing]:
    import httpx

    timings = [Timing(arrival=0.0) for _ in plan]
    start = time.perf_counter() + 0.2

    def one(i: int, offset: float, prompt: tuple[int, ...]) -> None:
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        timings[i].arrival = time.perf_counter()
        with httpx.Client(timeout=600) as client, client.stream(
                "POST", f"{url}/v1/completions", json=_body(model, args, prompt)) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if _is_token(line):
                    timings[i].tokens.append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(i, off, p)) for i, (off, p) in
               enumerate(plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return timings


def serve_child(args: argparse.Namespace) -> None:
    """The ``ledger-serve-bi`` target's server (``--child-port``): make_engine's engine,
    batch invariant, behind ``workers.serve.app`` on that port until terminated."""
    import uvicorn

    from workers.serve.app import create_app

    engine = make_engine(args)
    engine.batch_invariant = True
    kwargs = {} if args.switch_interval is None else {"switch_interval_s": args.switch_interval}
    # as vLLM captures its graphs at startup, for this benchmark's sequence length
    warm = 0 if args.no_warm_up else args.prompt + args.new + 16
    app = create_app(engine, served_model_name="bench", tokenizer=None,
                     max_batch=args.max_batch, prefill_chunk=args.chunk, warm_up_len=warm,
                     collect_less=not args.default_gc, **kwargs)
    uvicorn.run(app, host="127.0.0.1", port=args.child_port, log_level="warning",
                access_log=False)


def start_serve(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-port", str(port),
           "--device", args.device, "--max-batch", str(args.max_batch),
           "--chunk", str(args.chunk), "--prefix-pages", str(args.prefix_pages),
           "--prompt", str(args.prompt), "--new", str(args.new)] + (
               ["--no-warm-up"] if args.no_warm_up else []) + (
               ["--default-gc"] if args.default_gc else []) + (
               ["--set", args.set] if args.set else []) + (
               [] if args.switch_interval is None else
               ["--switch-interval", str(args.switch_interval)]) + (
               ["--mixed"] if args.mixed else [])
    log(f"starting our server: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    _wait_healthy(proc, port, "our server")
    return proc


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, what: str) -> None:
    import httpx

    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"{what} did not become healthy in 900 s")


def start_vllm(model: str, variant: str, port: int, args: argparse.Namespace
               ) -> subprocess.Popen[bytes]:
    from workers.engine.vllm_adapter import VLLM_ENV

    env = os.environ.copy()
    # the module, not a `vllm` script: on the GPU host vLLM is installed into a PYTHONPATH
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", str(args.prompt + args.new + 16), "--seed", "0",
           "--max-num-seqs", str(args.max_batch), "--skip-tokenizer-init",
           "--generation-config", "vllm"]
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM 0.25's serve path imports FlashInfer for its sampler unless told not to
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if variant == "flag":
        env |= VLLM_ENV
    log(f"starting {' '.join(cmd)} ({variant})")
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
    _wait_healthy(proc, port, "vllm serve")
    return proc


def table(rows: list[dict[str, Any]]) -> str:
    head = ("target", "rate/s", "done", "new tok/s", "TTFT p50 s", "TTFT p95 s",
            "ITL p95 ms", "after joins: s, ITL p50 ms", "prefix hits", "client CPU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        def f(v: Any, scale: float = 1.0, fmt: str = ".3f") -> str:
            return "-" if v is None else format(v * scale, fmt)
        lines.append("| " + " | ".join([
            r["target"], f"{r['rate']:g}", f"{r['completed']}/{r['requests']}",
            f(r["new_tok_s"], fmt=".0f"), f(r["ttft_p50_s"]), f(r["ttft_p95_s"]),
            f(r["itl_p95_s"], 1000, ".1f"),
            f"{f(r.get('after_joins_s'))}, {f(r.get('itl_after_joins_p50_s'), 1000, '.2f')}",
            str(r.get("prefix_hit_share", "-")),
            f(r.get("client_cpu"), fmt=".2f")]) + " |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per target and rate over its runs: the median and range of new tokens/s and the
    median ITL p95; then ``ledger-serve-bi``'s median over each other target's (its range:
    our worst run over their best, our best over their worst)."""
    import statistics

    runs: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        if r["new_tok_s"] is not None:
            runs.setdefault((r["target"], r["rate"]), []).append(r)
    lines = ["| target | rate/s | runs | new tok/s median | range | ITL p95 ms median |",
             "|---|---|---|---|---|---|"]
    tput: dict[tuple[str, float], list[float]] = {}
    for (target, rate), rs in runs.items():
        tput[target, rate] = t = sorted(r["new_tok_s"] for r in rs)
        itls = [r["itl_p95_s"] for r in rs if r["itl_p95_s"] is not None]
        itl = f"{statistics.median(itls) * 1e3:.1f}" if itls else "-"
        lines.append(f"| {target} | {rate:g} | {len(rs)} | {statistics.median(t):.0f} | "
                     f"{t[0]:.0f}-{t[-1]:.0f} | {itl} |")
    ours = "ledger-serve-bi"
    others = sorted({target for target, _ in tput} - {ours})
    if any(target == ours for target, _ in tput) and others:
        lines += ["", "| rate/s | " + " | ".join(f"ours / {o}" for o in others) + " |",
                  "|---|" + "---|" * len(others)]
        for rate in sorted({rate for target, rate in tput if target == ours}):
            us = tput[ours, rate]
            cells = []
            for o in others:
                them = tput.get((o, rate))
                cells.append("-" if not them else
                             f"{statistics.median(us) / statistics.median(them):.2f} "
                             f"({us[0] / them[-1]:.2f}-{us[-1] / them[0]:.2f})")
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rates", default=None, help="requests/s, comma separated")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--shared", type=int, default=None)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (tokens)")
    parser.add_argument("--prefix-pages", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-warm-up", action="store_true",
                        help="our server without its startup warm-up (graphs captured on "
                             "first use, as before 2026-12-04)")
    parser.add_argument("--default-gc", action="store_true",
                        help="our server with Python's collector as it is (not frozen and "
                             "tuned while serving, as before 2026-12-04)")
    parser.add_argument("--mixed", action="store_true",
                        help="our engine with mixed steps (decode tokens in prompt forwards)")
    parser.add_argument("--set", default="", metavar="NAME=INT,...",
                        help="our engine with " + _knobs.HELP)
    parser.add_argument("--modes", default="bi,default",
                        help="reference engine modes: bi (batch invariant), default (in "
                             "process), serve (bi behind our HTTP server); 'none' to "
                             "measure only --url / --vllm-model")
    parser.add_argument("--child-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="serve: the server's thread switch interval, s (default: "
                             "workers.serve.app.SWITCH_INTERVAL_S)")
    parser.add_argument("--client", choices=["async", "threads"], default="async",
                        help="HTTP load generator (see run_http)")
    parser.add_argument("--url", default=None, help="also measure this running server")
    parser.add_argument("--url-model", default="tiny-demo")
    parser.add_argument("--vllm-model", default=None)
    parser.add_argument("--vllm", default="default,flag")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each rate per target (a summary table of medians and "
                             "ranges, and of our server's ratios to each other target)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    gpu = args.device == "cuda"
    args.rates = args.rates or ("2,4,8,16" if gpu else "4,16")
    args.requests = args.requests or (128 if gpu else 24)
    args.prompt = args.prompt or (512 if gpu else 64)
    args.shared = args.shared if args.shared is not None else (384 if gpu else 48)
    args.new = args.new or (256 if gpu else 16)
    args.chunk = args.chunk or (512 if gpu else 32)
    args.prefix_pages = args.prefix_pages if args.prefix_pages is not None else \
        (4096 if gpu else 256)
    rates = [float(r) for r in args.rates.split(",")]
    # --repeat: each rate measured that many times in a row on the same warmed target
    runs = [{"run": i + 1} for i in range(args.repeat)] if args.repeat > 1 else [{}]
    if args.child_port is not None:
        serve_child(args)
        return

    rows: list[dict[str, Any]] = []

    def measure(one: Any) -> None:
        """``one(rate)`` at every rate, each --repeat times in a row; rows and the log."""
        for rate in rates:
            for run in runs:
                rows.append({**one(rate), **run})
                log(json.dumps(rows[-1]))

    modes = [m for m in args.modes.split(",") if m in ("bi", "default")]
    if gpu:
        from workers.engine.config import LLAMA3_8B_CONFIG

        vocab = int(LLAMA3_8B_CONFIG["vocab_size"])
    else:
        vocab = 260                                   # tiny-demo
    if modes:
        engine = make_engine(args)
        vocab = engine.config.vocab_size
        log(f"reference engine on {args.device}: warm-up")
        run_reference(engine, argparse.Namespace(**{**vars(args), "requests": 4}), 100.0)
        for mode in modes:
            engine.batch_invariant = mode == "bi"
            measure(lambda rate: run_reference(engine, args, rate))
        del engine
        if gpu:
            import torch

            torch.cuda.empty_cache()
    if "serve" in args.modes.split(","):
        proc = start_serve(args, 8300)
        try:
            warm_http("http://127.0.0.1:8300", "bench", vocab, args)
            measure(lambda rate: run_http("http://127.0.0.1:8300", "bench", vocab, args,
                                          rate, "ledger-serve-bi"))
        finally:
            proc.terminate()
            proc.wait(60)
    if args.url:
        warm_http(args.url, args.url_model, vocab, args)
        measure(lambda rate: run_http(args.url, args.url_model, vocab, args, rate, "http"))
    if args.vllm_model:
        for variant in args.vllm.split(","):
            proc = start_vllm(args.vllm_model, variant, 8200, args)
            try:
                warm_http("http://127.0.0.1:8200", args.vllm_model, vocab, args)
                measure(lambda rate, variant=variant: run_http(
                    "http://127.0.0.1:8200", args.vllm_model, vocab, args, rate,
                    f"vllm-{variant}"))
            finally:
                proc.terminate()
                proc.wait(60)
    text = table(rows)
    if args.repeat > 1:
        text += "\n\n" + summary(rows)
    header = (f"{platform.node()} {args.device}: {args.requests} requests x ({args.prompt} "
              f"prompt tokens, {args.shared} shared from {args.prefixes} prefixes, + "
              f"{args.new} new), max_batch {args.max_batch}, chunk {args.chunk}, prefix "
              f"pages {args.prefix_pages}")
    print(header + "\n\n" + text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve.json").write_text(json.dumps(rows, indent=1))
        (args.out / "serve.txt").write_text(header + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
