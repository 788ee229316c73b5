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


def test_a_verdict_holds_answers_with_nul_characters_in_jsonb_safe_form() -> None:
    """Sampled answers may hold any JSON string, NUL included (random tokens do): the
    verdict carries them as base64 of their RFC 8785 bytes, and no string of its details
    holds a NUL (PostgreSQL's JSONB refuses one), so the verdict is stored."""
    import base64
    import json

    from ledger.core.assertions import parse_assertion_set
    from ledger.core.canonical import canonical_json
    from ledger.core.envelope import parse_statement
    from ledger.settings import Settings
    from tests.core.test_vendor_envelope import ASSERTIONS, RESPONSE, vendor_statement
    from workers.semantic import semantic_details

    st = parse_statement(canonical_json(vendor_statement()))
    nul = json.loads(json.dumps(RESPONSE).replace("Approved.", "Appro\\u0000ved")
                     .replace("fp_123", "fp_\\u0000"))
    details = semantic_details(st, parse_assertion_set(ASSERTIONS), [RESPONSE, nul],  # type: ignore[arg-type]
                               Settings(semantic_confidence=0.9))
    assert not _strings_with_nul(details)
    assert [json.loads(base64.b64decode(s["response_jcs_b64"])) for s in details["samples"]] \
        == [RESPONSE, nul]
    assert details["runtime_drift"]["changed"] is True
    assert details["samples"][1]["system_fingerprint"] == "fp_\\u0000"
    assert (details["passes"], details["failing_samples"]) == (1, [1])


def _strings_with_nul(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if "\x00" in value else []
    if isinstance(value, list):
        return [s for v in value for s in _strings_with_nul(v)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings_with_nul(k) + _strings_with_nul(v)]
    return []
