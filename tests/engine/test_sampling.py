"""The sampler: semantics of each parameter, determinism, and the noise it draws."""

from __future__ import annotations

import math
import random

import pytest
import torch

from workers.engine.api import SamplingParams
from workers.engine.sampling import (
    BatchSampler,
    _lowbias32,
    _mul32,
    gumbel_noise,
    step_keys,
    validate,
)

V = 8
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -2.0, 0.2]])


def sampler(*params: SamplingParams, prompts: list[list[int]] | None = None) -> BatchSampler:
    return BatchSampler(list(params), prompts or [[0]] * len(params), V, torch.device("cpu"))


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, steps: int = 3000) -> list[int]:
    """Tokens drawn at steps 0..steps-1 (noise differs per step, as during generation)."""
    s = sampler(*[params] * steps)
    return s.choose(logits.expand(steps, V).clone(), list(range(steps))).tolist()


def test_hash_arithmetic_matches_python_integers() -> None:
    rng = random.Random(0)
    values = [0, 1, 2**32 - 1, 2**31] + [rng.randrange(2**32) for _ in range(200)]
    x = torch.tensor(values, dtype=torch.int64)
    for c in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        assert _mul32(x, c).tolist() == [(v * c) % 2**32 for v in values]

    def lowbias32(v: int) -> int:
        v ^= v >> 16
        v = (v * 0x7FEB352D) % 2**32
        v ^= v >> 15
        v = (v * 0x846CA68B) % 2**32
        return v ^ (v >> 16)

    assert _lowbias32(x).tolist() == [lowbias32(v) for v in values]


def test_noise_depends_only_on_seed_and_step() -> None:
    keys = torch.tensor([step_keys(42, 3), step_keys(7, 0), step_keys(42, 3)])
    noise = gumbel_noise(keys, 1000)
    assert torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(gumbel_noise(keys[1:2], 1000)[0], noise[1])
    assert abs(noise.mean().item() - 0.5772) < 0.1          # Euler-Mascheroni: Gumbel mean


def test_sampling_follows_softmax_of_scaled_logits() -> None:
    for temperature in (1.0, 0.5):
        tokens = draw(SamplingParams(temperature=temperature, seed=11))
        probs = torch.softmax(LOGITS[0] / temperature, -1).tolist()
        for token in range(V):
            freq = tokens.count(token) / len(tokens)
            sigma = math.sqrt(probs[token] * (1 - probs[token]) / len(tokens))
            assert abs(freq - probs[token]) < 5 * sigma + 1e-3, (temperature, token)


def test_filters_restrict_support() -> None:
    assert set(draw(SamplingParams(temperature=1.0, seed=1, top_k=1))) == {0}
    assert set(draw(SamplingParams(temperature=1.0, seed=1, top_k=3))) == {0, 5, 1}
    probs = torch.softmax(LOGITS[0], -1)
    # top_p=0.6: the most likely tokens until their mass reaches 0.6
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, set()
    for t in order:
        nucleus.add(t)
        mass += probs[t].item()
        if mass >= 0.6:
            break
    assert set(draw(SamplingParams(temperature=1.0, seed=1, top_p=0.6))) == nucleus
    # min_p=0.5: tokens at least half as likely as the best
    kept = {t for t in range(V) if probs[t] >= 0.5 * probs.max()}
    assert set(draw(SamplingParams(temperature=1.0, seed=1, min_p=0.5))) == kept


def test_greedy_ignores_seed_and_breaks_ties_low() -> None:
    tied = torch.tensor([[0.0, 3.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    s = sampler(SamplingParams(), SamplingParams(seed=5))
    assert s.choose(tied.expand(2, V).clone(), [0, 0]).tolist() == [1, 1]


def test_penalties() -> None:
    s = sampler(SamplingParams(repetition_penalty=2.0), prompts=[[0, 4]])
    out = s.penalise(LOGITS.clone())
    assert out[0, 0].item() == 1.0 and out[0, 4].item() == -2.0 and out[0, 1].item() == 1.0
    s = sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    s.record(torch.tensor([1]))
    s.record(torch.tensor([1]))
    out = s.penalise(LOGITS.clone())
    assert out[0, 1].item() == 1.0 - 2 * 0.5 - 0.25
    assert out[0, 0].item() == 2.0                            # prompt tokens: not counted


def test_rows_do_not_influence_each_other() -> None:
    a = SamplingParams(temperature=0.9, seed=3, top_p=0.8, repetition_penalty=1.2)
    b = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    logits = torch.randn(2, V)
    alone = sampler(a).choose(logits[:1].clone(), [4])
    together = sampler(b, a, prompts=[[1], [0]]).choose(logits.flip(0).clone(), [0, 4])
    assert together[1] == alone[0]


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("max_tokens", -1), ("logprobs", -1),
])
def test_validate_rejects(field: str, value: float) -> None:
    with pytest.raises(ValueError):
        validate(SamplingParams(**{field: value}))


def test_sampling_needs_a_seed() -> None:
    with pytest.raises(ValueError, match="seed"):
        validate(SamplingParams(temperature=0.7))
