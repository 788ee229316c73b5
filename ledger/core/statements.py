"""The ledger's own in-toto statements: verdicts and dispute events.

Both travel in DSSE envelopes like execution envelopes do, and both are leaves of the
transparency log, so a review trail is as tamper-evident as the records it reviews.

- ``urn:inference-ledger:verdict:v1``, signed by a replay worker's key (purpose
  ``worker``); subject: the envelope's request_id with the SHA-256 of its stored DSSE bytes;
  the log entry's ``ref`` is ``predicate.verdict_id``.
- ``urn:inference-ledger:dispute-event:v1``, signed by the ledger's service key (purpose
  ``ledger``); the same subject; ``ref`` is ``predicate.event_id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ledger.core.envelope import STATEMENT_TYPE

VERDICT_PREDICATE_TYPE = "urn:inference-ledger:verdict:v1"
EVENT_PREDICATE_TYPE = "urn:inference-ledger:dispute-event:v1"
OUTCOMES = ("reproduced", "diverged", "unverifiable", "error")


def _subject(request_id: str, envelope_dsse_sha256: str) -> list[dict[str, Any]]:
    return [{"name": request_id, "digest": {"sha256": envelope_dsse_sha256}}]


def verdict_statement(*, verdict_id: str, request_id: str, envelope_index: int,
                      envelope_dsse_sha256: str, outcome: str,
                      details: Mapping[str, Any]) -> dict[str, Any]:
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}")
    return {
        "_type": STATEMENT_TYPE,
        "subject": _subject(request_id, envelope_dsse_sha256),
        "predicateType": VERDICT_PREDICATE_TYPE,
        "predicate": {
            "verdict_id": verdict_id,
            "request_id": request_id,
            "envelope": {"log_index": envelope_index, "dsse_sha256": envelope_dsse_sha256},
            "outcome": outcome,
            **details,
        },
    }


def event_statement(*, event_id: str, dispute_id: str, seq: int, kind: str, actor: str,
                    at: str, request_id: str, envelope_dsse_sha256: str,
                    body: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": _subject(request_id, envelope_dsse_sha256),
        "predicateType": EVENT_PREDICATE_TYPE,
        "predicate": {"event_id": event_id, "dispute_id": dispute_id, "seq": seq,
                      "kind": kind, "actor": actor, "at": at, "request_id": request_id,
                      "body": dict(body)},
    }
