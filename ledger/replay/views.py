"""What the API serves about envelopes, verdicts and disputes, derived from signed bytes.

The rows of ``envelopes``, ``verdicts``, ``dispute_events`` and ``disputes`` carry plain
columns for search and routing; an insider with the database can edit them without
touching a signature. So nothing served rests on those columns alone: these functions
rebuild each value from the stored DSSE bytes (the exact bytes that were signed and that
the log commits to), and ``ledger audit`` cross-checks every column against them with the
same functions.

Pure functions over bytes and dicts: no database, no HTTP.

- :func:`envelope_index`: the index fields of an envelope (what ``envelopes`` columns hold).
- :func:`verdict_view`: a verdict's outcome, tier, details, subject and worker.
- :func:`event_view`: a dispute event's kind, actor, seq, body, time.
- :class:`DisputeTrail`: a dispute's state, resolution, note, resolver and verdict, folded
  from its signed events in order (the ``disputes`` row is a cache of this).
"""

from __future__ import annotations

import binascii
import hashlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
import orjson

from ledger.core.errors import FormatError
from ledger.core.statements import (
    EVENT_PREDICATE_TYPE,
    VERDICT_PREDICATE_TYPE,
    matrix_run_digest,
)

ENVELOPE_INDEX_FIELDS = ("request_id", "recorded_at", "channel", "tier", "model_sha256",
                         "model_name", "fingerprint_id", "prompt_tokens", "output_tokens",
                         "keyids", "dsse_sha256")
"""The ``envelopes`` columns that are derived from the signed payload (all but
``log_index``, which the log entry vouches for, and ``ingested_at``, the ledger's own
clock)."""

VERDICT_FIELDS = ("verdict_id", "request_id", "envelope_index", "outcome", "tier",
                  "worker_id", "fingerprint_id", "details")
EVENT_FIELDS = ("event_id", "dispute_id", "seq", "kind", "actor", "body", "at")
DISPUTE_FIELDS = ("request_id", "state", "resolution", "resolution_note", "resolved_by",
                  "verdict_id")
_VERDICT_HEAD = ("verdict_id", "request_id", "envelope")


class SignedRecordError(FormatError):
    """Stored DSSE bytes that do not hold the statement their table says they hold."""

    code = "bad_signed_record"


@dataclass(frozen=True, slots=True)
class Signed:
    """The parts of a stored DSSE envelope the views need (signatures are not checked
    here: ``ledger audit --signatures`` does that)."""

    payload: bytes
    payload_type: str
    keyids: tuple[str, ...]
    statement: dict[str, Any]


_STORED_PREFIX = b'{"payload":"'


def open_signed(dsse_bytes: bytes) -> Signed:
    """Parse stored DSSE bytes and their payload (no signature check).

    Stored bytes are in canonical form (``dsse.canonical_envelope_bytes``: ``payload``
    first, then ``payloadType`` and ``signatures``), so the payload's base64 is sliced out
    rather than parsed with the rest; anything else goes through the JSON parser."""
    try:
        end = dsse_bytes.find(b'"', len(_STORED_PREFIX))
        if dsse_bytes.startswith(_STORED_PREFIX) and dsse_bytes[end + 1:end + 2] == b",":
            payload_b64: Any = dsse_bytes[len(_STORED_PREFIX):end]
            wrapper = orjson.loads(b"{" + dsse_bytes[end + 2:])
        else:
            wrapper = orjson.loads(dsse_bytes)
            payload_b64 = wrapper["payload"]
        if not isinstance(payload_b64, (str, bytes)):
            raise TypeError("payload is not a string")
        payload = binascii.a2b_base64(payload_b64, strict_mode=True)
        statement = orjson.loads(payload)
        keyids = tuple(s["keyid"] for s in wrapper["signatures"])
        payload_type = wrapper["payloadType"]
    except (orjson.JSONDecodeError, binascii.Error, KeyError, TypeError, ValueError) as exc:
        raise SignedRecordError(f"the stored DSSE bytes do not parse: {exc}") from None
    if not isinstance(statement, dict) or not isinstance(statement.get("predicate"), dict):
        raise SignedRecordError("the signed payload is not an in-toto statement")
    return Signed(payload, payload_type, keyids, statement)


