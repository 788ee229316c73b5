"""Erasure leaves: the signed record that data keys were destroyed, with tombstones.

Pure: no database. An erasure is an in-toto statement
(``urn:inference-ledger:erasure:v1``) signed by the ledger's service key and sequenced as
an ``erasure`` leaf. It names every data key it destroyed and, for each, the
**tombstone** of every envelope sealed under that key: its log index, request ID, the
SHA-256 of its DSSE bytes (what its leaf commits to) and the index fields as the signed
envelope stated them, read from the decrypted envelope just before the key was destroyed.
After erasure the envelope's content is unreadable, so the tombstone is what its index
columns are checked against (by ``ledger audit``) and what ``GET`` and exports serve.

Predicate::

    {"erasure_id", "kind": "subject" | "retention", "actor", "at", "reason",
     "legal_basis", "data_subject_sha256" (subject erasures), "policy" (retention),
     "keys": [{"key_id": "<uuid>", "records": [<tombstone>, ...]}, ...]}
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from ledger.core import dsse
from ledger.core.canonical import canonical_json
from ledger.core.envelope import STATEMENT_TYPE
from ledger.core.errors import LedgerError, VerificationError
from ledger.core.statements import parse_timestamp

ERASURE_PREDICATE_TYPE = "urn:inference-ledger:erasure:v1"
ERASURE_KINDS = ("subject", "retention")
ERASED = "erased"
"""The reason an erased record's replay or dispute ends ``unverifiable``."""

#: The tombstone's fields besides ``log_index``: the signed envelope's index fields, in
#: ``ledger.replay.views.ENVELOPE_INDEX_FIELDS`` order (``recorded_at`` as RFC 3339).
TOMBSTONE_FIELDS = ("request_id", "recorded_at", "channel", "tier", "model_sha256",
                    "model_name", "fingerprint_id", "prompt_tokens", "output_tokens",
                    "keyids", "dsse_sha256")


class ErasureError(VerificationError):
    """An erasure statement that is not validly signed or not well formed."""

    code = "bad_erasure_leaf"


def data_subject_digest(data_subject: str) -> str:
    """What an erasure leaf says of its subject: the SHA-256 of the pseudonym (so a second
    request for the same subject can be answered, without keeping the pseudonym)."""
    return hashlib.sha256(data_subject.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What stays of an erased envelope, as a signed erasure leaf states it."""

    log_index: int
    fields: Mapping[str, Any]  # TOMBSTONE_FIELDS, recorded_at parsed to a datetime
    key_id: uuid.UUID
    erasure_id: str
    erasure_index: int

    def values(self) -> tuple[Any, ...]:
        """The signed index values in TOMBSTONE_FIELDS order (the audit compares them
        with the envelope row's columns)."""
        return tuple(self.fields[f] for f in TOMBSTONE_FIELDS)

    @property
    def dsse_sha256(self) -> str:
        return str(self.fields["dsse_sha256"])

    @property
    def request_id(self) -> str:
        return str(self.fields["request_id"])

    def served(self) -> dict[str, Any]:
        """The tombstone as the API and exports serve it."""
        return {"log_index": self.log_index, "request_id": self.request_id,
                "dsse_sha256": self.dsse_sha256,
                "erasure": {"erasure_id": self.erasure_id, "log_index": self.erasure_index,
                            "key_id": str(self.key_id)}}


def tombstone_record(log_index: int, index: Mapping[str, Any]) -> dict[str, Any]:
    """One tombstone for the statement, from the signed index fields of an envelope
    (``ledger.replay.views.envelope_index`` of its decrypted bytes)."""
    out: dict[str, Any] = {"log_index": int(log_index)}
    for name in TOMBSTONE_FIELDS:
        value = index[name]
        if isinstance(value, datetime):
            value = value.isoformat()
        out[name] = value
    return out


def erasure_statement(*, erasure_id: str, kind: str, actor: str, at: str, reason: str,
                      legal_basis: str, data_subject_sha256: str | None,
                      policy: str | None,
                      keys: Iterable[tuple[uuid.UUID, list[dict[str, Any]]]]
                      ) -> dict[str, Any]:
    """The one function that makes an erasure statement (what the service key signs)."""
    if kind not in ERASURE_KINDS:
        raise ValueError(f"unknown erasure kind {kind!r}")
    key_list: list[dict[str, Any]] = [
        {"key_id": str(kid), "records": sorted(recs, key=lambda r: int(r["log_index"]))}
        for kid, recs in sorted(keys, key=lambda k: str(k[0]))]
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"erasure:{erasure_id}",
                     "digest": {"sha256": hashlib.sha256(canonical_json(key_list))
                                .hexdigest()}}],
        "predicateType": ERASURE_PREDICATE_TYPE,
        "predicate": {"erasure_id": erasure_id, "kind": kind, "actor": actor, "at": at,
                      "reason": reason, "legal_basis": legal_basis,
                      "data_subject_sha256": data_subject_sha256, "policy": policy,
                      "keys": key_list},
    }


