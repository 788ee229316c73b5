"""vLLM vs the reference engine, side by side: throughput and batch invariance (the needle).

    PYTHONUNBUFFERED=1 python3 benchmarks/vllm.py weights --out /root/ckpt/llama3-8b-shape
    PYTHONUNBUFFERED=1 python3 benchmarks/vllm.py all --model /root/ckpt/llama3-8b-shape \
        --out DIR [--engines vllm-default,vllm-flag,vllm-flag-pin,reference-bi,reference-default]
    python3 benchmarks/vllm.py table --out DIR      # the table from the saved results

Same weights for every engine: one Llama-3-8B-shaped bf16 safetensors checkpoint
(``weights``: the reference loader's random weights, N(0, 1/fan_in), written under Hugging
Face names), loaded by vLLM and by the reference engine. Each engine runs in its own
process (vLLM reads ``VLLM_BATCH_INVARIANT`` at start-up), one after the other, on the same
GPU; ``all`` runs them and prints the table.

Engines: ``vllm-default`` (vLLM as shipped: no flag, FlashInfer sampler allowed),
``vllm-flag`` (``VLLM_BATCH_INVARIANT=1`` and the adapter's settings, top-k/top-p NOT
pinned), ``vllm-flag-pin`` (the same plus the inference_ledger_pin plugin: what the
deterministic channel runs), ``reference-bi`` / ``reference-default`` (our engine in its
two modes).

Throughput: 64 requests x (512 random prompt tokens + 256 new), greedy, ``ignore_eos``, one
``generate`` call of 64; ``--repeats`` runs, median. Decode step = (full run - prefill-only
run with 1 new token) / 255 steps. Roofline = weight bytes per step / measured device copy
bandwidth (bytes read + written).

Needle: 16 requests (4 greedy, 4 seeded top_p, 4 seeded top_k, 4 seeded top_k + top_p; 64
new tokens, prompts of 16-512 tokens), each alone, then among random seeded co-tenants in
batches of 3 (one needle, 2 trials), 17 (4 needles a batch, 2 trials) and 64 (all 16, 2
trials) and two shuffled orders of a 64-batch: 8 comparisons a needle, 128 an engine, of
token IDs and logprob bits, counted by sampling mode.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# run as a script, this file's folder is sys.path[0] and `import vllm` would import itself
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

from benchmarks.engine import log, table  # noqa: E402 - one table format for both
from workers.engine.api import GenerationRequest, SamplingParams  # noqa: E402

ENGINES = ("vllm-default", "vllm-flag", "vllm-flag-pin", "reference-bi", "reference-default")
MODES = ("greedy", "top_p", "top_k", "top_k+top_p")




# ------------------------------------------------------------------------------ weights
#: A chat template for :func:`write_byte_tokenizer` (role, content, one line each).
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


def write_byte_tokenizer(out: Path, config: dict[str, Any]) -> None:
    """A ``tokenizers`` byte-level tokenizer for a checkpoint of ``config`` (ids 0-255 the
    bytes, BOS/EOS from the config, every other id a ``<|tN|>`` token), with a chat
    template, so ``vllm serve`` takes text prompts and chat (the proxy tests' cases)."""
    from ledger.console.tokenizers import byte_level_tokenizer_json

    bos, eos = int(config["bos_token_id"]), int(config["eos_token_id"])
    names = {bos: "<s>", eos: "</s>"}
    tokens = {i: names.get(i, f"<|t{i}|>") for i in range(256, int(config["vocab_size"]))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes(byte_level_tokenizer_json(tokens, (bos, eos)))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": int(config.get("max_position_embeddings", 4096)),
        "chat_template": BYTE_CHAT_TEMPLATE}, indent=1))


def write_checkpoint(out: Path, config: dict[str, Any], *, seed: int = 0,
                     dtype: str = "bfloat16", device: str = "cuda") -> None:
    """A Llama-family safetensors checkpoint both engines load (random weights)."""
    import torch
    from safetensors.torch import save_file

    from workers.engine.config import ModelConfig
    from workers.engine.loader import hf_state_dict, random_transformer
    from workers.engine.runtime import torch_dtype

    cfg = ModelConfig.from_hf(config)
    model = random_transformer(cfg, device=device, dtype=torch_dtype(dtype), seed=seed)
    state = hf_state_dict(model)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > 4 << 30:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in shard.items()},
                  str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=1))
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, **config, "torch_dtype": dtype,
          "head_dim": cfg.head_dim}
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config["eos_token_id"]}))
    del model, state, shards
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- engines
def build(engine: str, model: str) -> Any:
    if engine.startswith("vllm"):
        from workers.engine.vllm_adapter import VLLMEngine

        return VLLMEngine(model, dtype="bfloat16", max_batch=64,
                          batch_invariant=engine != "vllm-default", pin=engine == "vllm-flag-pin",
                          extra_engine_args={"gpu_memory_utilization": 0.85,
                                             "max_model_len": 2048})
    from workers.engine import load_engine

    return load_engine(model, device="cuda", dtype="bfloat16",
                       batch_invariant=engine == "reference-bi")