def parse_time(value: Any) -> datetime:
    if not isinstance(value, str):
        raise SignedRecordError(f"a signed time must be a string, not {value!r}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        from pydantic import TypeAdapter, ValidationError

        try:
            parsed = TypeAdapter(datetime).validate_python(value)
        except ValidationError as exc:
            raise SignedRecordError(f"signed time {value!r} does not parse") from exc
    return parsed


_FP_BY_RUNTIME: dict[bytes, str] = {}


def runtime_fingerprint(runtime: Any) -> str:
    """``fingerprint_id`` of a signed runtime object, exactly as ingest computes it (through
    the Runtime model); memoised by the runtime's bytes, since a gateway signs the same
    runtime millions of times."""
    return _runtime_fingerprint_of(orjson.dumps(runtime), runtime)


def _runtime_fingerprint_of(key: bytes, runtime: Any = None) -> str:
    """``fingerprint_id`` of the runtime whose JSON is ``key`` (``runtime``: ``key``
    parsed, when the caller has it)."""
    found = _FP_BY_RUNTIME.get(key)
    if found is None:
        from pydantic import ValidationError

        from ledger.core.envelope import Runtime, _fingerprint_of

        try:
            if runtime is None:
                runtime = orjson.loads(key)
            found = _fingerprint_of(Runtime.model_validate(runtime))
        except (ValidationError, orjson.JSONDecodeError) as exc:
            raise SignedRecordError(f"the signed runtime is invalid: {exc}") from None
        if len(_FP_BY_RUNTIME) > 10_000:
            _FP_BY_RUNTIME.clear()
        _FP_BY_RUNTIME[key] = found
    return found


class _Signature(msgspec.Struct):
    keyid: Any


class _StoredEnvelope(msgspec.Struct):
    """The DSSE members :func:`envelope_values` reads (the payload base64-decoded)."""

    payload: bytes
    payloadType: Any  # spelled as the DSSE member
    signatures: list[_Signature]


class _Artifacts(msgspec.Struct):
    model_sha256: Any
    model_name: Any


class _Output(msgspec.Struct):
    token_ids: Any


class _EnvelopePredicate(msgspec.Struct):
    request_id: Any
    recorded_at: Any
    channel: Any
    tier: Any
    artifacts: _Artifacts
    runtime: msgspec.Raw  # its signed bytes: the fingerprint's cache key
    prompt_token_ids: Any
    output: _Output


class _EnvelopeStatement(msgspec.Struct):
    predicate: _EnvelopePredicate


_read_stored_envelope = msgspec.json.Decoder(_StoredEnvelope).decode
_read_envelope_statement = msgspec.json.Decoder(_EnvelopeStatement).decode


def envelope_values(dsse_bytes: bytes, dsse_sha256: str) -> tuple[Any, ...]:
    """The signed values of :data:`ENVELOPE_INDEX_FIELDS`, in that order (the audit's hot
    path compares them with the stored columns as one tuple); ``dsse_sha256`` is the hex
    SHA-256 of ``dsse_bytes``, which the caller has computed already.

    Only the fields named here are decoded (msgspec, into typed structs): for the audit of
    every envelope this is a third of the cost of parsing the envelope and its whole
    payload (:func:`open_signed`), and it gives the same values. Values keep the JSON's
    own types (a field of the wrong type shows as a column mismatch, as with
    :func:`open_signed`); a missing field or a payload that does not parse raises
    :class:`SignedRecordError`."""
    try:
        stored = _read_stored_envelope(dsse_bytes)
        p = _read_envelope_statement(stored.payload).predicate
        runtime = bytes(p.runtime)
        return (p.request_id, parse_time(p.recorded_at), p.channel, p.tier,
                p.artifacts.model_sha256, p.artifacts.model_name,
                _runtime_fingerprint_of(runtime), len(p.prompt_token_ids),
                len(p.output.token_ids), [s.keyid for s in stored.signatures], dsse_sha256)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        vendor = _vendor_envelope_values(dsse_bytes, dsse_sha256)
        if vendor is not None:
            return vendor
        raise SignedRecordError(f"the signed envelope does not give its index fields: "
                                f"{exc}") from None
    except TypeError as exc:  # len() of a count that is no list
        raise SignedRecordError(f"the signed envelope has a field of the wrong type: "
                                f"{exc}") from None


def _vendor_envelope_values(dsse_bytes: bytes, dsse_sha256: str) -> tuple[Any, ...] | None:
    """:func:`envelope_values` of a v2 (vendor) envelope, validated whole (the vendor
    channel is rare enough not to need the fast path); None for any other payload."""
    from ledger.core.envelope import VENDOR_ENVELOPE_PREDICATE_TYPE
    from ledger.core.errors import ValidationFailed
    from ledger.core.vendor import validate_vendor_statement, vendor_index_fields

    try:
        stored = _read_stored_envelope(dsse_bytes)
        statement = orjson.loads(stored.payload)
    except (msgspec.ValidationError, msgspec.DecodeError, orjson.JSONDecodeError,
            RecursionError):
        return None
    if not isinstance(statement, dict) \
            or statement.get("predicateType") != VENDOR_ENVELOPE_PREDICATE_TYPE:
        return None
    try:
        f = vendor_index_fields(validate_vendor_statement(statement))
    except ValidationFailed as exc:
        raise SignedRecordError(f"the signed vendor envelope is invalid: {exc}") from None
    return (f.request_id, f.recorded_at, f.channel, f.tier, f.model_sha256, f.model_name,
            f.fingerprint_id, f.prompt_tokens, f.output_tokens,
            [s.keyid for s in stored.signatures], dsse_sha256)


def envelope_index(dsse_bytes: bytes) -> dict[str, Any]:
    """The index fields of an envelope as its signed payload states them."""
    values = envelope_values(dsse_bytes, hashlib.sha256(dsse_bytes).hexdigest())
    return dict(zip(ENVELOPE_INDEX_FIELDS, values, strict=True))


def verdict_view(dsse_bytes: bytes) -> dict[str, Any]:
    """A verdict as its worker signed it; ``details`` is the predicate less its subject
    (``verdict_id``, ``request_id``, ``envelope``): the worker's details and ``outcome``
    (which the worker's details usually repeat)."""
    signed = open_signed(dsse_bytes)
    if signed.statement.get("predicateType") != VERDICT_PREDICATE_TYPE:
        raise SignedRecordError("the signed statement is not a verdict")
    p = signed.statement["predicate"]
    try:
        details = {k: v for k, v in p.items() if k not in _VERDICT_HEAD}
        worker = details.get("worker") or {}
        return {
            "verdict_id": p["verdict_id"],
            "request_id": p["request_id"],
            "envelope_index": p["envelope"]["log_index"],
            "envelope_dsse_sha256": p["envelope"]["dsse_sha256"],
            "outcome": p["outcome"],
            "tier": details.get("tier"),
            "worker_id": worker.get("worker_id"),
            "fingerprint_id": worker.get("fingerprint_id"),
            "details": details,
            "keyids": list(signed.keyids),
        }
    except (KeyError, TypeError, AttributeError) as exc:
        raise SignedRecordError(f"the signed verdict lacks {exc}") from None


def verdict_columns(columns: Mapping[str, Any], signed: Mapping[str, Any]) -> dict[str, Any]:
    """The ``verdicts`` columns in the view's shape: stored ``details`` may omit
    ``outcome`` (the statement adds it); when they hold it, it is compared like the rest."""
    details = columns.get("details")
    if isinstance(details, dict) and "outcome" not in details:
        details = {**details, "outcome": signed.get("outcome")}
    return {**columns, "details": details}


MATRIX_RUN_FIELDS = ("run_id", "job_id", "worker_id", "fingerprint_id", "report_sha256")


def matrix_run_view(dsse_bytes: bytes) -> dict[str, Any]:
    """A replay matrix report as its worker signed it (``report_sha256``: of the report's
    canonical bytes, which the ``matrix_runs`` row must hold)."""
    signed = open_signed(dsse_bytes)
    try:
        digest = matrix_run_digest(signed.statement)
    except FormatError as exc:
        raise SignedRecordError(exc.message) from None
    p = signed.statement["predicate"]
    try:
        worker = p["worker"]
        return {"run_id": p["run_id"], "job_id": p.get("job_id"),
                "worker_id": worker["worker_id"], "fingerprint_id": worker["fingerprint_id"],
                "report_sha256": digest, "report": p["report"], "at": parse_time(p["at"]),
                "keyids": list(signed.keyids)}
    except (KeyError, TypeError) as exc:
        raise SignedRecordError(f"the signed matrix run lacks {exc}") from None


def event_view(dsse_bytes: bytes) -> dict[str, Any]:
    """A dispute event as the ledger (or a worker) signed it."""
    signed = open_signed(dsse_bytes)
    if signed.statement.get("predicateType") != EVENT_PREDICATE_TYPE:
        raise SignedRecordError("the signed statement is not a dispute event")
    p = signed.statement["predicate"]
    try:
        body = p["body"]
        if not isinstance(body, dict):
            raise SignedRecordError("the signed event body is not an object")
        subject = signed.statement["subject"][0]
        return {
            "event_id": p["event_id"], "dispute_id": p["dispute_id"], "seq": p["seq"],
            "kind": p["kind"], "actor": p["actor"], "at": parse_time(p["at"]),
            "request_id": p["request_id"], "body": body,
            "envelope_dsse_sha256": subject["digest"]["sha256"],
            "keyids": list(signed.keyids),
        }
    except (KeyError, TypeError, IndexError) as exc:
        raise SignedRecordError(f"the signed dispute event lacks {exc}") from None


@dataclass
class DisputeTrail:
    """A dispute's state folded from its signed events, in ``seq`` order.

    The rules mirror ``ledger.replay.disputes``: ``opened`` starts the trail in state
    ``opened``; an event whose body names ``state`` moves to it (its ``reason`` is the
    state reason); a ``verdict`` event names the verdict; ``resolved`` carries the
    resolution and note, and its actor is the resolver.
    """

    dispute_id: str
    request_id: str | None = None
    envelope_dsse_sha256: str | None = None
    state: str | None = None
    state_reason: str | None = None
    resolution: str | None = None
    resolution_note: str | None = None
    resolved_by: str | None = None
    resolved_at: datetime | None = None
    verdict_id: str | None = None
    verdict_outcome: str | None = None
    last_seq: int = 0
    last_index: int | None = None
    problems: list[str] = field(default_factory=list)

    def add(self, event: Mapping[str, Any], log_index: int | None = None) -> None:
        seq, kind, body = event["seq"], event["kind"], event["body"]
        if seq != self.last_seq + 1:
            self.problems.append(f"event seq {seq} follows seq {self.last_seq}: the signed "
                                 "trail has a gap or is out of order")
        self.last_seq, self.last_index = seq, log_index
        if self.request_id is None:
            self.request_id = event["request_id"]
            self.envelope_dsse_sha256 = event.get("envelope_dsse_sha256")
        elif event["request_id"] != self.request_id:
            self.problems.append(f"event seq {seq} names request {event['request_id']!r}, "
                                 f"the trail began on {self.request_id!r}")
        if kind == "opened" and seq == 1:
            self.state, self.state_reason = "opened", None
        if "state" in body:
            self.state = body["state"]
            self.state_reason = body.get("reason")
        if kind == "verdict":
            self.verdict_id = body.get("verdict_id")
            self.verdict_outcome = body.get("outcome")
        if kind == "resolved":
            self.resolution = body.get("resolution")
            self.resolution_note = body.get("note")
            self.resolved_by = event["actor"]
            self.resolved_at = event["at"]

    def fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DISPUTE_FIELDS}


