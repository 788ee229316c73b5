"""vLLM behind the :class:`~workers.engine.api.Engine` interface.

``vllm.LLM`` configured for replayable output: ``VLLM_BATCH_INVARIANT=1``, the FlashInfer
sampler off (``VLLM_USE_FLASHINFER_SAMPLER=0``), a pinned attention backend, prefix caching
and async scheduling off, ``skip_tokenizer_init`` with token-ID prompts (``TokensPrompt``),
raw logprobs. The pure mapping functions below need no vLLM and are unit tested; the
engine itself imports vLLM lazily. vLLM does not expose logits, so results carry no
``logits_sha256`` (an empty list per request).

Status: the mapping is tested without vLLM; ``tests/engine/test_vllm_adapter.py`` has an
integration test that runs only where vLLM and a GPU are present (not run by the author).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from workers.engine.api import GenerationRequest, GenerationResult, SamplingParams

#: Environment vLLM must see before it is imported (it caches some of these at import).
VLLM_ENV = {
    "VLLM_BATCH_INVARIANT": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # one process: the env above reaches the engine
}
DEFAULT_ATTENTION_BACKEND = "FLASH_ATTN"


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


def vllm_engine_kwargs(
    model: str, *, dtype: str, tensor_parallel_size: int, attention_backend: str,
    max_batch: int, seed: int, accepted: set[str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments; ``accepted`` (EngineArgs field names) drops the
    ones an older vLLM does not know (the environment variables cover those)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "max_num_seqs": max_batch,
        "seed": seed,
        "attention_backend": attention_backend,
        "logprobs_mode": "raw_logprobs",
        **(extra or {}),
    }
    if accepted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return kwargs


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


def vllm_runtime(
    *, dtype: str, tensor_parallel_size: int = 1,
    attention_backend: str = DEFAULT_ATTENTION_BACKEND, device: str = "cuda",
) -> dict[str, Any]:
    """The fingerprint runtime of a vLLM worker configured as :class:`VLLMEngine` does."""
    import vllm

    from workers.engine.runtime import device_runtime

    return {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        **device_runtime(device),
        "tensor_parallel_size": tensor_parallel_size,
        "attention_backend": attention_backend,
        "quantization": None,
        "dtype": dtype,
        "batch_invariant": True,
        "engine_flags": {
            **VLLM_ENV,
            "VLLM_ATTENTION_BACKEND": attention_backend,
            "enable_prefix_caching": False,
            "async_scheduling": False,
            "logprobs_mode": "raw_logprobs",
        },
    }


class VLLMEngine:
    """``vllm.LLM`` as an :class:`~workers.engine.api.Engine` (batch invariant only)."""

    name = "vllm"

    def __init__(
        self, model: str, *, dtype: str = "bfloat16", tensor_parallel_size: int = 1,
        attention_backend: str = DEFAULT_ATTENTION_BACKEND, max_batch: int = 64, seed: int = 0,
        extra_engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        env = {**VLLM_ENV, "VLLM_ATTENTION_BACKEND": attention_backend}
        self.dtype, self.tensor_parallel_size = dtype, tensor_parallel_size
        self.attention_backend, self.max_batch = attention_backend, max_batch
        self.batch_invariant = True
        os.environ.update(env)   # before vllm's import; kept for its worker processes
        import vllm
        from vllm.engine.arg_utils import EngineArgs

        accepted = set(getattr(EngineArgs, "__dataclass_fields__", {}))
        self._vllm = vllm
        self.llm = vllm.LLM(**vllm_engine_kwargs(
            model, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            attention_backend=attention_backend, max_batch=max_batch, seed=seed,
            accepted=accepted or None, extra=extra_engine_args,
        ))

    def runtime(self) -> dict[str, Any]:
        return vllm_runtime(dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                            attention_backend=self.attention_backend)

    def generate(
        self, requests: Sequence[GenerationRequest], *, max_batch: int
    ) -> list[GenerationResult]:
        if max_batch > self.max_batch:
            raise ValueError(f"max_batch {max_batch} exceeds the engine's max_num_seqs "
                             f"{self.max_batch}")
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
