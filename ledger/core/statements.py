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
  its stored hash); ``ref`` is ``predicate.event_id``. A re-verification policy's
  creation, pause, resumption and deletion (``policy:<id>``, digest the SHA-256 of the
  stated policy) and each window the beat claims for it (``reverification_run:<id>``)
  are admin events too, and so is each fingerprint gate it claims (``gate.claimed``), so
  scheduled re-verification and gates cannot be silenced in the database; so is each
  replay matrix run requested (``matrix.requested``: the model, the fingerprints it goes
  to, the cells, the SHA-256 of the records sampled, who asked), so a run's request
  cannot be rewritten or planted there either.
- ``urn:inference-ledger:matrix-run:v1``, signed by the replay worker that ran it (purpose
  ``worker``, like a verdict: it states what that worker measured on its runtime): a
  replay matrix report (``ledger.replay.matrix``); subject: ``matrix_run:<run_id>`` with
  the SHA-256 of the report's canonical bytes (:func:`matrix_report_bytes`, which the
  ``matrix_runs`` row stores); ``ref`` is ``predicate.run_id``.
- ``urn:inference-ledger:bundle:v1``, signed by the ledger's service key: the manifest of
  an export bundle (origin, checkpoint, selection, creation time, record count); subject:
  the SHA-256 of every record line after the header.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ledger.core.canonical import canonical_json, sha256_hex
from ledger.core.envelope import STATEMENT_TYPE
from ledger.core.errors import FormatError, LedgerError
from ledger.core.states import VerdictOutcome

VERDICT_PREDICATE_TYPE = "urn:inference-ledger:verdict:v1"
EVENT_PREDICATE_TYPE = "urn:inference-ledger:dispute-event:v1"
ADMIN_EVENT_PREDICATE_TYPE = "urn:inference-ledger:admin-event:v1"
BUNDLE_PREDICATE_TYPE = "urn:inference-ledger:bundle:v1"
MATRIX_RUN_PREDICATE_TYPE = "urn:inference-ledger:matrix-run:v1"
OUTCOMES = tuple(VerdictOutcome)
POLICY_EVENT_KINDS = ("policy.created", "policy.paused", "policy.resumed", "policy.deleted")
RUN_EVENT_KIND = "policy.window_claimed"
GATE_EVENT_KIND = "gate.claimed"
RETENTION_EVENT_KIND = "retention.created"
MATRIX_EVENT_KIND = "matrix.requested"
ADMIN_EVENT_KINDS = ("signing_key.registered", "signing_key.revoked", "api_key.created",
                     "api_key.revoked", "api_key.role_changed", *POLICY_EVENT_KINDS,
                     RUN_EVENT_KIND, GATE_EVENT_KIND, RETENTION_EVENT_KIND, MATRIX_EVENT_KIND)


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


def parse_timestamp(value: Any, what: str, error: type[LedgerError]) -> datetime:
    """A time a signed statement states (RFC 3339 with an offset); ``error`` otherwise."""
    if not isinstance(value, str):
        raise error(f"{what} must be an RFC 3339 time")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise error(f"{what} is not an RFC 3339 time") from exc
    if parsed.tzinfo is None:
        raise error(f"{what} lacks a UTC offset")
    return parsed


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


def policy_record(*, id: str, name: str, interval_seconds: int, sample_size: int | None,
                  sample_rate: float | None, model_sha256: str | None,
                  fingerprint_id: str | None, channel: str | None, min_age_seconds: int,
                  max_age_seconds: int | None, enabled: bool,
                  drift_alert_threshold: float | None, created_by: str,
                  created_at: datetime, first_window_start: datetime) -> dict[str, Any]:
    """A re-verification policy as an admin event states it: every setting the beat and
    the API act on (a row that differs from its latest event is reported by audit)."""
    return {"id": id, "name": name, "interval_seconds": interval_seconds,
            "sample_size": sample_size, "sample_rate": sample_rate,
            "model_sha256": model_sha256, "fingerprint_id": fingerprint_id,
            "channel": channel, "min_age_seconds": min_age_seconds,
            "max_age_seconds": max_age_seconds, "enabled": enabled,
            "drift_alert_threshold": drift_alert_threshold, "created_by": created_by,
            "created_at": timestamp(created_at),
            "first_window_start": timestamp(first_window_start)}


def run_record(*, id: str, policy_id: str, window_start: datetime, window_end: datetime,
               sampled: int) -> dict[str, Any]:
    """A claimed re-verification window as its admin event states it."""
    return {"id": id, "policy_id": policy_id, "window_start": timestamp(window_start),
            "window_end": timestamp(window_end), "sampled": sampled}


def gate_record(*, id: str, new_fingerprint: str, model_sha256: str,
                baseline_fingerprint: str, sampled: int) -> dict[str, Any]:
    """A fingerprint gate the beat claimed (once per new fingerprint and model) as its admin
    event states it."""
    return {"id": id, "new_fingerprint": new_fingerprint, "model_sha256": model_sha256,
            "baseline_fingerprint": baseline_fingerprint, "sampled": sampled}


