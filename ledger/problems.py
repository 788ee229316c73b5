"""RFC 9457 problem details: the one place that maps errors to HTTP status and body."""

from __future__ import annotations

from typing import Any

from ledger.core.errors import (
    FormatError,
    LedgerError,
    TileNotFoundError,
    ValidationFailed,
    VerificationError,
)
from ledger.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    StoredTreeMismatch,
    Unauthorized,
    Unavailable,
)

PROBLEM_TYPE_PREFIX = "urn:inference-ledger:problem:"
# The charset is stated so that clients which guess encodings for non-`application/json`
# types (requests does) decode non-ASCII details correctly.
MEDIA_TYPE = "application/problem+json; charset=utf-8"

_STATUS_BY_CLASS: tuple[tuple[type[LedgerError], int], ...] = (
    (StoredTreeMismatch, 500),
    (Unavailable, 503),
    (NotFound, 404),
    (TileNotFoundError, 404),
    (Conflict, 409),
    (Gone, 410),
    (Unauthorized, 401),
    (Forbidden, 403),
    (BadRequest, 400),
    (FormatError, 400),
    (ValidationFailed, 422),
    (VerificationError, 422),
)
_STATUS_BY_CODE = {"too_large": 413, "too_many_items": 413}

TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    409: "Conflict",
    410: "Gone",
    413: "Payload too large",
    422: "Unprocessable content",
    424: "Failed dependency",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
}


def status_for(exc: LedgerError) -> int:
    if exc.code in _STATUS_BY_CODE:
        return _STATUS_BY_CODE[exc.code]
    for cls, status in _STATUS_BY_CLASS:
        if isinstance(exc, cls):
            return status
    return 400


def problem(status: int, code: str, detail: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_PREFIX + code,
        "title": TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "code": code,
    }
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def problem_for(exc: LedgerError) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if isinstance(exc, ValidationFailed) and exc.errors:
        extra["errors"] = exc.errors
    if isinstance(exc, (Conflict, Gone)):
        extra.update(exc.extra)
    return problem(status_for(exc), exc.code, exc.message, **extra)
