"""The vendor envelope (v2): what it must hold, and that every derived member is checked
against the request and response it records (a producer cannot claim a seed, token IDs
or a system_fingerprint the response does not show)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from ledger.core.canonical import canonical_json
from ledger.core.envelope import index_fields, parse_statement, runtime_of
from ledger.core.errors import ValidationFailed
from ledger.core.fingerprint import fingerprint_id
from ledger.core.vendor import (
    VendorEnvelopeStatement,
    build_vendor_statement,
    json_sha256,
    vendor_envelope_json_schema,
    vendor_fingerprint_id,
)
from tests.helpers import statement as v1_statement

REQUEST = {"model": "gpt-x", "messages": [{"role": "user", "content": "Approve?"}],
           "temperature": 0.7}
RESPONSE = {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1764000000,
            "model": "gpt-x-2026-01-01", "system_fingerprint": "fp_123",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Approved."}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
ASSERTIONS = {"version": 1, "assertions": [
    {"id": "decision", "kind": "same_decision",
     "select": {"path": "$.choices[0].message.content"},
     "labels": {"approve": ["approved"], "deny": ["denied"]}}]}


def vendor_statement(**kw: Any) -> dict[str, Any]:
    body = json.dumps(RESPONSE).encode()
    args: dict[str, Any] = {
        "request_id": "chatcmpl-abc", "recorded_at": "2026-12-01T10:00:00+00:00",
        "name": "acme", "base_url": "https://api.acme.example/v1",
        "endpoint": "chat/completions", "request": REQUEST, "response": RESPONSE,
        "response_body": body, "headers": {"openai-version": "2020-10-01"},
        "assertions": ASSERTIONS} | kw
    return build_vendor_statement(**args)


def test_a_vendor_statement_parses_and_indexes_as_tier_semantic() -> None:
    st = parse_statement(canonical_json(vendor_statement()))
    assert isinstance(st, VendorEnvelopeStatement)
    p = st.predicate
    assert (p.channel, p.tier) == ("vendor", "semantic")
    assert p.vendor.missing == ["seed", "token_ids", "logprobs", "runtime"]
    assert p.vendor.identifiers.system_fingerprint == "fp_123"
    fields = index_fields(st)
    assert (fields.channel, fields.tier, fields.model_name) == ("vendor", "semantic", "gpt-x")
    assert fields.fingerprint_id == vendor_fingerprint_id("acme") == fingerprint_id(
        {"engine": "vendor:acme"})
    assert runtime_of(st) == {"engine": "vendor:acme"}
    assert (fields.prompt_tokens, fields.output_tokens) == (9, 2)
    assert st.subject[0].digest["sha256"] == json_sha256(RESPONSE)


def test_v1_envelopes_still_parse_unchanged() -> None:
    st = parse_statement(canonical_json(v1_statement()))
    assert st.predicateType == "urn:inference-ledger:envelope:v1"


def test_missing_lists_exactly_what_the_call_lacks() -> None:
    seeded = {**REQUEST, "seed": 7}
    bare = {k: v for k, v in RESPONSE.items() if k != "system_fingerprint"}
    st = parse_statement(canonical_json(vendor_statement(request=seeded, response=bare)))
    assert isinstance(st, VendorEnvelopeStatement)
    assert st.predicate.vendor.missing == ["token_ids", "logprobs", "runtime",
                                           "system_fingerprint"]


def _edit(path: list[Any], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(vendor_statement())
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize(("path", "value", "says"), [
    (["predicate", "tier"], "token", "predicate.tier"),
    (["predicate", "tier"], "bitwise", "predicate.tier"),
    (["predicate", "vendor", "missing"], ["runtime"], "vendor.missing must be"),
    (["predicate", "vendor", "request_sha256"], "0" * 64, "request_sha256"),
    (["predicate", "vendor", "response", "system_fingerprint"], "fp_other",
     "response_sha256"),
    (["predicate", "vendor", "identifiers", "system_fingerprint"], "fp_999",
     "identifiers.system_fingerprint"),
    (["predicate", "vendor", "model_alias"], "gpt-y", "model_alias"),
    (["subject", 0, "digest", "sha256"], "1" * 64, "subject[0].digest.sha256"),
    (["predicate", "assertions"], {"version": 1, "assertions": []}, "assertions"),
])
def test_claims_the_record_does_not_support_are_refused(path: list[Any], value: Any,
                                                        says: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_statement(canonical_json(_edit(path, value)))
    assert info.value.code == "invalid_envelope"
    assert says in info.value.message or any(says in str(e) for e in info.value.errors)


def test_streamed_calls_are_not_vendor_records() -> None:
    with pytest.raises(ValidationFailed, match="stream"):
        parse_statement(canonical_json(vendor_statement(request={**REQUEST, "stream": True})))


def test_the_published_v2_schema_accepts_a_vendor_statement() -> None:
    schema = vendor_envelope_json_schema()
    Draft202012Validator.check_schema(schema)
    Draft202012Validator(schema).validate(vendor_statement())


def test_a_token_count_the_ledger_cannot_store_is_refused_as_invalid() -> None:
    """usage counts go to integer columns: one past 2**31 - 1 is the envelope's 422, not
    a database error (a 500) when it is stored."""
    big = copy.deepcopy(RESPONSE)
    big["usage"]["prompt_tokens"] = 2**31
    st = parse_statement(canonical_json(vendor_statement(
        response=big, response_body=json.dumps(big).encode())))
    with pytest.raises(ValidationFailed) as exc:
        index_fields(st)
    assert exc.value.code == "invalid_envelope" and "prompt_tokens" in exc.value.message
