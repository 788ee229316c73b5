"""The ledger's own in-toto statements: verdicts and dispute events.

Both travel in DSSE envelopes like execution envelopes do, and both are leaves of the
transparency log, so a review trail is as tamper-evident as the records it reviews.

- ``urn:inference-ledger:verdict:v1``, signed by a replay worker's key (purpose
  ``worker``); subject: the envelope's request_id with the SHA-256 of its stored DSSE bytes;
  the log entry's ``ref`` is ``predicate.verdict_id``.
- ``urn:inference-ledger:dispute-event:v1``, signed by the ledger's service key (purpose
  ``ledger``); the same subject; ``ref`` is ``predicate.event_id``.
- ``urn:inference-ledger:admin-event:v1``, signed by the ledger's service key: a key
  registration or revocation, or an API key's creation, revocation or role change (the
  registry through which producer and worker keys are trusted); subject: the signing key
  (``signing_key:<keyid>``, digest its key ID) or the API key (``api_key:<id>``, digest
  its stored hash); ``ref`` is ``predicate.event_id``.
- ``urn:inference-ledger:bundle:v1``, signed by the ledger's service key: the manifest of
  an export bundle (origin, checkpoint, selection, creation time, record count); subject:
  the SHA-256 of every record line after the header.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ledger.core.envelope import STATEMENT_TYPE
from ledger.core.states import VerdictOutcome

VERDICT_PREDICATE_TYPE = "urn:inference-ledger:verdict:v1"
EVENT_PREDICATE_TYPE = "urn:inference-ledger:dispute-event:v1"
ADMIN_EVENT_PREDICATE_TYPE = "urn:inference-ledger:admin-event:v1"
BUNDLE_PREDICATE_TYPE = "urn:inference-ledger:bundle:v1"
OUTCOMES = tuple(VerdictOutcome)
ADMIN_EVENT_KINDS = ("signing_key.registered", "signing_key.revoked", "api_key.created",
                     "api_key.revoked", "api_key.role_changed")


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


def timestamp(value: datetime | None) -> str | None:
    """The one rendering of a time in ledger statements: RFC 3339 in UTC, microseconds
    kept (what PostgreSQL stores), ``None`` for no time."""
    if value is None:
        return None
    if value.tzinfo is None:
        raise ValueError("a naive datetime in a signed statement")
    return value.astimezone(UTC).isoformat()


def signing_key_record(*, keyid: str, public_key: bytes, purpose: str, name: str,
                       not_before: datetime, not_after: datetime | None, status: str,
                       revoked_at: datetime | None,
                       revoked_reason: str | None = None) -> dict[str, Any]:
    """A signing key as an admin event states it (everything a verifier needs)."""
    return {"keyid": keyid, "public_key": base64.b64encode(public_key).decode(),
            "purpose": purpose, "name": name, "not_before": timestamp(not_before),
            "not_after": timestamp(not_after), "status": status,
            "revoked_at": timestamp(revoked_at), "revoked_reason": revoked_reason}


def api_key_record(*, id: str, name: str, role: str, prefix: str, key_hash: bytes,
                   revoked_at: datetime | None) -> dict[str, Any]:
    """An API key as an admin event states it (never the key itself: its stored hash)."""
    return {"id": id, "name": name, "role": role, "prefix": prefix,
            "key_hash": key_hash.hex(), "revoked_at": timestamp(revoked_at)}


def admin_event_statement(*, event_id: str, kind: str, actor: str, at: datetime,
                          key: Mapping[str, Any] | None = None,
                          api_key: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if kind not in ADMIN_EVENT_KINDS:
        raise ValueError(f"unknown admin event kind {kind!r}")
    if kind.startswith("signing_key."):
        if key is None or api_key is not None:
            raise ValueError(f"a {kind} event states a signing key")
        target = str(key["keyid"])
        subject = [{"name": f"signing_key:{target}", "digest": {"sha256": target}}]
        body: dict[str, Any] = {"key": dict(key)}
    else:
        if api_key is None or key is not None:
            raise ValueError(f"a {kind} event states an API key")
        target = str(api_key["id"])
        subject = [{"name": f"api_key:{target}", "digest": {"sha256": api_key["key_hash"]}}]
        body = {"api_key": dict(api_key)}
    return {
        "_type": STATEMENT_TYPE,
        "subject": subject,
        "predicateType": ADMIN_EVENT_PREDICATE_TYPE,
        "predicate": {"event_id": event_id, "kind": kind, "actor": actor, "target": target,
                      "at": timestamp(at), **body},
    }


def bundle_statement(*, records_sha256: str, predicate: Mapping[str, Any]) -> dict[str, Any]:
    """The signed manifest of an export bundle (see :mod:`ledger.core.bundle`)."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": "records", "digest": {"sha256": records_sha256}}],
        "predicateType": BUNDLE_PREDICATE_TYPE,
        "predicate": dict(predicate),
    }
