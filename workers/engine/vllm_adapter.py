"""vLLM behind the :class:`~workers.engine.api.Engine` interface.

``vllm.LLM`` configured for replayable output: ``VLLM_BATCH_INVARIANT=1``, the FlashInfer
sampler off (``VLLM_USE_FLASHINFER_SAMPLER=0``), the attention backend pinned with the
``attention_backend`` engine argument (vLLM 0.25 ignores ``VLLM_ATTENTION_BACKEND``), prefix
caching and async scheduling off, the scheduler's limits pinned, ``skip_tokenizer_init``
with token-ID prompts (``TokensPrompt``), raw logprobs, and the top-k/top-p path pinned by
:mod:`workers.engine.vllm_plugin` (the flag does not make that path batch invariant). The
pure functions below need no vLLM and are unit tested; the engine imports vLLM lazily.
vLLM does not expose logits, so results carry no ``logits_sha256`` (an empty list each).

What the deterministic channel admits (:func:`deterministic_problem`): greedy, and seeded
sampling with any temperature/top_p/top_k/min_p/penalties, on vLLM 0.25 with the pin
active, compiled (not eager), chunked prefill, prefix caching and async scheduling off,
and at most :data:`MAX_INVARIANT_SEQS` sequences in flight. Refused: sampling without a
seed (vLLM draws it from a generator the whole batch shares), and top_k/top_p when the pin
is not active. A runtime outside these limits reports ``batch_invariant: false`` (so a
gateway labels its traffic ``performance``) with the reasons in
``not_batch_invariant_because``.
Measurements: docs/engine.md, "vLLM: what the flag covers and what it does not".
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from workers.engine.api import GenerationRequest, GenerationResult, SamplingParams

log = logging.getLogger("ledger.vllm")

#: Environment vLLM must see before it is imported (it caches some of these at import).
VLLM_ENV = {
    "VLLM_BATCH_INVARIANT": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # one process: the env above reaches the engine
}
#: The variables of VLLM_ENV that change numerics (hashed); multiprocessing does not.
NUMERIC_ENV = ("VLLM_BATCH_INVARIANT", "VLLM_USE_FLASHINFER_SAMPLER")
DEFAULT_ATTENTION_BACKEND = "FLASH_ATTN"
#: vLLM releases this adapter has been measured against (README: supported versions).
SUPPORTED_VLLM = ("0.25.",)
#: Largest max_num_seqs admitted as batch invariant. Measured on an H200 (docs/engine.md):
#: with a small Llama (hidden 1024, head_dim 64) and prompts of 8-700 tokens, every needle
#: (greedy too) was identical at batch sizes up to 17 and differed at 43 and 44 (the
#: failure report was cut there) in three runs: compiled with chunked prefill on, and with
#: it off compiled (FULL_AND_PIECEWISE graphs, then FULL_DECODE_ONLY) and eager;
#: issue trackers report divergence from ~44 sequences in flight and a batch-invariant
#: RMSNorm block-size change at >= 256. 16 is the largest size measured safe with margin.
MAX_INVARIANT_SEQS = 16
#: Largest ``vllm serve --max-num-seqs`` admitted as batch invariant: 1. ``vllm serve``
#: batches continuously (a request's prefill joins other requests' decode steps), which the
#: flag does not make invariant. Measured on an H200 (tests/capture/test_proxy_vllm.py, 86
#: records through ``ledger proxy``, 60 of them sent 16 at a time, each replayed alone with
#: ``vllm.LLM``): at --max-num-seqs 16, 41 bitwise, 25 token-identical with other logprob
#: bits, 20 diverged; at 1, 86/86 bitwise. Static batches of ``vllm.LLM`` (all requests
#: admitted together, what :class:`VLLMEngine` runs) stay invariant up to
#: :data:`MAX_INVARIANT_SEQS`.
MAX_SERVE_SEQS = 1
#: Batch sizes where vLLM changes a code path (sampler: 8 rows) or where divergence has
#: been reported (~44 sequences in flight); the self-check runs both sides of each.
BATCH_THRESHOLDS = (8, 44)

#: Scheduler and cache settings the adapter pins (every one changes numerics or which
#: requests share a step) and records in the fingerprint.
SCHEDULER_DEFAULTS: dict[str, Any] = {
    "max_num_seqs": MAX_INVARIANT_SEQS,
    "max_num_batched_tokens": 8192,
    # Measured: with chunking on, requests whose prefill was split (batches of >= 43 with
    # ~350-token prompts, 8192-token budget) differed from their runs alone, greedy too.
    # Off, a prompt is never split (it waits for a step with room); max_model_len must then
    # be <= max_num_batched_tokens (the engine defaults it to that).
    "enable_chunked_prefill": False,
    "long_prefill_token_threshold": 0,
    "max_num_partial_prefills": 1,
    "async_scheduling": False,
    "enable_prefix_caching": False,
    "block_size": 16,
}


def serve_args(*, max_model_len: int, dtype: str = "bfloat16", seed: int = 0,
               attention_backend: str = DEFAULT_ATTENTION_BACKEND,
               max_num_seqs: int = MAX_SERVE_SEQS) -> list[str]:
    """``vllm serve`` flags for the settings :class:`VLLMEngine` pins (run it with
    :data:`VLLM_ENV`'s numeric variables set), so that a server records what a worker with
    ``ledger fingerprint --engine vllm``'s fingerprint replays. ``max_model_len`` must be
    <= ``max_num_batched_tokens`` (no chunked prefill)."""
    s = SCHEDULER_DEFAULTS
    if max_model_len > s["max_num_batched_tokens"]:
        raise ValueError(f"max_model_len {max_model_len} > max_num_batched_tokens "
                         f"{s['max_num_batched_tokens']}: a prompt could not be scheduled")
    return [
        "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(s["max_num_batched_tokens"]),
        "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--no-async-scheduling",
        "--long-prefill-token-threshold", str(s["long_prefill_token_threshold"]),
        "--max-num-partial-prefills", str(s["max_num_partial_prefills"]),
        "--block-size", str(s["block_size"]), "--attention-backend", attention_backend,
        "--logprobs-mode", "raw_logprobs",
    ]


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Our ``SamplingParams`` as ``vllm.SamplingParams`` keyword arguments, field by field."""
    return {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,      # vLLM: -1 (or 0) disables
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs or 0,       # 0: the chosen token's logprob only
        "detokenize": False,                    # required with skip_tokenizer_init
    }


def deterministic_problem(params: SamplingParams, *, pinned: bool) -> str | None:
    """Why a request may not go on the deterministic channel of a vLLM runtime, or None."""
    sampled = params.temperature > 0
    if sampled and params.seed is None:
        return ("sampling without a seed draws from vLLM's batch-shared generator: not "
                "replayable")
    if sampled and not pinned and (params.top_k > 0 or params.top_p < 1.0):
        return ("top_k/top_p without the inference_ledger_pin plugin: vLLM picks the "
                "filter's code path by batch size (< 8 rows: sort, else Triton)")
    return None


def vllm_engine_kwargs(
    model: str, *, dtype: str, tensor_parallel_size: int, attention_backend: str,
    max_batch: int, seed: int, accepted: set[str] | None = None,
    scheduler: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments; ``accepted`` (EngineArgs field names) drops the
    ones an older vLLM does not know."""
    sched = {**SCHEDULER_DEFAULTS, **(scheduler or {}), "max_num_seqs": max_batch}
    kwargs: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        **sched,
        "seed": seed,
        "attention_backend": attention_backend,
        "logprobs_mode": "raw_logprobs",
        **(extra or {}),
    }
    if not sched["enable_chunked_prefill"]:
        kwargs.setdefault("max_model_len", sched["max_num_batched_tokens"])
    if accepted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return kwargs


def settings_from_config(vllm_config: Any) -> dict[str, Any]:
    """The settings vLLM resolved (``LLM.llm_engine.vllm_config``) that change numerics or
    batch membership, as JSON values (duck-typed, so it is unit tested without vLLM)."""
    s, c, m, comp = (vllm_config.scheduler_config, vllm_config.cache_config,
                     vllm_config.model_config, vllm_config.compilation_config)
    attn = getattr(vllm_config, "attention_config", None)

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.name
        if value is None or isinstance(value, bool | int | float | str):
            return value
        return getattr(value, "name", str(value))

    return {
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "enable_chunked_prefill": bool(s.enable_chunked_prefill),
        "long_prefill_token_threshold": s.long_prefill_token_threshold,
        "max_num_partial_prefills": s.max_num_partial_prefills,
        "async_scheduling": bool(s.async_scheduling),
        "enable_prefix_caching": bool(c.enable_prefix_caching),
        "block_size": c.block_size,
        "compilation_mode": plain(comp.mode),
        "cudagraph_mode": plain(comp.cudagraph_mode),
        "enforce_eager": bool(m.enforce_eager),
        "disable_cascade_attn": bool(getattr(m, "disable_cascade_attn", False)),
        "flash_attn_version": plain(getattr(attn, "flash_attn_version", None)),
        "seed": m.seed,
        "logprobs_mode": plain(m.logprobs_mode),
    }


def invariance_problems(version: str, env: Mapping[str, str], settings: Mapping[str, Any],
                        pin: Mapping[str, Any], *, serving: bool = False) -> list[str]:
    """Why this configuration is not (known to be) batch invariant; empty when it is.
    ``serving``: a ``vllm serve`` node (continuous batching), not ``vllm.LLM``."""
    problems = []
    if serving and int(settings.get("max_num_seqs") or 0) > MAX_SERVE_SEQS:
        problems.append(f"vllm serve with max_num_seqs > {MAX_SERVE_SEQS} (continuous "
                        "batching; measured: 41/86 records bitwise at 16)")
    if not any(version.startswith(v) for v in SUPPORTED_VLLM):
        problems.append(f"vLLM {version} is not a measured version ({SUPPORTED_VLLM})")
    if env.get("VLLM_BATCH_INVARIANT") != "1":
        problems.append("VLLM_BATCH_INVARIANT is not 1")
    if env.get("VLLM_USE_FLASHINFER_SAMPLER") != "0":
        problems.append("the FlashInfer sampler is not off")
    if settings.get("async_scheduling"):
        problems.append("async scheduling is on")
    if settings.get("enable_prefix_caching"):
        problems.append("prefix caching is on")
    if settings.get("enable_chunked_prefill"):
        problems.append("chunked prefill is on (a split prefill is not batch invariant)")
    if int(settings.get("max_num_seqs") or 0) > MAX_INVARIANT_SEQS:
        problems.append(f"max_num_seqs > {MAX_INVARIANT_SEQS} (measured: needles with long "
                        "prompts differ from their runs alone at batch >= 43)")
    if settings.get("enforce_eager") or settings.get("compilation_mode") in ("NONE", 0):
        problems.append("eager mode (measured: min_p + penalties not batch invariant)")
    if not pin.get("plugin"):
        problems.append("the top-k/top-p path is not pinned (inference_ledger_pin plugin)")
    return problems


def runtime_from(
    *, version: str, device: Mapping[str, Any], dtype: str, tensor_parallel_size: int,
    attention_backend: str, env: Mapping[str, str], settings: Mapping[str, Any],
    pin: Mapping[str, Any], serving: bool = False,
) -> dict[str, Any]:
    """The fingerprint runtime of a vLLM node from its parts (pure; unit tested)."""
    problems = invariance_problems(version, env, settings, pin, serving=serving)
    return {
        "engine": "vllm",
        "engine_version": version,
        **device,
        "tensor_parallel_size": tensor_parallel_size,
        "attention_backend": attention_backend,
        "quantization": None,
        "dtype": dtype,
        "batch_invariant": not problems,
        "engine_flags": {
            **{k: env.get(k) for k in NUMERIC_ENV},
            **dict(settings),
            **dict(pin),
        },
    } | ({"not_batch_invariant_because": "; ".join(problems)} if problems else {})


def vllm_runtime(
    *, dtype: str, tensor_parallel_size: int = 1,
    attention_backend: str = DEFAULT_ATTENTION_BACKEND, device: str = "cuda",
    settings: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
    max_num_seqs: int = MAX_SERVE_SEQS,
) -> dict[str, Any]:
    """The fingerprint runtime of a vLLM worker configured as :class:`VLLMEngine` does.

    Without ``settings`` (``ledger fingerprint --engine vllm``, no engine built) it states
    the settings the adapter requests plus :data:`RESOLVED_DEFAULTS` (what vLLM 0.25 chose
    for them on an H200); a built engine reports what vLLM resolved."""
    import vllm

    from workers.engine import vllm_plugin
    from workers.engine.runtime import device_runtime

    pin = vllm_plugin.pin_flags()
    serving = settings is None
    if settings is None:  # no engine here: what a `vllm serve` with our plugin installed pins
        settings = {**SCHEDULER_DEFAULTS, **RESOLVED_DEFAULTS, "max_num_seqs": max_num_seqs}
        pin = vllm_plugin.expected_flags(vllm.__version__)
    return runtime_from(
        version=vllm.__version__, device=device_runtime(device), dtype=dtype,
        tensor_parallel_size=tensor_parallel_size, attention_backend=attention_backend,
        env=env if env is not None else {**VLLM_ENV, **{k: os.environ[k] for k in NUMERIC_ENV
                                                        if k in os.environ}},
        settings=settings, pin=pin, serving=serving)


#: What vLLM 0.25.0 resolved, on an H200 with the settings above (filled from the device).
RESOLVED_DEFAULTS: dict[str, Any] = {
    "compilation_mode": "VLLM_COMPILE",
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "enforce_eager": False,
    "disable_cascade_attn": True,
    "flash_attn_version": 3,
    "seed": 0,
    "logprobs_mode": "raw_logprobs",
}


#: ``vllm.LLM`` arguments a worker may add (``LEDGER_VLLM_ENGINE_ARGS``): memory only.
MEMORY_ENGINE_ARGS = frozenset({"gpu_memory_utilization", "kv_cache_memory_bytes",
                                "max_model_len"})


def memory_engine_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` if every key only changes memory (:data:`MEMORY_ENGINE_ARGS`); anything that
    could change numerics or batching is refused: the fingerprint would not say it."""
    other = sorted(set(args) - MEMORY_ENGINE_ARGS)
    if other:
        raise ValueError(f"LEDGER_VLLM_ENGINE_ARGS may only set {sorted(MEMORY_ENGINE_ARGS)}; "
                         f"not {other} (they change numerics or batching)")
    return dict(args)


class NotDeterministic(ValueError):
    """A request the deterministic channel of this runtime does not admit."""


def result_from_output(request_id: str, output: Any, want_top: int | None) -> GenerationResult:
    """A ``GenerationResult`` from a ``vllm.RequestOutput`` (duck-typed: ``outputs[0]`` with
    ``token_ids``, ``finish_reason`` and ``logprobs`` = per step {token_id: Logprob})."""
    completion = output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    steps = completion.logprobs or []
    if len(steps) != len(token_ids):
        raise ValueError(f"request {request_id!r}: {len(steps)} logprob steps for "
                         f"{len(token_ids)} tokens")
    chosen = [float(step[token].logprob) for step, token in zip(steps, token_ids, strict=True)]
    top: list[list[tuple[int, float]]] | None = None
    if want_top:
        top = []
        for step in steps:
            ranked = sorted(
                ((int(t), lp) for t, lp in step.items() if lp.rank is not None),
                key=lambda item: (item[1].rank, item[0]),
            )
            top.append([(t, float(lp.logprob)) for t, lp in ranked[:want_top]])
    finish = completion.finish_reason or "length"
    return GenerationResult(
        id=request_id, token_ids=token_ids, finish_reason=str(finish), logprobs=chosen,
        top_logprobs=top, logits_sha256=[],
    )


class VLLMEngine:
    """``vllm.LLM`` as an :class:`~workers.engine.api.Engine`.

    ``batch_invariant=False`` builds vLLM as shipped (no flag, no pin: benchmarks only);
    ``pin=False`` keeps the flag but not the top-k/top-p pin (the runtime then reports
    ``batch_invariant: false``). One engine per process: vLLM reads the flag at start-up.
    """

    name = "vllm"
    batch_thresholds = BATCH_THRESHOLDS

    def __init__(
        self, model: str, *, dtype: str = "bfloat16", tensor_parallel_size: int = 1,
        attention_backend: str = DEFAULT_ATTENTION_BACKEND,
        max_batch: int = MAX_INVARIANT_SEQS, seed: int = 0,
        batch_invariant: bool = True, pin: bool = True,
        scheduler: Mapping[str, Any] | None = None,
        extra_engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        self.dtype, self.tensor_parallel_size = dtype, tensor_parallel_size
        self.attention_backend, self.max_batch = attention_backend, max_batch
        # as shipped = the flag off; the FlashInfer sampler stays off (vLLM imports
        # flashinfer for it, which our GPU host does not have; seeded requests never use it)
        self.env = dict(VLLM_ENV) if batch_invariant else {**VLLM_ENV,
                                                           "VLLM_BATCH_INVARIANT": "0"}
        os.environ.update(self.env)   # before vllm's import; kept for its worker processes
        import vllm
        from vllm.engine.arg_utils import EngineArgs

        from workers.engine import vllm_plugin

        if pin:
            vllm_plugin.register()
        accepted = set(getattr(EngineArgs, "__dataclass_fields__", {}))
        extra = dict(extra_engine_args or {})
        if "max_model_len" not in extra:    # <= the token budget (no chunked prefill)
            import json
            from pathlib import Path

            cfg = json.loads((Path(model) / "config.json").read_text("utf-8"))
            budget = {**SCHEDULER_DEFAULTS, **(scheduler or {})}["max_num_batched_tokens"]
            extra["max_model_len"] = min(budget, int(cfg.get("max_position_embeddings")
                                                     or budget))
        extra_engine_args = extra
        self._vllm = vllm
        self.llm = vllm.LLM(**vllm_engine_kwargs(
            model, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            attention_backend=attention_backend, max_batch=max_batch, seed=seed,
            accepted=accepted or None, scheduler=scheduler, extra=extra_engine_args,
        ))
        vllm_config = self.llm.llm_engine.vllm_config
        self.settings = settings_from_config(vllm_config)
        if self.settings["flash_attn_version"] is None and attention_backend == "FLASH_ATTN":
            from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

            self.settings["flash_attn_version"] = get_flash_attn_version(
                head_size=vllm_config.model_config.get_head_size())
        self.pin = vllm_plugin.pin_flags()
        self._runtime = runtime_from(
            version=vllm.__version__, device=self._device(), dtype=dtype,
            tensor_parallel_size=tensor_parallel_size, attention_backend=attention_backend,
            env=self.env, settings=self.settings, pin=self.pin)
        self.batch_invariant = bool(self._runtime["batch_invariant"])
        expected = {**SCHEDULER_DEFAULTS, **(scheduler or {}), **RESOLVED_DEFAULTS,
                    "max_num_seqs": max_batch, "seed": seed}
        differs = {k: (v, self.settings.get(k)) for k, v in expected.items()
                   if self.settings.get(k) != v}
        if differs and self.batch_invariant:
            log.warning("vLLM resolved settings other than `ledger fingerprint --engine vllm`"
                        " states (requested/default, resolved): %s", differs)

    @staticmethod
    def _device() -> dict[str, Any]:
        from workers.engine.runtime import device_runtime

        return device_runtime("cuda")

    def runtime(self) -> dict[str, Any]:
        return dict(self._runtime)

    def check_deterministic(self, params: SamplingParams) -> None:
        problem = deterministic_problem(params, pinned=bool(self.pin.get("plugin")))
        if problem is not None:
            raise NotDeterministic(problem)

    def generate(
        self, requests: Sequence[GenerationRequest], *, max_batch: int
    ) -> list[GenerationResult]:
        """Run ``requests`` in groups of ``max_batch`` (at most the engine's max_num_seqs).
        On a batch-invariant runtime every request must be admitted by the deterministic
        channel (:class:`NotDeterministic`)."""
        max_batch = max(1, min(max_batch, self.max_batch))
        if self.batch_invariant:
            for r in requests:
                self.check_deterministic(r.sampling)
        from vllm.inputs import TokensPrompt

        results: list[GenerationResult] = []
        for start in range(0, len(requests), max_batch):
            group = requests[start:start + max_batch]
            prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in group]
            params = [self._vllm.SamplingParams(**vllm_sampling_kwargs(r.sampling))
                      for r in group]
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            results += [result_from_output(r.id, o, r.sampling.logprobs)
                        for r, o in zip(group, outputs, strict=True)]
        return results