def generate(engine: Any, requests: list[GenerationRequest]) -> list[Any]:
    return engine.generate(requests, max_batch=len(requests))


def copy_bandwidth_tb_s(nbytes: int = 2 << 30) -> float:
    import torch

    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    dst.copy_(src)
    for _ in range(10):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e12


def weight_bytes(model_dir: str) -> int:
    """Bytes read per decode step: every weight but the embedding table."""
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    total = 0
    for fname in sorted(set(index["weight_map"].values())):
        with open(Path(model_dir) / fname, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name == "__metadata__" or name == "model.embed_tokens.weight":
                continue
            begin, end = meta["data_offsets"]
            total += end - begin
    return total


def throughput(engine: Any, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(vocab) for _ in range(args.prompt))
               for _ in range(args.requests)]

    def reqs(n_new: int, tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}", p, SamplingParams(max_tokens=n_new,
                                                                ignore_eos=True))
                for i, p in enumerate(prompts)]

    generate(engine, reqs(4, "w"))                     # warm-up (graphs, autotuning)
    full, prefill = [], []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        out = generate(engine, reqs(args.output, f"f{rep}-"))
        full.append(time.perf_counter() - t0)
        assert sum(len(r.token_ids) for r in out) == args.requests * args.output
        t0 = time.perf_counter()
        generate(engine, reqs(1, f"p{rep}-"))
        prefill.append(time.perf_counter() - t0)
        log(f"  rep {rep}: full {full[-1]:.3f} s, prefill-only {prefill[-1]:.3f} s")
    total_s, prefill_s = statistics.median(full), statistics.median(prefill)
    step_ms = 1e3 * (total_s - prefill_s) / (args.output - 1)
    return {"total_s": total_s, "prefill_s": prefill_s, "full_runs": full,
            "prefill_runs": prefill, "new_tok_s": args.requests * args.output / total_s,
            "step_ms": step_ms}


def needle_requests(vocab: int, seed: int = 7) -> list[tuple[str, GenerationRequest]]:
    rng = random.Random(seed)
    out = []
    for i in range(16):
        mode = MODES[i % 4]
        params: dict[str, Any] = {"max_tokens": 64, "ignore_eos": True, "logprobs": None}
        if mode != "greedy":
            params |= {"temperature": rng.choice([0.7, 0.9, 1.0, 1.2]), "seed": 1000 + i}
        if "top_p" in mode:
            params["top_p"] = rng.choice([0.8, 0.9, 0.95])
        if "top_k" in mode:
            params["top_k"] = rng.choice([5, 8, 20, 40, 50])
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randrange(16, 513)))
        out.append((mode, GenerationRequest(f"needle{i}", prompt, SamplingParams(**params))))
    return out


def cotenant(rng: random.Random, vocab: int, tag: str) -> GenerationRequest:
    params: dict[str, Any] = {"max_tokens": rng.randrange(8, 97), "ignore_eos": True}
    if rng.random() < 0.75:
        params |= {"temperature": rng.choice([0.6, 0.8, 1.0, 1.3]),
                   "seed": rng.randrange(1 << 30)}
        if rng.random() < 0.5:
            params["top_p"] = rng.choice([0.7, 0.9, 0.97])
        if rng.random() < 0.5:
            params["top_k"] = rng.choice([1, 4, 10, 30, 100])
    prompt = tuple(rng.randrange(vocab) for _ in range(rng.randrange(4, 600)))
    return GenerationRequest(tag, prompt, SamplingParams(**params))


def needle(engine: Any, vocab: int) -> dict[str, Any]:
    needles = needle_requests(vocab)
    rng = random.Random(99)
    alone = {r.id: generate(engine, [r])[0] for _, r in needles}
    counts = {m: [0, 0] for m in MODES}          # identical, compared
    by_context: dict[str, list[int]] = {}
    differing: list[str] = []

    def check(context: str, batch: list[GenerationRequest]) -> None:
        outs = generate(engine, batch)
        for (mode, r) in needles:
            for req, res in zip(batch, outs, strict=True):
                if req.id != r.id:
                    continue
                ref = alone[r.id]
                same = (res.token_ids == ref.token_ids and
                        [struct.pack("<d", x) for x in res.logprobs] ==
                        [struct.pack("<d", x) for x in ref.logprobs])
                counts[mode][0] += same
                counts[mode][1] += 1
                ctx = by_context.setdefault(context, [0, 0])
                ctx[0] += same
                ctx[1] += 1
                if not same:
                    differing.append(f"{context}:{r.id}:{mode}")

    n = 0

    def fill(batch: list[GenerationRequest], size: int) -> list[GenerationRequest]:
        nonlocal n
        while len(batch) < size:
            n += 1
            batch.insert(rng.randrange(len(batch) + 1), cotenant(rng, vocab, f"c{n}"))
        return batch

    for trial in range(2):
        for _, r in needles:
            check("batch3", fill([r], 3))
        for g in range(4):
            check("batch17", fill([r for _, r in needles[4 * g:4 * g + 4]], 17))
        big = fill([r for _, r in needles], 64)
        check("batch64", big)
        if trial == 0:
            for _s in range(2):
                shuffled = list(big)
                rng.shuffle(shuffled)
                check("shuffled64", shuffled)
    total = sum(c[0] for c in counts.values())
    return {"identical": total, "compared": sum(c[1] for c in counts.values()),
            "by_mode": counts, "by_context": by_context, "differing": differing}


