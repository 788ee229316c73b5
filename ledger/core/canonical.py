"""Canonical JSON (RFC 8785, JCS): the one way we turn a JSON value into bytes to hash.

Used for fingerprints, log entries and everything the ledger itself signs. Producer
payloads are never re-serialised: their bytes are verified exactly as received.
"""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785


def canonical_json(value: Any) -> bytes:
    """RFC 8785 canonical bytes of a JSON-compatible value."""
    return rfc8785.dumps(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
