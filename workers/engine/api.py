"""The engine interface shared by the reference engine, the vLLM adapter and the workers.

Kept free of torch so that callers (the CLI, the replay worker) can build requests and
read results without importing an engine. Field names follow vLLM's ``SamplingParams``
and the envelope's ``predicate.sampling`` object one to one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Told each token of one request as soon as it is sampled (a stream's source), on the
#: thread that runs the engine: ``(token_id, logprob, top logprobs or None, finish_reason)``,
#: ``finish_reason`` None while more follow, else "stop", "length" or "abort" (the last). The
#: logits digests come with the finished result only.
TokenListener = Callable[[int, float, list[tuple[int, float]] | None, str | None], None]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    seed: int | None = None           # required for temperature > 0 to be replayable
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # top-k logprobs per step; None or 0 = chosen token only

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SamplingParams:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
        values = dict(data)
        if "stop_token_ids" in values and values["stop_token_ids"] is not None:
            values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"])
        elif "stop_token_ids" in values:
            values["stop_token_ids"] = ()
        return cls(**values)


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationResult:
    id: str
    token_ids: list[int]
    finish_reason: str                                 # "stop" | "length" | "abort"
    logprobs: list[float]                              # chosen token, per step (fp32 value)
    top_logprobs: list[list[tuple[int, float]]] | None  # per step, best first; None if not asked
    logits_sha256: list[str]                           # SHA-256 of the fp32 logits row, per step


class Engine(Protocol):
    """What a replay worker needs from an engine."""

    name: str

    def runtime(self) -> dict[str, Any]:
        """This engine's runtime description (the envelope's ``runtime`` object)."""
        ...

    def generate(
        self, requests: Sequence[GenerationRequest], *, max_batch: int
    ) -> list[GenerationResult]:
        """Run requests in the given order, ``max_batch`` at a time; results in order."""
        ...