def run_engine(args: argparse.Namespace) -> None:
    import torch

    info: dict[str, Any] = {"engine": args.engine, "gpu": torch.cuda.get_device_name(0),
                            "torch": torch.__version__, "cuda": torch.version.cuda}
    info["copy_tb_s"] = copy_bandwidth_tb_s()
    t0 = time.perf_counter()
    engine = build(args.engine, args.model)
    info["init_s"] = time.perf_counter() - t0
    log(f"{args.engine}: built in {info['init_s']:.1f} s")
    if args.engine.startswith("vllm"):
        import vllm

        info["vllm"] = vllm.__version__
        info["runtime"] = engine.runtime()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    info["throughput"] = throughput(engine, vocab, args)
    log(f"{args.engine}: {info['throughput']['new_tok_s']:.0f} new tok/s, step "
        f"{info['throughput']['step_ms']:.2f} ms")
    info["needle"] = needle(engine, vocab)
    log(f"{args.engine}: needle {info['needle']['identical']}/{info['needle']['compared']} "
        f"{info['needle']['by_mode']}")
    info["weight_bytes"] = weight_bytes(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"vllm_{args.engine}.json").write_text(json.dumps(info, indent=1, default=str))


def make_table(out: Path, args: argparse.Namespace) -> str:
    results = {e: json.loads((out / f"vllm_{e}.json").read_text()) for e in ENGINES
               if (out / f"vllm_{e}.json").is_file()}
    if not results:
        return "no results"
    any_r = next(iter(results.values()))
    bw = statistics.median(r["copy_tb_s"] for r in results.values())
    roof_ms = any_r["weight_bytes"] / (bw * 1e12) * 1e3
    names = {"vllm-default": "vLLM as shipped", "vllm-flag": "vLLM + VLLM_BATCH_INVARIANT=1",
             "vllm-flag-pin": "vLLM + flag + inference_ledger_pin",
             "reference-bi": "reference, batch-invariant", "reference-default":
             "reference, default"}
    rows = []
    for e, r in results.items():
        t, nd = r["throughput"], r["needle"]
        rows.append([names[e], round(t["new_tok_s"]), t["total_s"], t["step_ms"],
                     f"{100 * roof_ms / t['step_ms']:.0f}%",
                     f"{nd['identical']}/{nd['compared']}",
                     *[f"{nd['by_mode'][m][0]}/{nd['by_mode'][m][1]}" for m in MODES],
                     " ".join(f"{k} {v[0]}/{v[1]}" for k, v in nd["by_context"].items())])
    base = results.get("vllm-default")
    lines = [
        f"vLLM {any_r.get('vllm', results.get('vllm-flag-pin', {}).get('vllm', '?'))} vs "
        f"reference, {any_r['gpu']}, torch {any_r['torch']}, CUDA {any_r['cuda']}; "
        f"Llama-3-8B shapes, bf16, one checkpoint (random N(0, 1/fan_in) weights); "
        f"{args.requests} x ({args.prompt} prompt + {args.output} new), greedy, one batch; "
        f"median of {args.repeats}",
        table(["engine", "new tok/s", "total s", "decode step ms", "roofline %",
               "needle identical", *[f"{m}" for m in MODES], "by context"], rows),
        f"roofline: {any_r['weight_bytes'] / 1e9:.2f} GB of weights per step / {bw:.3f} TB/s "
        f"copy bandwidth = {roof_ms:.2f} ms",
    ]
    if base:
        for e in ("vllm-flag", "vllm-flag-pin"):
            if e in results:
                lines.append(f"{names[e]}: {100 * (base['throughput']['new_tok_s'] / results[e]['throughput']['new_tok_s'] - 1):+.0f}% time vs as shipped")  # noqa: E501
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["weights", "run", "all", "table"])
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--model", default="/root/ckpt/llama3-8b-shape")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.command == "weights":
        from workers.engine.config import LLAMA3_8B_CONFIG

        t0 = time.perf_counter()
        write_checkpoint(args.out, dict(LLAMA3_8B_CONFIG))
        log(f"checkpoint written to {args.out} in {time.perf_counter() - t0:.1f} s")
    elif args.command == "run":
        run_engine(args)
    elif args.command == "all":
        for e in args.engines.split(","):
            log(f"--- {e}")
            rc = subprocess.call([sys.executable, __file__, "run", "--engine", e, "--model",
                                  args.model, "--out", str(args.out), "--requests",
                                  str(args.requests), "--prompt", str(args.prompt),
                                  "--output", str(args.output), "--repeats",
                                  str(args.repeats)], env=os.environ.copy())
            log(f"--- {e}: rc {rc}")
    if args.command in ("all", "table"):
        text = make_table(args.out, args)
        print(text, flush=True)
        (args.out / "vllm.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
