"""Assertions as data: the checks a semantic verdict makes on a re-sampled answer.

A hosted vendor API promises no seed, no token IDs and no runtime, so its answers cannot
be replayed token for token. What can be checked is that the *business facts* of an
answer still hold when the same request is sent again. An **assertion set**
(``{"version": 1, "assertions": [...]}``, documented in ``docs/semantic.md``) says which:

- ``equals``: a selected value equals a literal or the value selected from the recorded
  answer (exact match of a JSON path, optionally a regex capture within it);
- ``json_schema``: the selected value (e.g. the message content parsed as JSON) is valid
  against a JSON Schema (draft 2020-12);
- ``within``: a selected number is within an absolute and/or relative tolerance of a
  literal or of the recorded answer's number;
- ``one_of``: the selected value is a member of a set;
- ``same_decision``: a classification-style answer names the same decision as the
  recorded one, after mapping synonyms to labels ("Approved." and "approve" are one
  decision).

Everything here is a pure function of JSON values (no I/O, no clock, no randomness), so a
third party re-evaluates a verdict from the answers it carries with this module or with
their own implementation of the page above. :func:`semantic_summary` is the one function
that turns per-sample results into the numbers a verdict signs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ledger.core.errors import validation_failed

ASSERTION_LANGUAGE_VERSION = 1
MAX_ASSERTIONS = 64
MAX_PATTERN_LENGTH = 500
#: Regexes run on at most this many characters of a selected string (bounds their cost).
MAX_REGEX_SUBJECT = 100_000

_PATH_SEGMENT = re.compile(r"""\.([A-Za-z_][A-Za-z0-9_-]*)|\[(-?\d+)\]|\[['"]([^'"\]]*)['"]\]""")


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Selector(_Model):
    """Where the value under test is in an answer (an OpenAI-compatible response body)."""

    path: Annotated[str, Field(min_length=1, max_length=500, pattern=r"^\$",
                               description="JSONPath subset: $, .name, ['name'], [index]")]
    regex: Annotated[str | None, Field(max_length=MAX_PATTERN_LENGTH)] = Field(
        default=None, description="search the selected string; the value is a capture group")
    group: int | Annotated[str, Field(min_length=1, max_length=100)] | None = Field(
        default=None, description="capture group (number or name); default 1 if the "
        "pattern has a group, else the whole match")
    parse: Literal["none", "json", "number"] = Field(
        default="none", description="after path and regex: keep the value, parse a string "
        "as JSON, or read a number (a JSON number or a decimal string)")

    @model_validator(mode="after")
    def _compiles(self) -> Selector:
        parse_path(self.path)
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"regex does not compile: {exc}") from None
        elif self.group is not None:
            raise ValueError("group is only meaningful with regex")
        return self


class Expected(_Model):
    """A literal ``value``, or ``recorded: true`` for the value selected from the recorded
    answer."""

    recorded: bool = False
    value: Any = None

    @model_validator(mode="after")
    def _one(self) -> Expected:
        if self.recorded == (self.value is not None):
            raise ValueError('give exactly one of "recorded": true and "value"')
        return self


_RECORDED = Expected(recorded=True)
AssertionId = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._:-]+$")]


class Equals(_Model):
    id: AssertionId
    kind: Literal["equals"]
    select: Selector
    expected: Expected = _RECORDED


class JsonSchemaValid(_Model):
    id: AssertionId
    kind: Literal["json_schema"]
    select: Selector
    json_schema: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _valid_schema(self) -> JsonSchemaValid:
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(self.json_schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"schema is not a valid JSON Schema: {exc.message}") from None
        return self


class Within(_Model):
    id: AssertionId
    kind: Literal["within"]
    select: Selector
    expected: Expected = _RECORDED
    abs_tol: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    rel_tol: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0


class OneOf(_Model):
    id: AssertionId
    kind: Literal["one_of"]
    select: Selector
    values: list[Any] = Field(min_length=1, max_length=10_000)


class SameDecision(_Model):
    id: AssertionId
    kind: Literal["same_decision"]
    select: Selector
    labels: dict[Annotated[str, Field(min_length=1, max_length=200)],
                 list[Annotated[str, Field(min_length=1, max_length=200)]]] = Field(
        default_factory=dict, max_length=1000,
        description="label -> spellings that mean it (compared case-folded, trimmed of "
        "white space and trailing punctuation); empty: the normalised text is the decision")


Assertion = Annotated[Equals | JsonSchemaValid | Within | OneOf | SameDecision,
                      Field(discriminator="kind")]


class AssertionSet(_Model):
    version: Literal[1]
    assertions: list[Assertion] = Field(min_length=1, max_length=MAX_ASSERTIONS)

    @model_validator(mode="after")
    def _unique_ids(self) -> AssertionSet:
        ids = [a.id for a in self.assertions]
        if len(set(ids)) != len(ids):
            raise ValueError("assertion ids must be unique")
        if _has_nul(self.model_dump(mode="json", by_alias=True)):
            raise ValueError("an assertion set holds no NUL character (write \\x00 in a "
                             "regex)")
        return self


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


def parse_assertion_set(obj: Any) -> AssertionSet:
    """Validate an assertion set (a parsed JSON value); raises :class:`ValidationFailed`."""
    try:
        return AssertionSet.model_validate(obj)
    except ValidationError as exc:
        raise validation_failed(exc, "assertion set", "invalid_assertions") from None


def assertion_set_json(assertions: AssertionSet) -> dict[str, Any]:
    """The set as JSON, as it is signed into envelopes and verdicts."""
    return assertions.model_dump(mode="json", by_alias=True)


def assertion_set_json_schema() -> dict[str, Any]:
    schema = AssertionSet.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "urn:inference-ledger:assertions:v1:schema"
    return schema


# ---------------------------------------------------------------------------- selection
class NotFound(Exception):
    """A selector found nothing in an answer (the assertion fails, with this reason)."""


def parse_path(path: str) -> list[str | int]:
    """``$.choices[0].message['content']`` -> ``["choices", 0, "message", "content"]``."""
    if not path.startswith("$"):
        raise ValueError("a path starts with $")
    segments: list[str | int] = []
    pos = 1
    while pos < len(path):
        m = _PATH_SEGMENT.match(path, pos)
        if m is None:
            raise ValueError(f"path {path!r}: cannot read it from position {pos}")
        name, index, quoted = m.groups()
        segments.append(int(index) if index is not None else (name or quoted or ""))
        pos = m.end()
    return segments


def _walk(value: Any, segments: Sequence[str | int]) -> Any:
    for seg in segments:
        if isinstance(seg, int):
            if not isinstance(value, list) or not -len(value) <= seg < len(value):
                raise NotFound(f"no element [{seg}]")
            value = value[seg]
        else:
            if not isinstance(value, dict) or seg not in value:
                raise NotFound(f"no member {seg!r}")
            value = value[seg]
    return value


def select(selector: Selector, answer: Any) -> Any:
    """The value ``selector`` names in ``answer``; raises :class:`NotFound`."""
    value = _walk(answer, parse_path(selector.path))
    if selector.regex is not None:
        if not isinstance(value, str):
            raise NotFound("regex on a value that is not a string")
        pattern = re.compile(selector.regex)
        m = pattern.search(value[:MAX_REGEX_SUBJECT])
        if m is None:
            raise NotFound("regex does not match")
        group = selector.group if selector.group is not None else (
            1 if pattern.groups else 0)
        try:
            value = m.group(group)
        except (IndexError, re.error):
            raise NotFound(f"regex has no group {group!r}") from None
        if value is None:
            raise NotFound(f"regex group {group!r} did not take part in the match")
    if selector.parse == "json":
        if not isinstance(value, str):
            raise NotFound("parse json on a value that is not a string")
        try:
            value = json.loads(value)
        except ValueError:
            raise NotFound("the selected text is not JSON") from None
    elif selector.parse == "number":
        value = _number(value)
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise NotFound("a boolean is not a number")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip().replace(",", ""))
        except ValueError:
            raise NotFound(f"{value[:40]!r} is not a number") from None
    else:
        raise NotFound("the selected value is not a number")
    if not math.isfinite(number):
        raise NotFound("the selected number is not finite")
    return number


def json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values: numbers by value (``1 == 1.0``), booleans never equal to
    numbers, objects by members, arrays by position."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


_TRAILING = " \t\r\n.!?,;:\"'`*"


def normalise_decision(text: str) -> str:
    return text.strip().strip(_TRAILING).strip().casefold()


def decision(assertion: SameDecision, value: Any) -> str:
    """The label ``value`` names; raises :class:`NotFound` for a text no label spells."""
    if not isinstance(value, str):
        value = json.dumps(value, sort_keys=True, separators=(",", ":"))
    text = normalise_decision(value)
    if not assertion.labels:
        return text
    for label, spellings in assertion.labels.items():
        if text == normalise_decision(label) or any(
                text == normalise_decision(s) for s in spellings):
            return label
    raise NotFound(f"{text[:60]!r} is none of the decisions {sorted(assertion.labels)}")


# --------------------------------------------------------------------------- evaluation
@dataclass(frozen=True, slots=True)
class Result:
    id: str
    passed: bool
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "passed": self.passed, "reason": self.reason}


def _expected(expected: Expected, selector: Selector, recorded: Any) -> Any:
    if not expected.recorded:
        return expected.value
    try:
        return select(selector, recorded)
    except NotFound as exc:
        raise NotFound(f"in the recorded answer: {exc}") from None


def evaluate_one(assertion: Equals | JsonSchemaValid | Within | OneOf | SameDecision,
                 recorded: Any, answer: Any) -> Result:
    """Does ``assertion`` hold on ``answer`` (``recorded``: the answer on the record, for
    expectations taken from it)?"""
    try:
        value = select(assertion.select, answer)
        if isinstance(assertion, Equals):
            want = _expected(assertion.expected, assertion.select, recorded)
            ok = json_equal(value, want)
            return Result(assertion.id, ok, None if ok else "not equal to the expected value")
        if isinstance(assertion, JsonSchemaValid):
            import jsonschema

            error = jsonschema.exceptions.best_match(
                jsonschema.Draft202012Validator(assertion.json_schema).iter_errors(value))
            if error is None:
                return Result(assertion.id, True)
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return Result(assertion.id, False, f"schema: at {where}: {error.message[:200]}")
        if isinstance(assertion, Within):
            number = _number(value)
            want = _number(_expected(assertion.expected, assertion.select, recorded))
            bound = max(assertion.abs_tol, assertion.rel_tol * abs(want))
            ok = abs(number - want) <= bound
            return Result(assertion.id, ok,
                          None if ok else f"|{number!r} - {want!r}| > {bound!r}")
        if isinstance(assertion, OneOf):
            ok = any(json_equal(value, v) for v in assertion.values)
            return Result(assertion.id, ok, None if ok else "not one of the allowed values")
        got = decision(assertion, value)
        want_label = decision(assertion, _expected(_RECORDED, assertion.select, recorded))
        ok = got == want_label
        return Result(assertion.id, ok,
                      None if ok else f"decision {got!r}, recorded {want_label!r}")
    except NotFound as exc:
        return Result(assertion.id, False, str(exc))


def evaluate(assertions: AssertionSet, recorded: Any, answer: Any) -> list[Result]:
    """Every assertion of the set on one answer, in the set's order."""
    return [evaluate_one(a, recorded, answer) for a in assertions.assertions]


