"""Comparing a replay with its record: which reproducibility tier holds.

- ``reproduced`` at ``bitwise``: same token IDs and every recorded numeric identical bit
  for bit;
- ``reproduced`` at ``token``: same token IDs; recorded numerics differ (max abs / rel
  difference reported);
- ``reproduced`` at ``tolerance``: token IDs differ, but every per-step logprob difference
  before the first divergence is within the stated bound;
- ``diverged``: first diverging position k, expected vs replayed token at k, top-k
  logprobs at k-1 and k from both sides.

Recorded logprobs are fp32 values written as JSON numbers; the reference engine reports
the same fp32 values as Python floats, so "bit for bit" is exact float equality here.
Pure functions over lists; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

TopK = Sequence[tuple[int, float]]


@dataclass(frozen=True)
class Side:
    """One side of the comparison: what was recorded, or what the replay produced."""

    token_ids: Sequence[int]
    finish_reason: str
    logprobs: Sequence[float] | None = None
    top_logprobs: Sequence[TopK] | None = None
    logits_sha256: Sequence[str] | None = None


@dataclass(frozen=True)
class Divergence:
    index: int
    expected_token: int | None      # None: the record ended before k
    replayed_token: int | None      # None: the replay ended before k
    expected_top_logprobs: dict[str, list[list[float]] | None] = field(default_factory=dict)
    replayed_top_logprobs: dict[str, list[list[float]] | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Comparison:
    outcome: str                    # "reproduced" | "diverged"
    tier: str | None                # "bitwise" | "token" | "tolerance" | None (diverged)
    requested_tier: str
    meets_requested_tier: bool
    divergence: Divergence | None
    max_abs_logprob_diff: float     # over the steps compared (before k when diverged)
    max_rel_logprob_diff: float
    steps_compared: int
    mismatched: list[str]           # which recorded numerics differ ("logprobs", ...)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_TIER_RANK = {"bitwise": 3, "token": 2, "tolerance": 1}


def _diffs(a: Sequence[float] | None, b: Sequence[float] | None, n: int) -> tuple[float, float]:
    if a is None or b is None:
        return 0.0, 0.0
    max_abs = max_rel = 0.0
    for x, y in zip(a[:n], b[:n], strict=False):
        d = abs(x - y)
        max_abs = max(max_abs, d)
        scale = max(abs(x), abs(y))
        if d and scale:
            max_rel = max(max_rel, d / scale)
    return max_abs, max_rel


def _top(side: Side, i: int) -> list[list[float]] | None:
    if i < 0 or side.top_logprobs is None or i >= len(side.top_logprobs):
        if side.logprobs is not None and 0 <= i < len(side.logprobs) and i < len(side.token_ids):
            return [[side.token_ids[i], side.logprobs[i]]]  # the chosen token at least
        return None
    return [[int(t), float(lp)] for t, lp in side.top_logprobs[i]]


def _same_top(a: Sequence[TopK] | None, b: Sequence[TopK] | None, n: int) -> bool:
    if a is None:
        return True  # nothing recorded, nothing to differ
    if b is None or len(a) < n or len(b) < n:
        return False
    for x, y in zip(a[:n], b[:n], strict=False):
        # compare the recorded top-k prefix: the replay may have been asked for more
        if [(int(t), float(v)) for t, v in x] != [(int(t), float(v)) for t, v in y][: len(x)]:
            return False
    return True


def compare(recorded: Side, replayed: Side, *, requested_tier: str = "bitwise",
            tolerance: float | None = None) -> Comparison:
    """Which tier the replay establishes for the record."""
    rec, rep = list(recorded.token_ids), list(replayed.token_ids)
    k = next((i for i, (a, b) in enumerate(zip(rec, rep, strict=False)) if a != b),
             min(len(rec), len(rep)))
    same_tokens = rec == rep and recorded.finish_reason == replayed.finish_reason
    if rec == rep and recorded.finish_reason != replayed.finish_reason:
        k = len(rec)  # same tokens, different reason to stop: diverges where one stopped
    steps = len(rec) if same_tokens else k
    max_abs, max_rel = _diffs(recorded.logprobs, replayed.logprobs, steps)
    if same_tokens:
        mismatched = []
        if recorded.logprobs is not None and (
                replayed.logprobs is None or list(recorded.logprobs) != list(replayed.logprobs)):
            mismatched.append("logprobs")
        if not _same_top(recorded.top_logprobs, replayed.top_logprobs, len(rec)):
            mismatched.append("top_logprobs")
        if recorded.logits_sha256 is not None and (
                replayed.logits_sha256 is None
                or list(recorded.logits_sha256) != list(replayed.logits_sha256)):
            mismatched.append("logits_sha256")
        tier = "token" if mismatched else "bitwise"
        return Comparison("reproduced", tier, requested_tier,
                          _TIER_RANK[tier] >= _TIER_RANK.get(requested_tier, 3), None,
                          max_abs, max_rel, steps, mismatched)
    divergence = Divergence(
        index=k,
        expected_token=rec[k] if k < len(rec) else None,
        replayed_token=rep[k] if k < len(rep) else None,
        expected_top_logprobs={"k-1": _top(recorded, k - 1), "k": _top(recorded, k)},
        replayed_top_logprobs={"k-1": _top(replayed, k - 1), "k": _top(replayed, k)},
    )
    if (tolerance is not None and recorded.logprobs is not None
            and replayed.logprobs is not None and max_abs <= tolerance):
        return Comparison("reproduced", "tolerance", requested_tier,
                          requested_tier == "tolerance", divergence, max_abs, max_rel, steps,
                          ["token_ids"])
    return Comparison("diverged", None, requested_tier, False, divergence, max_abs, max_rel,
                      steps, ["token_ids"])