def dispute_trail(dispute_id: str, events: Iterable[Mapping[str, Any]]) -> DisputeTrail:
    trail = DisputeTrail(dispute_id)
    for event in sorted(events, key=lambda e: e["seq"]):
        trail.add(event)
    return trail


def _normal(value: Any) -> Any:
    if isinstance(value, (bytes, memoryview)):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def disagreements(columns: Mapping[str, Any], signed: Mapping[str, Any],
                  names: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """(column, stored value, signed value) for each of ``names`` that differ. Byte
    columns compare as hex and UUIDs as text, the way the signed payloads write them.
    (On the audit's hot path: equal values cost one comparison.)"""
    out = []
    for name in names:
        have, want = columns.get(name), signed.get(name)
        if have == want:
            continue
        have = _normal(have)
        if have != want:
            out.append((name, have, want))
    return out


def integrity(columns: Mapping[str, Any], signed: Mapping[str, Any],
              names: Iterable[str]) -> dict[str, Any]:
    """The ``integrity`` member the API adds: which stored columns disagree with the
    signed bytes (the served values are the signed ones)."""
    bad = disagreements(columns, signed, names)
    return {"source": "signed", "ok": not bad,
            "mismatches": [{"field": n, "column": have, "signed": want}
                           for n, have, want in bad]}


def unreadable(exc: Exception) -> dict[str, Any]:
    return {"source": "columns", "ok": False, "mismatches": [],
            "error": f"the stored signed bytes do not parse: {exc}"}


def served_verdict(dsse_bytes: bytes, columns: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict fields the API serves: from the signed verdict, plus ``integrity``."""
    try:
        signed = verdict_view(dsse_bytes)
    except SignedRecordError as exc:
        return {**{n: columns.get(n) for n in VERDICT_FIELDS}, "integrity": unreadable(exc)}
    return {**{n: signed[n] for n in VERDICT_FIELDS},
            "integrity": integrity(verdict_columns(columns, signed), signed, VERDICT_FIELDS)}


def served_events(stored: Iterable[tuple[bytes, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Each stored (dsse, columns) dispute event as the signed event states it."""
    out = []
    for dsse_bytes, columns in stored:
        try:
            signed = event_view(dsse_bytes)
        except SignedRecordError as exc:
            out.append({**{n: columns.get(n) for n in EVENT_FIELDS},
                        "integrity": unreadable(exc)})
            continue
        out.append({**{n: signed[n] for n in EVENT_FIELDS},
                    "integrity": integrity(columns, signed, EVENT_FIELDS)})
    return out


def served_dispute(events: Iterable[Mapping[str, Any]],
                   columns: Mapping[str, Any]) -> dict[str, Any]:
    """A dispute's state fields folded from its signed events (``served_events`` output),
    plus ``integrity`` naming the ``disputes`` columns that disagree."""
    evs = [e for e in events if e.get("integrity", {}).get("source") == "signed"]
    if not evs:
        return {**{n: columns.get(n) for n in (*DISPUTE_FIELDS, "state_reason",
                                                "resolved_at")},
                "integrity": {"source": "columns", "ok": False, "mismatches": [],
                              "error": "no signed event of this dispute is stored"}}
    trail = DisputeTrail(str(columns.get("id")))
    for e in sorted(evs, key=lambda e: e["seq"]):
        trail.add({**e, "request_id": columns.get("request_id")})
    fields = trail.fields()
    out = {**fields, "state_reason": trail.state_reason, "resolved_at": trail.resolved_at}
    check = integrity(columns, fields, DISPUTE_FIELDS)
    if trail.problems:
        check["ok"] = False
        check["trail"] = trail.problems
    return {**out, "integrity": check}