# ---------------------------------------------------------------------------- statistics
def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927): ``(low, high)``.

    ``z`` is the standard normal quantile at ``(1 + confidence) / 2``. With ``n == 0``
    nothing is known: ``(0.0, 1.0)``."""
    if not 0 <= successes <= n:
        raise ValueError("successes must be within 0..n")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    if successes == 0:
        low = 0.0
    if successes == n:
        high = 1.0
    return low, high


def _rate(passes: int, n: int, confidence: float) -> dict[str, Any]:
    low, high = wilson_interval(passes, n, confidence)
    return {"passes": passes, "n": n, "pass_rate": passes / n if n else None,
            "interval": {"method": "wilson", "confidence": confidence,
                         "low": round(low, 6), "high": round(high, 6)}}


def semantic_summary(assertions: AssertionSet, results: Sequence[Sequence[Result]], *,
                     confidence: float, min_pass_rate: float) -> dict[str, Any]:
    """The numbers a semantic verdict signs, from each sample's results (one list per
    sample, in the set's order).

    A sample passes when every assertion holds on it. The outcome is ``reproduced`` when
    the samples' pass rate is at least ``min_pass_rate`` (with at least one sample), else
    ``diverged``; every rate comes with its Wilson interval at ``confidence``."""
    if not 0 <= min_pass_rate <= 1:
        raise ValueError("min_pass_rate must be in [0, 1]")
    n = len(results)
    ids = [a.id for a in assertions.assertions]
    for sample in results:
        if [r.id for r in sample] != ids:
            raise ValueError("each sample needs one result per assertion, in order")
    passes = sum(all(r.passed for r in sample) for sample in results)
    per_assertion = {aid: _rate(sum(sample[i].passed for sample in results), n, confidence)
                     for i, aid in enumerate(ids)}
    overall = _rate(passes, n, confidence)
    rate = overall["pass_rate"]
    outcome = "reproduced" if rate is not None and rate >= min_pass_rate else "diverged"
    return {"outcome": outcome,
            "decision": {"rule": "pass_rate >= min_pass_rate", "min_pass_rate": min_pass_rate},
            **overall, "assertions": per_assertion,
            "failing_samples": [i for i, sample in enumerate(results)
                                if not all(r.passed for r in sample)]}


def reevaluate(assertions: Mapping[str, Any], recorded: Any, answers: Sequence[Any], *,
               confidence: float, min_pass_rate: float) -> dict[str, Any]:
    """What a verdict's numbers must be, from its assertion set, the recorded answer and
    the answers it carries (the third party's check, see ``docs/semantic.md``)."""
    parsed = parse_assertion_set(assertions)
    return semantic_summary(parsed, [evaluate(parsed, recorded, a) for a in answers],
                            confidence=confidence, min_pass_rate=min_pass_rate)
