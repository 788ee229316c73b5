"""The vendor channel: envelopes (predicate ``urn:inference-ledger:envelope:v2``) for calls
to hosted, OpenAI-compatible APIs.

A vendor exposes no seed contract, no token IDs and no runtime, so nothing about such a
call can be replayed token for token or bit for bit. What a v2 envelope records instead is
the request and the response as the vendor sent them (parsed JSON, hashed with RFC 8785
into the statement), the model alias, every version identifier the vendor returned
(``system_fingerprint``, the response's ``model`` and ``id``, headers the gateway pins),
the time, and what is missing. Its tier is always ``semantic``: a replay re-sends the
request N times and checks business assertions (:mod:`ledger.core.assertions`).

v1 envelopes (:mod:`ledger.core.envelope`) are unchanged; ``docs/envelope.md`` section 6
documents this predicate and ``ledger/schemas/envelope-v2.schema.json`` is its schema.

Routing: every vendor record of vendor ``name`` has the fingerprint of the runtime
``{"engine": "vendor:<name>"}`` (:func:`vendor_runtime`), so its replays go to the queue
of a worker that holds that vendor's API key, and to no GPU worker.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from ledger.core.assertions import AssertionSet
from ledger.core.canonical import canonical_json, sha256_hex
from ledger.core.envelope import (
    STATEMENT_TYPE,
    IndexFields,
    RequestId,
    Sha256Hex,
    ShortStr,
    Subject,
)
from ledger.core.errors import ValidationFailed, validation_failed
from ledger.core.fingerprint import fingerprint_id

VENDOR_ENVELOPE_PREDICATE_TYPE = "urn:inference-ledger:envelope:v2"
VENDOR_ENGINE_PREFIX = "vendor:"
VendorName = Annotated[str, Field(min_length=1, max_length=100,
                                  pattern=r"^[a-z0-9][a-z0-9._-]*$")]
#: What a vendor record may lack, in this order; ``missing`` lists exactly those absent.
MISSING_VOCABULARY = ("seed", "token_ids", "logprobs", "runtime", "system_fingerprint")
ENDPOINTS = ("chat/completions", "completions")


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Identifiers(_Model):
    """Version identifiers the vendor returned; each must equal what the response says."""

    system_fingerprint: Annotated[str | None, Field(max_length=200)] = None
    model: Annotated[str | None, Field(max_length=200)] = None
    id: Annotated[str | None, Field(max_length=200)] = None
    created: int | None = None
    headers: dict[Annotated[str, Field(pattern=r"^[a-z0-9-]{1,100}$")],
                  Annotated[str, Field(max_length=1000)]] = Field(
        default_factory=dict, max_length=32,
        description="response headers the gateway pins (lower-case names), e.g. "
        "openai-version, x-request-id")


class VendorCall(_Model):
    name: VendorName = Field(description="the vendor's routing name (the gateway's "
                             "setting); replays go to a worker holding this vendor's key")
    base_url: Annotated[str, Field(min_length=1, max_length=500)]
    endpoint: Literal["chat/completions", "completions"]
    model_alias: ShortStr = Field(description="the request's model member")
    request: dict[str, Any] = Field(description="the request body as sent to the vendor")
    request_sha256: Sha256Hex
    response: dict[str, Any] = Field(description="the response body as the vendor sent it")
    response_sha256: Sha256Hex
    response_body_sha256: Sha256Hex = Field(
        description="SHA-256 of the response bytes the client received")
    identifiers: Identifiers
    missing: list[Literal["seed", "token_ids", "logprobs", "runtime",
                          "system_fingerprint"]]


class VendorEnvelopePredicate(_Model):
    request_id: RequestId
    recorded_at: Annotated[AwareDatetime, Field(strict=False,
                                                description="RFC 3339 time with offset")]
    channel: Literal["vendor"]
    tier: Literal["semantic"]
    vendor: VendorCall
    assertions: AssertionSet | None = None

    @model_validator(mode="after")
    def _consistent(self) -> VendorEnvelopePredicate:
        v = self.vendor
        problems = vendor_call_problems(v.request, v.response)
        if problems:
            raise ValueError(problems[0])
        if v.request_sha256 != json_sha256(v.request):
            raise ValueError("vendor.request_sha256 is not the SHA-256 of JCS(vendor.request)")
        if v.response_sha256 != json_sha256(v.response):
            raise ValueError("vendor.response_sha256 is not the SHA-256 of "
                             "JCS(vendor.response)")
        if v.model_alias != v.request.get("model"):
            raise ValueError("vendor.model_alias must equal vendor.request.model")
        stated = identifiers_of(v.response, {})
        for name in ("system_fingerprint", "model", "id", "created"):
            if getattr(v.identifiers, name) != stated[name]:
                raise ValueError(f"vendor.identifiers.{name} must be the response's {name}")
        if list(v.missing) != missing_of(v.request, v.response):
            raise ValueError(f"vendor.missing must be {missing_of(v.request, v.response)}")
        return self


class VendorEnvelopeStatement(_Model):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True,
                              title="inference-ledger vendor envelope statement (v2)")

    type_: Literal["https://in-toto.io/Statement/v1"] = Field(alias="_type")
    subject: list[Subject] = Field(min_length=1, max_length=16)
    predicateType: Literal["urn:inference-ledger:envelope:v2"]
    predicate: VendorEnvelopePredicate

    @model_validator(mode="after")
    def _check_subject(self) -> VendorEnvelopeStatement:
        first = self.subject[0]
        if first.name != self.predicate.request_id:
            raise ValueError("subject[0].name must equal predicate.request_id")
        if first.digest.get("sha256") != self.predicate.vendor.response_sha256:
            raise ValueError("subject[0].digest.sha256 must be vendor.response_sha256")
        return self


# ------------------------------------------------------------------------ pure helpers
def json_sha256(value: Any) -> str:
    """SHA-256 of a JSON value's RFC 8785 bytes."""
    return sha256_hex(canonical_json(value))


