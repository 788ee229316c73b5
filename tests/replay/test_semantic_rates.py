"""Pooling semantic verdicts per (vendor, model alias): what a run report's ``semantic``
section states (pure: rows as the report's query gives them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ledger.core.assertions import wilson_interval
from ledger.replay.semantic import semantic_groups


def row(fp: str, alias: str, outcome: str, passes: int, n: int, drift: bool,
        tier: str = "semantic") -> Any:
    details = {"semantic": {"n": n, "passes": passes,
                            "interval": {"confidence": 0.9}},
               "runtime_drift": {"changed": drift}}
    return SimpleNamespace(recorded_fingerprint=fp, model_name=alias, outcome=outcome,
                           tier=tier, details=details)


def test_groups_pool_samples_per_vendor_and_alias_and_skip_other_tiers() -> None:
    rows = [row("fp-a", "m1", "reproduced", 20, 20, False),
            row("fp-a", "m1", "diverged", 5, 20, True),
            row("fp-a", "m2", "diverged", 0, 10, False),
            row("fp-b", "m1", "reproduced", 3, 3, False),
            SimpleNamespace(recorded_fingerprint="fp-c", model_name="x", outcome="reproduced",
                            tier="bitwise", details={"tier": "bitwise"}),
            row("fp-d", "m", "unverifiable", 0, 0, False, tier=None)]
    groups = semantic_groups(rows)
    assert [(g["fingerprint_id"], g["model_alias"]) for g in groups] == [
        ("fp-a", "m1"), ("fp-a", "m2"), ("fp-b", "m1")]
    first = groups[0]
    assert (first["records"], first["samples"], first["passes"]) == (2, 40, 25)
    assert (first["reproduced"], first["diverged"], first["records_with_drift"]) == (1, 1, 1)
    assert first["pass_rate"] == 25 / 40
    low, high = wilson_interval(25, 40, 0.9)
    assert first["interval"] == {"method": "wilson", "confidence": 0.9,
                                 "low": round(low, 6), "high": round(high, 6)}
    assert groups[1]["pass_rate"] == 0.0 and groups[1]["interval"]["low"] == 0.0
