"""The execution envelope: an in-toto Statement v1 whose predicate records one inference.

``predicateType`` is ``urn:inference-ledger:envelope:v1``. The statement travels as the
payload of a DSSE envelope (see :mod:`ledger.core.dsse`); ``docs/envelope.md`` documents
every field for third-party producers and ``ledger/schemas/envelope-v1.schema.json`` is
its JSON Schema (generated from these models; a test keeps the file current).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from ledger.core import jsonstrict
from ledger.core.errors import ValidationFailed, validation_failed
from ledger.core.fingerprint import fingerprint_id

if TYPE_CHECKING:
    from ledger.core.vendor import VendorEnvelopeStatement

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
ENVELOPE_PREDICATE_TYPE = "urn:inference-ledger:envelope:v1"
#: The vendor channel's predicate (:mod:`ledger.core.vendor`); v1 is unchanged.
VENDOR_ENVELOPE_PREDICATE_TYPE = "urn:inference-ledger:envelope:v2"

#: A request ID: characters JSON never escapes (log entries name it verbatim).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:@+=-]+$"
REQUEST_ID_MAX_LENGTH = 200
SHA256_HEX_PATTERN = r"^[0-9a-f]{64}$"

Sha256Hex = Annotated[str, Field(pattern=SHA256_HEX_PATTERN, description="lowercase hex SHA-256")]
RequestId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=REQUEST_ID_MAX_LENGTH,
        pattern=REQUEST_ID_PATTERN,
        description="Caller's unique request ID: 1-200 of A-Z a-z 0-9 . _ : @ + = -",
    ),
]
_ID_DESCRIPTION = "a token ID; at most the ledger's max_token_id"
TokenId = Annotated[int, Field(ge=0, description=_ID_DESCRIPTION)]
#: The items of the token lists (prompt, output, stop tokens) and of the logits digests:
#: published with :data:`TokenId`'s and :data:`Sha256Hex`'s JSON Schema, but their bounds
#: and pattern are checked once per list by :meth:`EnvelopePredicate._check_limits`
#: (``min``/``max``, one join and a byte translation, in C) instead of item by item by
#: pydantic: 23 -> 8 us for 512 prompt tokens and 22 -> 8 us for 128 digests, on the
#: ingest path. Only inside those lists: anywhere else use TokenId and Sha256Hex.
_ListedTokenId = Annotated[int, WithJsonSchema(
    {"description": _ID_DESCRIPTION, "minimum": 0, "type": "integer"})]
_ListedSha256Hex = Annotated[str, WithJsonSchema(
    {"description": "lowercase hex SHA-256", "pattern": SHA256_HEX_PATTERN, "type": "string"})]
_LOWER_HEX = b"0123456789abcdef"
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
DataSubject = Annotated[str, Field(
    pattern=r"^[A-Za-z0-9._:@+=-]{1,200}$",
    description="a pseudonymous data subject ID (e.g. a keyed hash of the gateway's user "
    "ID): never a name or an e-mail address; see docs/privacy.md")]
#: Strings the ledger stores in columns (``model_name``) or in the fingerprint's JSON
#: (the runtime) hold no NUL: PostgreSQL's text and jsonb cannot, and an envelope that
#: could not be stored is refused as invalid (422), not failed at the database (500).
NO_NUL = r"^[^\x00]*$"
ShortStr = Annotated[str, Field(min_length=1, max_length=200, pattern=NO_NUL)]
OptShortStr = Annotated[str | None, Field(default=None, max_length=200, pattern=NO_NUL)]
#: Integers a runtime carries (engine flags, informational fields) are I-JSON safe
#: (RFC 7493): the fingerprint is their RFC 8785 form, which has no larger integers
#: (checked in :class:`Runtime`'s validator: as a bound in this union, a larger integer
#: would be taken as a float).
MAX_SAFE_INT = 2**53 - 1
FlagValue = (Annotated[str, Field(max_length=1000, pattern=NO_NUL)] | int | float | bool
             | Annotated[list[Annotated[str, Field(max_length=200, pattern=NO_NUL)]],
                         Field(max_length=256)]
             | None)


@dataclass(frozen=True, slots=True)
class Limits:
    max_prompt_tokens: int = 262_144
    max_output_tokens: int = 65_536
    max_token_id: int = 16_777_215
    max_top_logprobs: int = 20


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Subject(_Model):
    name: ShortStr
    digest: dict[Annotated[str, Field(pattern=r"^[a-z0-9-]{1,32}$")], Annotated[
        str, Field(pattern=r"^[0-9a-f]{32,128}$")]] = Field(min_length=1, max_length=8)


class Artifacts(_Model):
    model_sha256: Sha256Hex = Field(
        description="Model directory hash (docs/envelope.md#artifact-hash)")
    tokenizer_sha256: Sha256Hex | None = None
    chat_template_sha256: Sha256Hex | None = None
    model_name: ShortStr


class Sampling(_Model):
    temperature: FiniteFloat = Field(ge=0.0, le=100.0, description="0 = greedy")
    top_p: FiniteFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=1_000_000, description="0 or -1 = disabled")
    min_p: FiniteFloat = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: FiniteFloat = Field(default=1.0, gt=0.0, le=100.0)
    presence_penalty: FiniteFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat = Field(default=0.0, ge=-2.0, le=2.0)
    max_tokens: int = Field(ge=1, description="at most the ledger's max_output_tokens")
    seed: int | None = Field(default=None, ge=0, le=2**53 - 1,
                             description="I-JSON safe integer (RFC 7493): at most 2**53 - 1")
    stop_token_ids: list[_ListedTokenId] = Field(default_factory=list, max_length=1024)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, description="top-k logprobs recorded per step")


class Runtime(BaseModel):
    """Fields that change numerics (hashed into ``fingerprint_id``) plus informational extras."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    engine: ShortStr
    engine_version: ShortStr
    device: ShortStr = Field(description='"cpu" or "cuda"')
    dtype: ShortStr = Field(description='"float32", "bfloat16" or "float16"')
    batch_invariant: bool
    torch_version: OptShortStr
    cuda_version: OptShortStr
    cublas_version: OptShortStr
    driver_version: OptShortStr
    gpu_name: OptShortStr
    compute_capability: OptShortStr
    device_count: int | None = Field(default=None, ge=0, le=4096)
    tensor_parallel_size: int | None = Field(default=None, ge=1, le=4096)
    attention_backend: OptShortStr
    quantization: OptShortStr
    cpu_isa: OptShortStr
    cpu_threads: int | None = Field(default=None, ge=1, le=65536)
    engine_flags: dict[Annotated[str, Field(max_length=200, pattern=NO_NUL)],
                       FlagValue] = Field(default_factory=dict, max_length=256)

    @model_validator(mode="after")
    def _extras_are_scalars(self) -> Runtime:
        for name, value in self.engine_flags.items():
            if _unsafe_int(value):
                raise ValueError(f"engine flag {name!r} is an integer beyond +-(2**53 - 1) "
                                 "(RFC 7493)")
        extras = self.model_extra or {}
        if len(extras) > 64:
            raise ValueError("runtime holds more than 64 informational fields")
        for name, value in extras.items():
            if len(name) > 100 or not (value is None or isinstance(value, (bool, int, float))
                                       or (isinstance(value, str) and len(value) <= 1000)):
                raise ValueError(f"informational runtime field {name!r} must be a JSON "
                                 "scalar (strings up to 1000 characters)")
            if _unsafe_int(value):
                raise ValueError(f"informational runtime field {name!r} is an integer "
                                 "beyond +-(2**53 - 1) (RFC 7493)")
            if "\x00" in name or (isinstance(value, str) and "\x00" in value):
                raise ValueError(f"informational runtime field {name!r} holds a NUL "
                                 "character (PostgreSQL cannot store it)")
        return self


