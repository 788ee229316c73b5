"""Recording calls to a hosted vendor API (the vendor channel, envelope v2).

When the upstream is a vendor (``Recorder.for_vendor``, ``ledger proxy --vendor NAME``)
nothing is asked of it that the caller did not ask: no token IDs, no logprobs, no seed
(a vendor may ignore them, bill for them or refuse them). The request goes out unchanged,
the answer comes back unchanged, and the envelope records the request and the response as
they were, the identifiers the vendor returned, and what is missing
(:mod:`ledger.core.vendor`). Its tier is ``semantic``; nothing claims ``token`` or
``bitwise``.

Streamed vendor answers (``stream: true``) are forwarded unrecorded and counted as
unrecordable (refused with ``strict``): the record keeps whole response bodies only.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from ledger.capture.exchange import SamplingDefaults
from ledger.core import jsonstrict
from ledger.core.assertions import assertion_set_json, parse_assertion_set
from ledger.core.envelope import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN
from ledger.core.errors import LedgerError
from ledger.core.vendor import ENDPOINTS, vendor_call_problems, vendor_fingerprint_id

#: Response headers recorded by default when the vendor sends them (version identifiers).
DEFAULT_PINNED_HEADERS = ("openai-version", "openai-model", "x-request-id")


class VendorConfigError(ValueError):
    """A vendor capture setting is wrong (name, assertions)."""


@dataclass(frozen=True)
class VendorConfig:
    """What a gateway states about the vendor it records."""

    name: str
    base_url: str
    pinned_headers: tuple[str, ...] = DEFAULT_PINNED_HEADERS
    assertions: dict[str, Any] | None = None
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,99}", self.name):
            raise VendorConfigError("a vendor name is 1-100 of a-z 0-9 . _ - (lower case)")
        if self.assertions is not None:
            try:
                parsed = parse_assertion_set(self.assertions)
            except ValueError as exc:
                raise VendorConfigError(str(exc)) from None
            object.__setattr__(self, "assertions", assertion_set_json(parsed))
        object.__setattr__(self, "pinned_headers",
                           tuple(h.lower() for h in self.pinned_headers))

    @property
    def fingerprint_id(self) -> str:
        return vendor_fingerprint_id(self.name)

    effective_channel = "vendor"
    effective_tier = "semantic"


@dataclass(frozen=True)
class VendorCaptured:
    request_id: str
    endpoint: str
    request: dict[str, Any]
    response: dict[str, Any]
    response_body: bytes
    headers: dict[str, str]


def endpoint_of(path: str) -> str | None:
    for endpoint in ENDPOINTS:               # chat/completions before completions
        if path.endswith("/" + endpoint):
            return endpoint
    return None


def _request_id(response: dict[str, Any]) -> str:
    rid = response.get("id")
    if isinstance(rid, str) and len(rid) <= REQUEST_ID_MAX_LENGTH \
            and re.fullmatch(REQUEST_ID_PATTERN, rid):
        return rid
    return f"vendor-{uuid.uuid4().hex}"


def plan_vendor(method: str, path: str, body: bytes) -> tuple[str, dict[str, Any]] | str | None:
    """(endpoint, request JSON) for a recordable call; a reason string for an unrecordable
    one; None for a call that is not a completion at all."""
    endpoint = endpoint_of(path) if method == "POST" else None
    if endpoint is None:
        return None
    try:
        request = jsonstrict.loads(body, what="request body")
    except LedgerError:
        return "the request body is not strict JSON"
    problems = vendor_call_problems(request, {"choices": []})
    return problems[0] if problems else (endpoint, request)


def capture_vendor(config: VendorConfig, endpoint: str, request: dict[str, Any],
                   response: httpx.Response, body: bytes) -> VendorCaptured | str:
    """The capture of one answered call, or why there is none."""
    if response.headers.get("content-encoding", "identity") != "identity":
        return "the vendor compressed its answer"
    try:
        parsed = jsonstrict.loads(body, what="vendor answer")
    except LedgerError:
        return "the vendor's answer is not strict JSON"
    problems = vendor_call_problems(request, parsed)
    if problems:
        return problems[0]
    headers = {h: response.headers[h] for h in config.pinned_headers if h in response.headers}
    return VendorCaptured(_request_id(parsed), endpoint, request, parsed, body, headers)
