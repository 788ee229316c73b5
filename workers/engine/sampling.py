"""Per-request deterministic token selection, vectorised over the batch.

A request's token at step ``t`` depends only on its own logits row, its sampling params,
its own prompt/output history and ``(seed, t)``: never on batch neighbours. Order of
processing follows vLLM's v1 sampler: penalties (repetition on prompt + output tokens,
frequency and presence on output tokens), then greedy argmax (temperature 0) or:
temperature, min_p, top_k, top_p, then **Gumbel-max** with noise from a counter-based
hash of ``(seed, step, token id)`` (SGLang's deterministic-sampling idea). All row
reductions are the elementwise tree/scan ops of ``torch_kernels``; ties in argmax go to
the smallest token id.

Noise: ``key1, key2`` = first 8 bytes of SHA-256(``"ledger-sampler-v1:{seed}:{step}"``);
``h = lowbias32(lowbias32(token_id ^ key1) ^ key2)``; ``u = ((h >> 8) + 0.5) / 2**24``;
``g = -log(-log(u))`` in fp32; chosen token = argmax over kept tokens of
``logits / temperature + g``. Integer math stays below 2**63 (no overflow on any device).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from workers.engine.api import SamplingParams
from workers.engine.torch_kernels import argmax_first, inclusive_scan, tree_sum

SAMPLER_VERSION = "gumbel-lowbias32-v1"
_MASK32 = 0xFFFFFFFF


def validate(params: SamplingParams) -> None:
    """Raise ValueError for parameters the engine cannot honour reproducibly."""
    if params.temperature < 0:
        raise ValueError("temperature must be >= 0")
    if params.temperature > 0 and params.seed is None:
        raise ValueError("temperature > 0 needs a seed to be replayable")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    if params.top_k < -1:
        raise ValueError("top_k must be -1, 0 (disabled) or positive")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError("min_p must be in [0, 1]")
    if params.repetition_penalty <= 0:
        raise ValueError("repetition_penalty must be > 0")
    if params.max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if params.logprobs is not None and params.logprobs < 0:
        raise ValueError("logprobs must be >= 0")


def step_keys(seed: int, step: int) -> tuple[int, int]:
    digest = hashlib.sha256(f"ledger-sampler-v1:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _lowbias32(x: Tensor) -> Tensor:
    """Chris Wellons' lowbias32 integer hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """keys int64 [B, 2] -> fp32 Gumbel(0, 1) noise [B, V]; row b depends on keys[b] only."""
    ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :]
    h = _lowbias32(_lowbias32(ids ^ keys[:, :1]) ^ keys[:, 1:])           # [B, V]
    u = ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)               # exact, in (0, 1)
    return -torch.log(-torch.log(u))