def vendor_call_problems(request: Any, response: Any) -> list[str]:
    """Why a request/response pair is not a recordable vendor call (empty: it is)."""
    problems = []
    if not isinstance(request, dict) or not isinstance(request.get("model"), str) \
            or not request["model"]:
        problems.append("the request names no model")
    elif request.get("stream") is True:
        problems.append("streamed vendor answers are not recorded (stream: true)")
    if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
        problems.append("the response has no choices")
    return problems


def _choices_have(response: dict[str, Any], member: str) -> bool:
    choices = response.get("choices")
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and c.get(member) is not None for c in choices)


def missing_of(request: dict[str, Any], response: dict[str, Any]) -> list[str]:
    """What the record cannot offer a replay, from :data:`MISSING_VOCABULARY`."""
    missing = []
    if request.get("seed") is None:
        missing.append("seed")
    if not _choices_have(response, "token_ids"):
        missing.append("token_ids")
    if not _choices_have(response, "logprobs"):
        missing.append("logprobs")
    missing.append("runtime")              # a vendor never states its runtime
    if not isinstance(response.get("system_fingerprint"), str):
        missing.append("system_fingerprint")
    return missing


def identifiers_of(response: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    def text(name: str) -> str | None:
        value = response.get(name)
        return value if isinstance(value, str) else None

    created = response.get("created")
    return {"system_fingerprint": text("system_fingerprint"), "model": text("model"),
            "id": text("id"),
            "created": created if isinstance(created, int) and not isinstance(created, bool)
            else None,
            "headers": dict(headers)}


def vendor_runtime(name: str) -> dict[str, Any]:
    """The runtime a vendor's records are routed by (and its worker registers)."""
    return {"engine": VENDOR_ENGINE_PREFIX + name}


def vendor_fingerprint_id(name: str) -> str:
    return fingerprint_id(vendor_runtime(name))


def vendor_model_digest(name: str, model_alias: str) -> str:
    """What stands in a vendor record's ``model_sha256`` column: the SHA-256 of
    ``JCS({"model_alias": ..., "vendor": ...})`` (a vendor model has no weights to hash)."""
    return json_sha256({"vendor": name, "model_alias": model_alias})


def build_vendor_statement(*, request_id: str, recorded_at: str, name: str, base_url: str,
                           endpoint: str, request: dict[str, Any], response: dict[str, Any],
                           response_body: bytes, headers: dict[str, str],
                           assertions: dict[str, Any] | None = None) -> dict[str, Any]:
    """The v2 statement of one vendor call (the one producer-side builder)."""
    response_sha256 = json_sha256(response)
    predicate: dict[str, Any] = {
        "request_id": request_id, "recorded_at": recorded_at, "channel": "vendor",
        "tier": "semantic",
        "vendor": {"name": name, "base_url": base_url, "endpoint": endpoint,
                   "model_alias": request.get("model"), "request": request,
                   "request_sha256": json_sha256(request), "response": response,
                   "response_sha256": response_sha256,
                   "response_body_sha256": sha256_hex(response_body),
                   "identifiers": identifiers_of(response, headers),
                   "missing": missing_of(request, response)},
    }
    if assertions is not None:
        predicate["assertions"] = assertions
    return {"_type": STATEMENT_TYPE,
            "subject": [{"name": request_id, "digest": {"sha256": response_sha256}}],
            "predicateType": VENDOR_ENVELOPE_PREDICATE_TYPE, "predicate": predicate}


def validate_vendor_statement(obj: Any) -> VendorEnvelopeStatement:
    try:
        return VendorEnvelopeStatement.model_validate(obj)
    except ValidationError as exc:
        raise validation_failed(exc, "envelope payload", "invalid_envelope") from None


#: The largest token count the ledger stores (a PostgreSQL integer column).
MAX_TOKEN_COUNT = 2**31 - 1


def _tokens(usage: Any, name: str) -> int:
    value = usage.get(name) if isinstance(usage, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return 0
    if value > MAX_TOKEN_COUNT:
        raise ValidationFailed(f"vendor.response.usage.{name} is {value}; the ledger stores "
                               f"token counts up to {MAX_TOKEN_COUNT}", code="invalid_envelope")
    return value


def vendor_index_fields(statement: VendorEnvelopeStatement) -> IndexFields:
    p = statement.predicate
    v = p.vendor
    usage = v.response.get("usage")
    return IndexFields(
        request_id=p.request_id, recorded_at=p.recorded_at, channel=p.channel, tier=p.tier,
        model_sha256=vendor_model_digest(v.name, v.model_alias), model_name=v.model_alias,
        fingerprint_id=vendor_fingerprint_id(v.name),
        prompt_tokens=_tokens(usage, "prompt_tokens"),
        output_tokens=_tokens(usage, "completion_tokens"))


def vendor_envelope_json_schema() -> dict[str, Any]:
    schema = VendorEnvelopeStatement.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "urn:inference-ledger:envelope:v2:schema"
    return schema
