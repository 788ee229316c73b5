"""The assertion language (ledger.core.assertions): golden cases and properties.

Properties (hypothesis): selection finds exactly the value a generated path leads to;
every assertion is a total function of arbitrary JSON answers (it passes or fails with a
reason, never raises); an answer identical to the record passes every assertion whose
expectation is the record; ``within``, ``one_of`` and ``same_decision`` agree with their
definitions; the Wilson interval brackets the observed rate, is symmetric and narrows
with fewer demanded confidence; a summary's counts are those of its samples, whatever
their order; an assertion set survives its own JSON form."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core.assertions import (
    AssertionSet,
    assertion_set_json,
    evaluate,
    json_equal,
    parse_assertion_set,
    parse_path,
    reevaluate,
    select,
    semantic_summary,
    wilson_interval,
)
from ledger.core.errors import ValidationFailed

JSON_SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(
    allow_nan=False, allow_infinity=False, width=32) | st.text(
    # an assertion set holds no NUL (refused at parse time, tested on its own)
    alphabet=st.characters(exclude_characters="\x00"), max_size=12)
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(alphabet="abcxyz_", min_size=1, max_size=4), inner, max_size=4), max_leaves=20)
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)

CONTENT = "$.choices[0].message.content"


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"object": "chat.completion", "model": "m", **extra,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


FULL_SET = {"version": 1, "assertions": [
    {"id": "answer", "kind": "equals",
     "select": {"path": CONTENT, "regex": r"Answer: (\w+)"}},
    {"id": "shape", "kind": "json_schema",
     "select": {"path": CONTENT, "regex": r"(\{.*\})", "parse": "json"},
     "schema": {"type": "object", "required": ["amount"],
                "properties": {"amount": {"type": "number"}}}},
    {"id": "score", "kind": "within",
     "select": {"path": CONTENT, "regex": r"score=(?P<s>[0-9.]+)", "group": "s",
                "parse": "number"}, "abs_tol": 0.05, "rel_tol": 0.0},
    {"id": "object", "kind": "one_of", "select": {"path": "$.object"},
     "values": ["chat.completion", "chat.completion.chunk"]},
    {"id": "decision", "kind": "same_decision",
     "select": {"path": CONTENT, "regex": r"Decision: (\w+)"},
     "labels": {"approve": ["approved", "yes"], "deny": ["denied", "no"]}},
]}
RECORDED = chat('Answer: 42 {"amount": 10} score=0.50 Decision: Approved')


def outcomes(answer: Any, recorded: Any = RECORDED) -> dict[str, bool]:
    return {r.id: r.passed for r in evaluate(parse_assertion_set(FULL_SET), recorded, answer)}


# ------------------------------------------------------------------------ golden cases
def test_the_record_passes_its_own_assertions() -> None:
    assert outcomes(RECORDED) == dict.fromkeys(
        ["answer", "shape", "score", "object", "decision"], True)


def test_each_kind_fails_on_what_it_checks() -> None:
    other = chat('Answer: 43 {"amount": "ten"} score=0.56 Decision: denied.')
    assert outcomes(other) == {"answer": False, "shape": False, "score": False,
                               "object": True, "decision": False}
    wording = chat('Answer: 42 {"amount": 9.5} score=0.54 Decision: YES!')
    assert outcomes(wording) == dict.fromkeys(
        ["answer", "shape", "score", "object", "decision"], True)


def test_failures_say_why() -> None:
    results = evaluate(parse_assertion_set(FULL_SET), RECORDED, chat("no structure at all"))
    reasons = {r.id: r.reason for r in results}
    assert reasons["answer"] == "regex does not match"
    assert reasons["object"] is None
    missing = evaluate(parse_assertion_set(FULL_SET), RECORDED, {"choices": []})
    assert {r.reason for r in missing if r.id != "object"} == {"no element [0]"}


def test_a_literal_expectation_and_the_record_missing_the_value() -> None:
    s = parse_assertion_set({"version": 1, "assertions": [
        {"id": "lit", "kind": "equals", "select": {"path": "$.a"}, "expected": {"value": 1}},
        {"id": "rec", "kind": "equals", "select": {"path": "$.b"}}]})
    (lit, rec) = evaluate(s, {}, {"a": 1.0, "b": 2})
    assert lit.passed and not rec.passed
    assert rec.reason == "in the recorded answer: no member 'b'"


@pytest.mark.parametrize(("doc", "where"), [
    ({"version": 2, "assertions": []}, "version"),
    ({"version": 1, "assertions": []}, "assertions"),
    ({"version": 1, "assertions": [{"id": "x", "kind": "nope", "select": {"path": "$"}}]},
     "assertions.0"),
    ({"version": 1, "assertions": [{"id": "x", "kind": "equals",
                                    "select": {"path": "$.a", "regex": "("}}]}, "assertions.0"),
    ({"version": 1, "assertions": [{"id": "x", "kind": "equals",
                                    "select": {"path": "a.b"}}]}, "assertions.0"),
    ({"version": 1, "assertions": [{"id": "x", "kind": "json_schema", "select": {"path": "$"},
                                    "schema": {"type": 5}}]}, "assertions.0"),
    ({"version": 1, "assertions": [{"id": "x", "kind": "one_of", "select": {"path": "$"},
                                    "values": [1]}] * 2}, "(root)"),
    ({"version": 1, "assertions": [{"id": "x", "kind": "one_of", "select": {"path": "$"},
                                    "values": ["a\x00"]}]}, "(root)"),
])
def test_invalid_sets_are_refused_with_the_place(doc: dict[str, Any], where: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_assertion_set(doc)
    assert info.value.code == "invalid_assertions"
    assert f"invalid at {where}" in info.value.message


def test_wilson_golden_values() -> None:
    # Wilson (1927) at 95%: 10 of 20 -> (0.2993, 0.7007); 0 of 20 -> (0, 0.1611)
    low, high = wilson_interval(10, 20)
    assert (round(low, 4), round(high, 4)) == (0.2993, 0.7007)
    assert tuple(round(x, 4) for x in wilson_interval(0, 20)) == (0.0, 0.1611)
    assert tuple(round(x, 4) for x in wilson_interval(20, 20)) == (0.8389, 1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


# -------------------------------------------------------------------------- properties
@st.composite
def value_and_path(draw: st.DrawFn) -> tuple[Any, str, Any]:
    """A JSON document, a path string into it and the value at that path."""
    doc = draw(JSON)
    path, value = "$", doc
    for _ in range(draw(st.integers(0, 4))):
        if isinstance(value, list) and value:
            i = draw(st.integers(-len(value), len(value) - 1))
            path, value = f"{path}[{i}]", value[i]
        elif isinstance(value, dict) and value:
            key = draw(st.sampled_from(sorted(value)))
            quoted = draw(st.booleans())
            path += f"['{key}']" if quoted else f".{key}"
            value = value[key]
        else:
            break
    return doc, path, value


@given(value_and_path())
def test_select_finds_the_value_the_path_leads_to(case: tuple[Any, str, Any]) -> None:
    doc, path, value = case
    s = parse_assertion_set({"version": 1, "assertions": [
        {"id": "x", "kind": "equals", "select": {"path": path}}]})
    assert json_equal(select(s.assertions[0].select, doc), value)
    assert len(parse_path(path)) == path.count(".") + path.count("[")


@settings(max_examples=150)
@given(JSON, JSON)
def test_every_assertion_is_total_on_arbitrary_answers(recorded: Any, answer: Any) -> None:
    results = evaluate(parse_assertion_set(FULL_SET), recorded, answer)
    assert [r.id for r in results] == [a["id"] for a in FULL_SET["assertions"]]
    assert all(r.passed or r.reason for r in results)


@given(value_and_path())
def test_an_answer_identical_to_the_record_passes_every_recorded_expectation(
        case: tuple[Any, str, Any]) -> None:
    doc, path, value = case
    s = parse_assertion_set({"version": 1, "assertions": [
        {"id": "eq", "kind": "equals", "select": {"path": path}},
        {"id": "num", "kind": "within", "select": {"path": path, "parse": "number"}},
        {"id": "dec", "kind": "same_decision", "select": {"path": path}}]})
    eq, num, dec = evaluate(s, doc, doc)
    assert eq.passed and dec.passed
    numeric = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, str) and _is_number(value))
    assert num.passed == numeric, num
    outcome_when_content_is_kept = outcomes(RECORDED, RECORDED)
    assert all(outcome_when_content_is_kept.values())


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text.strip().replace(",", "")))
    except ValueError:
        return False


@given(st.floats(-1e6, 1e6, allow_nan=False), st.floats(-1e6, 1e6, allow_nan=False),
       st.floats(0, 100, allow_nan=False), st.floats(0, 1, allow_nan=False))
def test_within_is_its_definition_and_symmetric_in_abs_tol(
        got: float, want: float, abs_tol: float, rel_tol: float) -> None:
    s = parse_assertion_set({"version": 1, "assertions": [
        {"id": "n", "kind": "within", "select": {"path": "$.n"}, "abs_tol": abs_tol,
         "rel_tol": rel_tol}]})
    (r,) = evaluate(s, {"n": want}, {"n": got})
    assert r.passed == (abs(got - want) <= max(abs_tol, rel_tol * abs(want)))
    if rel_tol == 0:
        (back,) = evaluate(s, {"n": got}, {"n": want})
        assert back.passed == r.passed


@given(st.lists(JSON_SCALARS, min_size=1, max_size=6), JSON_SCALARS)
def test_one_of_is_membership(values: list[Any], value: Any) -> None:
    s = parse_assertion_set({"version": 1, "assertions": [
        {"id": "m", "kind": "one_of", "select": {"path": "$.v"}, "values": values}]})
    (r,) = evaluate(s, {}, {"v": value})
    assert r.passed == any(json_equal(value, v) for v in values)
    (member,) = evaluate(s, {}, {"v": values[-1]})
    assert member.passed


@given(st.sampled_from(["approve", "deny"]), st.sampled_from(["", " ", "\n"]),
       st.sampled_from(["", ".", "!", "?!"]), st.booleans())
def test_same_decision_ignores_case_space_and_trailing_punctuation(
        label: str, space: str, punct: str, upper: bool) -> None:
    s = parse_assertion_set({"version": 1, "assertions": [
        {"id": "d", "kind": "same_decision", "select": {"path": "$.d"},
         "labels": {"approve": ["approved"], "deny": ["denied"]}}]})
    spelled = (label.upper() if upper else label) + punct + space
    (same,) = evaluate(s, {"d": label}, {"d": space + spelled})
    other = "deny" if label == "approve" else "approve"
    (flipped,) = evaluate(s, {"d": other}, {"d": spelled})
    assert same.passed and not flipped.passed


@given(st.integers(0, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))),
       st.sampled_from([0.5, 0.8, 0.9, 0.95, 0.99, 0.999]))
def test_wilson_brackets_the_rate_and_is_symmetric(kn: tuple[int, int], conf: float) -> None:
    k, n = kn
    low, high = wilson_interval(k, n, conf)
    assert 0 <= low <= high <= 1
    if n:
        assert low <= k / n <= high
        mlow, mhigh = wilson_interval(n - k, n, conf)
        assert math.isclose(low, 1 - mhigh, abs_tol=1e-12)
        assert math.isclose(high, 1 - mlow, abs_tol=1e-12)
        nlow, nhigh = wilson_interval(k, n, 0.5 if conf > 0.5 else 0.4)
        assert low <= nlow + 1e-12 and nhigh <= high + 1e-12


@given(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), max_size=40),
       st.randoms(use_true_random=False), st.sampled_from([0.0, 0.5, 1.0]))
def test_summary_counts_its_samples_in_any_order(passes: list[list[bool]], rnd: Any,
                                                 min_rate: float) -> None:
    from ledger.core.assertions import Result

    s = parse_assertion_set({"version": 1, "assertions": [
        {"id": i, "kind": "one_of", "select": {"path": "$"}, "values": [1]}
        for i in ("a", "b", "c")]})
    results = [[Result(i, p) for i, p in zip("abc", row, strict=True)] for row in passes]
    summary = semantic_summary(s, results, confidence=0.95, min_pass_rate=min_rate)
    assert summary["n"] == len(passes)
    assert summary["passes"] == sum(all(row) for row in passes)
    for j, aid in enumerate("abc"):
        assert summary["assertions"][aid]["passes"] == sum(row[j] for row in passes)
    reproduced = bool(passes) and summary["passes"] / len(passes) >= min_rate
    assert summary["outcome"] == ("reproduced" if reproduced else "diverged")
    assert summary["failing_samples"] == [i for i, row in enumerate(passes) if not all(row)]
    shuffled = list(results)
    rnd.shuffle(shuffled)
    again = semantic_summary(s, shuffled, confidence=0.95, min_pass_rate=min_rate)
    assert {k: again[k] for k in ("passes", "pass_rate", "interval", "assertions")} == \
        {k: summary[k] for k in ("passes", "pass_rate", "interval", "assertions")}


def test_a_set_survives_its_json_form_and_reevaluates_the_same() -> None:
    parsed = parse_assertion_set(FULL_SET)
    as_json = assertion_set_json(parsed)
    assert as_json["assertions"][1]["schema"] == FULL_SET["assertions"][1]["schema"]
    assert parse_assertion_set(as_json) == parsed
    assert isinstance(parsed, AssertionSet)
    answers = [RECORDED, chat("nothing"), chat('Answer: 42 {"amount": 1} score=0.5 '
                                                'Decision: yes')]
    summary = reevaluate(as_json, RECORDED, answers, confidence=0.9, min_pass_rate=0.5)
    assert (summary["passes"], summary["n"], summary["outcome"]) == (2, 3, "reproduced")
    assert summary["failing_samples"] == [1]