def retention_record(*, id: str, name: str, channel: str | None, model_sha256: str | None,
                     erase_after_days: int, enabled: bool, created_by: str,
                     created_at: datetime) -> dict[str, Any]:
    """A retention policy as its admin event states it: the beat erases only by a policy
    whose row equals its signed leaf."""
    return {"id": id, "name": name, "channel": channel, "model_sha256": model_sha256,
            "erase_after_days": erase_after_days, "enabled": enabled,
            "created_by": created_by, "created_at": timestamp(created_at)}


def matrix_record(*, id: str, model_sha256: str, fingerprints: list[str], cells: list[str],
                  records: list[tuple[int, str]], tolerance: float | None,
                  requested_by: str) -> dict[str, Any]:
    """A replay matrix run's request as its admin event states it: ``records`` (log index,
    request id) are stated by their SHA-256 (RFC 8785 of the sorted pairs)."""
    return {"id": id, "model_sha256": model_sha256, "fingerprints": list(fingerprints),
            "cells": list(cells),
            "records_sha256": sha256_hex(canonical_json(sorted([i, r] for i, r in records))),
            "records": len(records), "tolerance": tolerance, "requested_by": requested_by}


def record_digest(record: Mapping[str, Any]) -> str:
    """The subject digest of a policy or run admin event: SHA-256 of the record's canonical
    JSON (RFC 8785, as the statement is signed: the same digest after a round trip)."""
    return sha256_hex(canonical_json(record))


def _admin_body(kind: str, stated: dict[str, Mapping[str, Any] | None]
                ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(target, subject, body) of an admin event of ``kind`` stating exactly one of
    ``stated`` (its name: what the kind states)."""
    field_ = ("key" if kind.startswith("signing_key.") else "api_key"
              if kind.startswith("api_key.") else "run" if kind == RUN_EVENT_KIND
              else "gate" if kind == GATE_EVENT_KIND
              else "retention" if kind == RETENTION_EVENT_KIND
              else "matrix" if kind == MATRIX_EVENT_KIND else "policy")
    given = [name for name, value in stated.items() if value is not None]
    if given != [field_]:
        raise ValueError(f"a {kind} event states its {field_} and nothing else")
    record = stated[field_]
    assert record is not None
    if field_ == "key":
        target = str(record["keyid"])
        digest, name = target, f"signing_key:{target}"
    elif field_ == "api_key":
        target = str(record["id"])
        digest, name = str(record["key_hash"]), f"api_key:{target}"
    else:
        target = str(record["id"])
        digest = record_digest(record)
        name = {"policy": "policy", "run": "reverification_run", "gate": "reverification_run",
                "retention": "retention_policy", "matrix": "matrix_run"}[field_] + f":{target}"
    return target, [{"name": name, "digest": {"sha256": digest}}], {field_: dict(record)}


def admin_event_statement(*, event_id: str, kind: str, actor: str, at: datetime,
                          key: Mapping[str, Any] | None = None,
                          api_key: Mapping[str, Any] | None = None,
                          policy: Mapping[str, Any] | None = None,
                          run: Mapping[str, Any] | None = None,
                          gate: Mapping[str, Any] | None = None,
                          retention: Mapping[str, Any] | None = None,
                          matrix: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if kind not in ADMIN_EVENT_KINDS:
        raise ValueError(f"unknown admin event kind {kind!r}")
    target, subject, body = _admin_body(kind, {"key": key, "api_key": api_key,
                                               "policy": policy, "run": run, "gate": gate,
                                               "retention": retention, "matrix": matrix})
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


def matrix_report_bytes(report: Mapping[str, Any]) -> bytes:
    """The one rendering of a matrix report that is stored, hashed and served (RFC 8785):
    the signed statement carries the report and the SHA-256 of these bytes."""
    return canonical_json(dict(report))


def matrix_run_statement(*, run_id: str, report: Mapping[str, Any], job_id: str | None,
                         worker: Mapping[str, Any], at: datetime) -> dict[str, Any]:
    """A replay matrix report as the worker that ran it signs it."""
    digest = sha256_hex(matrix_report_bytes(report))
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"matrix_run:{run_id}", "digest": {"sha256": digest}}],
        "predicateType": MATRIX_RUN_PREDICATE_TYPE,
        "predicate": {"run_id": run_id, "job_id": job_id, "at": timestamp(at),
                      "worker": dict(worker), "report_sha256": digest,
                      "report": dict(report)},
    }


def matrix_run_digest(statement: Mapping[str, Any]) -> str:
    """The report digest a signed matrix-run statement states, after checking that its
    report hashes to it and that its subject names it; raises :class:`FormatError`."""
    try:
        p = statement["predicate"]
        digest = sha256_hex(matrix_report_bytes(p["report"]))
        subject = statement["subject"][0]
        named = (subject["name"], subject["digest"]["sha256"])
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise FormatError(f"the signed matrix run lacks {exc}") from None
    if statement.get("predicateType") != MATRIX_RUN_PREDICATE_TYPE:
        raise FormatError("the signed statement is not a matrix run")
    if p.get("report_sha256") != digest or named != (f"matrix_run:{p.get('run_id')}", digest):
        raise FormatError("the signed matrix report does not hash to the digest its "
                          "statement names")
    return digest