def _unsafe_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SAFE_INT


class TopLogprob(_Model):
    token_id: TokenId
    logprob: FiniteFloat


class Output(_Model):
    token_ids: list[_ListedTokenId]
    finish_reason: Literal["stop", "length", "abort"]
    logprobs: list[FiniteFloat] | None = Field(
        default=None, description="chosen token's logprob per step (same length as token_ids)")
    top_logprobs: list[list[TopLogprob]] | None = None
    logits_sha256: list[_ListedSha256Hex] | None = Field(
        default=None, description="SHA-256 of the fp32 logits row per step, little-endian")


class Tolerance(_Model):
    max_abs_logprob_diff: FiniteFloat = Field(ge=0.0, le=100.0)


class EnvelopePredicate(_Model):
    request_id: RequestId
    recorded_at: Annotated[AwareDatetime, Field(strict=False,
                                                description="RFC 3339 time with offset")]
    channel: Literal["deterministic", "performance"]
    tier: Literal["bitwise", "token", "tolerance"]
    tolerance: Tolerance | None = None
    artifacts: Artifacts
    prompt_token_ids: list[_ListedTokenId] = Field(min_length=1)
    sampling: Sampling
    runtime: Runtime
    output: Output
    #: optional pseudonym of the person the prompt is about (docs/privacy.md): the
    #: ledger encrypts the record under this subject's data keys, so it can be erased
    data_subject: DataSubject | None = None

    @model_validator(mode="after")
    def _check_limits(self, info: ValidationInfo) -> EnvelopePredicate:
        limits: Limits = (info.context or {}).get("limits") or Limits()
        _check_tokens(self.prompt_token_ids, limits.max_prompt_tokens, limits.max_token_id,
                      "prompt_token_ids")
        _check_tokens(self.output.token_ids, limits.max_output_tokens, limits.max_token_id,
                      "output.token_ids")
        _check_tokens(self.sampling.stop_token_ids, 1024, limits.max_token_id,
                      "sampling.stop_token_ids")
        if self.sampling.max_tokens > limits.max_output_tokens:
            raise ValueError(f"sampling.max_tokens exceeds the limit {limits.max_output_tokens}")
        if self.sampling.logprobs is not None and self.sampling.logprobs > limits.max_top_logprobs:
            raise ValueError(f"sampling.logprobs exceeds the limit {limits.max_top_logprobs}")
        n = len(self.output.token_ids)
        if n > self.sampling.max_tokens:
            raise ValueError("output.token_ids is longer than sampling.max_tokens")
        for name in ("logprobs", "top_logprobs", "logits_sha256"):
            seq = getattr(self.output, name)
            if seq is not None and len(seq) != n:
                raise ValueError(f"output.{name} has {len(seq)} entries for {n} output tokens")
        if self.output.logits_sha256 is not None:
            _check_digests(self.output.logits_sha256, "output.logits_sha256")
        if self.output.top_logprobs is not None:
            for step in self.output.top_logprobs:
                if len(step) > limits.max_top_logprobs:
                    raise ValueError("a step of output.top_logprobs exceeds the top-k limit")
                for entry in step:
                    if entry.token_id > limits.max_token_id:
                        raise ValueError("output.top_logprobs holds an out-of-range token ID")
        if (self.tier == "tolerance") != (self.tolerance is not None):
            raise ValueError('tolerance is required for tier "tolerance" and only then')
        return self


