"""Errors of the service layer (not cryptographic): not found, conflict, forbidden, busy.

They share the core's base class so one handler maps every error to problem+json.
"""

from __future__ import annotations

from typing import Any

from ledger.core.errors import LedgerError


class NotFound(LedgerError):
    code = "not_found"


class Conflict(LedgerError):
    code = "conflict"

    def __init__(self, message: str, *, code: str | None = None, **extra: Any) -> None:
        super().__init__(message, code=code)
        self.extra = extra


class Gone(LedgerError):
    """The record exists but its content was erased (``extra`` carries the tombstone)."""

    code = "erased"

    def __init__(self, message: str, *, code: str | None = None, **extra: Any) -> None:
        super().__init__(message, code=code)
        self.extra = extra


class Unauthorized(LedgerError):
    code = "unauthorized"


class Forbidden(LedgerError):
    code = "forbidden"


class Unavailable(LedgerError):
    """The database or another dependency is down: retry later."""

    code = "unavailable"

    def __init__(self, message: str, *, retry_after: int = 2) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BadRequest(LedgerError):
    code = "bad_request"


class StoredTreeMismatch(LedgerError):
    """What the database holds does not verify against the log's own signed checkpoint
    (a stored tile, subtree hash or entry was changed): refuse to serve it. Not the
    caller's fault, not retryable; ``ledger audit`` names what was changed."""

    code = "log_integrity"