@dataclass(frozen=True, slots=True)
class ErasureRecord:
    """A verified erasure leaf: its predicate, who signed it, its tombstones by index."""

    predicate: Mapping[str, Any]
    signed_by: tuple[str, ...]
    key_ids: tuple[uuid.UUID, ...]
    tombstones: Mapping[int, Tombstone]
    records_per_key: Mapping[uuid.UUID, int]


def _parse_time(value: Any, what: str) -> datetime:
    return parse_timestamp(value, what, ErasureError)


def erasure_predicate(payload: bytes) -> dict[str, Any]:
    """The predicate of an erasure statement's payload (shape checked, no signature)."""
    try:
        st = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ErasureError("erasure payload is not JSON") from exc
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE \
            or st.get("predicateType") != ERASURE_PREDICATE_TYPE:
        raise ErasureError(f"not an {ERASURE_PREDICATE_TYPE} statement")
    pred = st.get("predicate")
    if not isinstance(pred, dict):
        raise ErasureError("erasure predicate must be an object")
    for name in ("erasure_id", "kind", "actor", "at", "reason", "legal_basis"):
        if not isinstance(pred.get(name), str):
            raise ErasureError(f"predicate.{name} must be a string")
    if pred["kind"] not in ERASURE_KINDS:
        raise ErasureError(f"unknown erasure kind {pred['kind']!r}")
    _parse_time(pred["at"], "predicate.at")
    if not isinstance(pred.get("keys"), list) or not pred["keys"]:
        raise ErasureError("predicate.keys must name the destroyed data keys")
    return pred


def open_erasure(env: dsse.Envelope, public_key_for: Callable[[str], bytes],
                 log_index: int) -> ErasureRecord:
    """Verify an erasure leaf's signature (``public_key_for`` raises for a key it does not
    trust: only the ledger's service keys) and its statement; its tombstones."""
    try:
        signed_by = tuple(dsse.verify_envelope(env, public_key_for))
    except LedgerError as exc:
        raise ErasureError(f"erasure signature: {exc.message}") from exc
    return erasure_record(erasure_predicate(env.payload), signed_by, log_index)


def erasure_record(pred: Mapping[str, Any], signed_by: tuple[str, ...],
                   log_index: int) -> ErasureRecord:
    key_ids: list[uuid.UUID] = []
    tombstones: dict[int, Tombstone] = {}
    per_key: dict[uuid.UUID, int] = {}
    for k in pred["keys"]:
        try:
            kid = uuid.UUID(k["key_id"])
            records = k["records"]
            if not isinstance(records, list):
                raise TypeError("records")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ErasureError(f"a destroyed key is not stated properly: {exc}") from None
        if kid in per_key:
            raise ErasureError(f"data key {kid} is named twice")
        key_ids.append(kid)
        per_key[kid] = len(records)
        for r in records:
            if not isinstance(r, dict) or set(r) != {"log_index", *TOMBSTONE_FIELDS}:
                raise ErasureError(f"a tombstone of key {kid} lacks fields or has others")
            idx = r["log_index"]
            if not isinstance(idx, int) or idx < 0 or idx in tombstones:
                raise ErasureError(f"a tombstone of key {kid} has a bad or repeated "
                                   "log_index")
            fields = {f: r[f] for f in TOMBSTONE_FIELDS}
            fields["recorded_at"] = _parse_time(r["recorded_at"], "tombstone recorded_at")
            tombstones[idx] = Tombstone(idx, fields, kid, str(pred["erasure_id"]),
                                        log_index)
    return ErasureRecord(pred, signed_by, tuple(key_ids), tombstones, per_key)