class BatchSampler:
    """Sampling state of the requests in cache slots 0..B-1 (rows follow the slots)."""

    def __init__(
        self, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
        vocab_size: int, device: torch.device,
    ) -> None:
        self.params = list(params)
        self.vocab_size = vocab_size
        self.device = device
        self.penalised = any(
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0 for p in params
        )
        b = len(params)
        self.counts: Tensor | None = None          # [B, V] int32 output-token counts
        self.in_prompt: Tensor | None = None       # [B, V] bool
        if self.penalised:
            self.counts = torch.zeros((b, vocab_size), dtype=torch.int32, device=device)
            self.in_prompt = torch.zeros((b, vocab_size), dtype=torch.bool, device=device)
            for row, prompt in enumerate(prompts):
                self.in_prompt[row, torch.tensor(list(prompt), device=device)] = True

    def add(self, params: SamplingParams, prompt: Sequence[int]) -> None:
        """Append a row (a request that joined the batch) after the existing ones."""
        self.params.append(params)
        if self.penalised or params.repetition_penalty != 1.0 \
                or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            b, v = len(self.params), self.vocab_size
            if self.counts is None or self.in_prompt is None:
                self.counts = torch.zeros((b - 1, v), dtype=torch.int32, device=self.device)
                self.in_prompt = torch.zeros((b - 1, v), dtype=torch.bool, device=self.device)
            self.penalised = True
            row = torch.zeros((1, v), dtype=torch.bool, device=self.device)
            row[0, torch.tensor(list(prompt), device=self.device)] = True
            self.counts = torch.cat([self.counts, self.counts.new_zeros((1, v))])
            self.in_prompt = torch.cat([self.in_prompt, row])

    def compact(self, rows: Sequence[int]) -> None:
        """Keep rows ``rows`` (new row i = old row rows[i])."""
        self.params = [self.params[r] for r in rows]
        if self.counts is not None and self.in_prompt is not None:
            index = torch.tensor(list(rows), device=self.device, dtype=torch.int64)
            self.counts = self.counts[index]
            self.in_prompt = self.in_prompt[index]

    def _rows(self, rows: Sequence[int] | None, n: int) -> Tensor:
        return torch.tensor(list(range(n)) if rows is None else list(rows),
                            device=self.device, dtype=torch.int64)

    def record(self, tokens: Tensor, rows: Sequence[int] | None = None) -> None:
        """Count the tokens [B] just chosen (for frequency/presence/repetition penalties);
        ``rows``: the sampler rows they belong to (default: all rows in order)."""
        if self.counts is not None:
            self.counts[self._rows(rows, tokens.shape[0]), tokens] += 1

    def _column(self, values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

    def penalise(self, logits: Tensor, rows: Sequence[int] | None = None) -> Tensor:
        """Apply repetition, frequency and presence penalties. logits fp32 [B, V]."""
        if self.counts is None or self.in_prompt is None:
            return logits
        params = self.params if rows is None else [self.params[r] for r in rows]
        if not any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                   or p.frequency_penalty != 0.0 for p in params):
            return logits
        index = self._rows(rows, logits.shape[0])
        counts, in_prompt = self.counts[index], self.in_prompt[index]
        rep = self._column([p.repetition_penalty for p in params])
        freq = self._column([p.frequency_penalty for p in params])
        pres = self._column([p.presence_penalty for p in params])
        seen = counts > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen | in_prompt, penalised, logits)
        return logits - freq * counts.float() - pres * seen.float()

    def choose(self, logits: Tensor, steps: Sequence[int],
               rows: Sequence[int] | None = None) -> Tensor:
        """Token per row [B] (int64) from raw fp32 logits [B, V]; steps[b] = tokens so far;
        ``rows``: the sampler row of each logits row (default: all rows in order)."""
        params = self.params if rows is None else [self.params[r] for r in rows]
        x = self.penalise(logits, rows)
        tokens = argmax_first(x)                                          # greedy rows keep this
        sampled = [r for r, p in enumerate(params) if p.temperature > 0]
        if sampled:
            index = torch.tensor(sampled, device=self.device)
            chosen = self._sample(x[index], [params[r] for r in sampled],
                                  [steps[r] for r in sampled])
            tokens = tokens.index_copy(0, index, chosen)
        return tokens

    def _sample(self, x: Tensor, params: list[SamplingParams], steps: list[int]) -> Tensor:
        v = x.shape[-1]
        x = x / self._column([p.temperature for p in params])             # [S, V]
        keep = torch.ones_like(x, dtype=torch.bool)
        if any(p.min_p > 0 for p in params):
            relative = torch.exp(x - x.amax(dim=-1, keepdim=True))        # p_i / p_max
            keep &= relative >= self._column([p.min_p for p in params])
        limited = [(r, min(p.top_k, v)) for r, p in enumerate(params) if 0 < p.top_k < v]
        if limited:
            rows = torch.tensor([r for r, _ in limited], device=self.device)
            ks = torch.tensor([k for _, k in limited], device=self.device)[:, None]
            best = torch.topk(x[rows], int(ks.max()), dim=-1).values      # sorted, exact values
            threshold = torch.full((x.shape[0], 1), float("-inf"), device=self.device)
            threshold[rows] = best.gather(1, ks - 1)                      # k-th largest value
            keep &= x >= threshold
        if any(p.top_p < 1.0 for p in params):
            keep &= self._top_p(torch.where(keep, x, float("-inf")),
                                [p.top_p for p in params])
        keys = torch.tensor([step_keys(int(p.seed or 0), s) for p, s in zip(params, steps,
                                                                           strict=True)],
                            dtype=torch.int64, device=self.device)
        scores = torch.where(keep, x + gumbel_noise(keys, v), float("-inf"))
        return argmax_first(scores)

    def _top_p(self, x: Tensor, top_p: list[float]) -> Tensor:
        """Smallest set of most likely tokens whose mass reaches top_p. x [S, V] -> keep."""
        ordered = torch.sort(x, dim=-1, descending=True).values           # exact values
        probs = torch.exp(ordered - ordered[:, :1])                       # unnormalised
        total = tree_sum(probs)                                           # [S]
        cumulative = inclusive_scan(probs)
        before = torch.cat([torch.zeros_like(total)[:, None], cumulative[:, :-1]], dim=-1)
        inside = before < self._column(top_p) * total[:, None]            # prefix, >= 1 token
        count = inside.sum(dim=-1, keepdim=True)                          # [S, 1]
        return x >= ordered.gather(1, count - 1)