def _check_tokens(ids: list[int], max_len: int, max_id: int, name: str) -> None:
    if len(ids) > max_len:
        raise ValueError(f"{name} has {len(ids)} tokens; the limit is {max_len}")
    if ids and max(ids) > max_id:
        raise ValueError(f"{name} holds token ID {max(ids)} above the limit {max_id}")
    if ids and min(ids) < 0:
        raise ValueError(f"{name} holds token ID {min(ids)}; token IDs are at least 0")


def _check_digests(digests: list[str], name: str) -> None:
    """Every item 64 characters of lowercase hex (:data:`SHA256_HEX_PATTERN`)."""
    joined = "".join(digests)
    if (set(map(len, digests)) - {64} or not joined.isascii()
            or joined.encode().translate(None, _LOWER_HEX)):
        bad = next(i for i, d in enumerate(digests)
                   if len(d) != 64 or not d.isascii() or d.encode().translate(None, _LOWER_HEX))
        raise ValueError(f"{name}[{bad}] is not a lowercase hex SHA-256")


class EnvelopeStatement(_Model):
    """An in-toto Statement v1 carrying an :class:`EnvelopePredicate`."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True,
                              title="inference-ledger execution envelope statement v1")

    type_: Literal["https://in-toto.io/Statement/v1"] = Field(alias="_type")
    subject: list[Subject] = Field(min_length=1, max_length=16)
    predicateType: Literal["urn:inference-ledger:envelope:v1"]
    predicate: EnvelopePredicate

    @model_validator(mode="after")
    def _check_subject(self) -> EnvelopeStatement:
        first = self.subject[0]
        if first.name != self.predicate.request_id:
            raise ValueError("subject[0].name must equal predicate.request_id")
        want = output_digest(self.predicate.output.token_ids)
        if first.digest.get("sha256") != want:
            raise ValueError(
                "subject[0].digest.sha256 must be the SHA-256 of the output token IDs "
                "as a JSON array without spaces (docs/envelope.md#subject)")
        return self


def output_digest(token_ids: list[int]) -> str:
    """SHA-256 of the output token IDs written as ``[1,2,3]`` (RFC 8785 form of the list).
    orjson writes a list of plain ints exactly so (~20x faster than joining ``str`` of
    each: 11 -> 3 us for 128 tokens, on the ingest path); anything else (a bool, an int
    subclass, a NumPy integer, an int beyond 64 bits; a sequence not a list) is written by
    ``str`` as before."""
    text = None
    if type(token_ids) is list and set(map(type, token_ids)) <= {int}:
        with contextlib.suppress(orjson.JSONEncodeError):  # beyond 64 bits
            text = orjson.dumps(token_ids)
    if text is None:
        text = ("[" + ",".join(map(str, token_ids)) + "]").encode()
    return hashlib.sha256(text).hexdigest()


@dataclass(frozen=True, slots=True)
class IndexFields:
    """The envelope fields the ledger stores as columns for search."""

    request_id: str
    recorded_at: datetime
    channel: str
    tier: str
    model_sha256: str
    model_name: str
    fingerprint_id: str
    prompt_tokens: int
    output_tokens: int
    data_subject: str | None = None  # not a column: it picks the record's data key


def parse_statement(payload: bytes, limits: Limits | None = None
                    ) -> EnvelopeStatement | VendorEnvelopeStatement:
    """Parse a DSSE payload (already signature-checked) into a validated statement: a v1
    execution envelope, or a v2 vendor envelope (:mod:`ledger.core.vendor`)."""
    obj = jsonstrict.loads(payload, what="envelope payload")
    if isinstance(obj, dict) and obj.get("predicateType") == VENDOR_ENVELOPE_PREDICATE_TYPE:
        from ledger.core.vendor import validate_vendor_statement

        return validate_vendor_statement(obj)
    if isinstance(obj, dict) and obj.get("predicateType") != ENVELOPE_PREDICATE_TYPE:
        raise ValidationFailed(
            f"predicateType must be {ENVELOPE_PREDICATE_TYPE!r} or "
            f"{VENDOR_ENVELOPE_PREDICATE_TYPE!r}, got {obj.get('predicateType')!r}",
            code="wrong_predicate_type",
        )
    return validate_statement(obj, limits)


def validate_statement(obj: Any, limits: Limits | None = None) -> EnvelopeStatement:
    try:
        return EnvelopeStatement.model_validate(obj, context={"limits": limits or Limits()})
    except ValidationError as exc:
        raise validation_failed(exc, "envelope payload", "invalid_envelope") from None


_FP_CACHE: dict[str, str] = {}


def _fingerprint_of(runtime: Runtime) -> str:
    """fingerprint_id of a runtime; a gateway sends the same runtime millions of times, so
    results are memoised (bounded) by the ``repr`` of its field values and extra fields:
    JSON scalars, lists and dicts of them, whose ``repr`` tells any two values apart
    (``1``, ``1.0`` and ``True`` too), and without making the JSON form first (a third of
    the cost)."""
    key = repr((runtime.__dict__, runtime.__pydantic_extra__))
    found = _FP_CACHE.get(key)
    if found is None:
        found = fingerprint_id(runtime.model_dump(mode="json"))
        if len(_FP_CACHE) > 10_000:
            _FP_CACHE.clear()
        _FP_CACHE[key] = found
    return found


def index_fields(statement: EnvelopeStatement | VendorEnvelopeStatement) -> IndexFields:
    if not isinstance(statement, EnvelopeStatement):
        from ledger.core.vendor import vendor_index_fields

        return vendor_index_fields(statement)
    p = statement.predicate
    return IndexFields(
        request_id=p.request_id,
        recorded_at=p.recorded_at,
        channel=p.channel,
        tier=p.tier,
        model_sha256=p.artifacts.model_sha256,
        model_name=p.artifacts.model_name,
        fingerprint_id=_fingerprint_of(p.runtime),
        prompt_tokens=len(p.prompt_token_ids),
        output_tokens=len(p.output.token_ids),
        data_subject=p.data_subject,
    )


def runtime_of(statement: EnvelopeStatement | VendorEnvelopeStatement) -> dict[str, Any]:
    """The runtime a statement is routed by: v1's ``predicate.runtime``; for a vendor
    record ``{"engine": "vendor:<name>"}``."""
    if isinstance(statement, EnvelopeStatement):
        return statement.predicate.runtime.model_dump(mode="json")
    from ledger.core.vendor import vendor_runtime

    return vendor_runtime(statement.predicate.vendor.name)


def envelope_json_schema() -> dict[str, Any]:
    schema = EnvelopeStatement.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "urn:inference-ledger:envelope:v1:schema"
    return schema
