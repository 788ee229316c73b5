"""Shared parameter types of the REST API, written once: request IDs, record IDs, digests,
fingerprints, aware datetimes, page size and cursor.

A time without a UTC offset is refused (422) by the type itself (pydantic's
``AwareDatetime``), in bodies and query strings alike.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query
from pydantic import AwareDatetime, Field

from ledger.core.envelope import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN, SHA256_HEX_PATTERN
from ledger.core.fingerprint import FINGERPRINT_HEX_DIGITS, FINGERPRINT_PREFIX

FINGERPRINT_PATTERN = rf"^{FINGERPRINT_PREFIX}[0-9a-f]{{{FINGERPRINT_HEX_DIGITS}}}$"
UUID_PATTERN = r"^[0-9a-fA-F-]{1,64}$"

#: A request ID in a body (``RequestId`` in a path, ``RequestIdQuery`` in a query string).
RequestIdField = Annotated[str, Field(min_length=1, max_length=REQUEST_ID_MAX_LENGTH,
                                      pattern=REQUEST_ID_PATTERN)]
RequestIdPath = Annotated[str, Path(max_length=REQUEST_ID_MAX_LENGTH,
                                    pattern=REQUEST_ID_PATTERN)]
RequestIdQuery = Annotated[str | None, Query(max_length=REQUEST_ID_MAX_LENGTH,
                                             pattern=REQUEST_ID_PATTERN)]
#: Verdict IDs use the request-ID alphabet.
RecordIdPath = RequestIdPath
#: A dispute, run or API-key ID (a UUID; a malformed one is a 404, not a 422).
UuidPath = Annotated[str, Path(max_length=64, pattern=UUID_PATTERN)]
Sha256Query = Annotated[str | None, Query(pattern=SHA256_HEX_PATTERN)]
FingerprintQuery = Annotated[str | None, Query(pattern=FINGERPRINT_PATTERN)]

#: A time with a UTC offset (RFC 3339), in a body.
AwareTime = AwareDatetime
AfterQuery = Annotated[AwareDatetime | None, Query(description="inclusive, RFC 3339")]
BeforeQuery = Annotated[AwareDatetime | None, Query(description="exclusive, RFC 3339")]

#: Every list endpoint pages the same way: ``limit`` and the opaque ``cursor`` that the
#: previous page returned as ``next_cursor`` (:mod:`ledger.services.pagination`).
Limit = Annotated[int, Query(ge=1, le=1000, description="page size")]
Cursor = Annotated[str | None, Query(max_length=400, pattern=r"^[A-Za-z0-9_-]*$",
                                     description="next_cursor of the previous page")]
