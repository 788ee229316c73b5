"""The key registry as the log states it: admin-event leaves folded in log order.

Pure: no database. :func:`open_admin_event` checks one signed admin event (DSSE by a
trusted service key, the statement's shape); :class:`Registry` folds verified events in
log order into the keys and API keys they register, revoke or change, and refuses an
event that does not follow from the ones before it (a key registered twice, a revocation
of a key never registered). ``ledger audit``, ``ledger verify --trust`` and the replay
worker believe a producer or worker key only when a registration leaf vouches for it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import orjson

from ledger.core import dsse
from ledger.core.envelope import STATEMENT_TYPE
from ledger.core.errors import LedgerError, VerificationError
from ledger.core.keys import key_id
from ledger.core.statements import (
    ADMIN_EVENT_KINDS,
    ADMIN_EVENT_PREDICATE_TYPE,
    GATE_EVENT_KIND,
    MATRIX_EVENT_KIND,
    RETENTION_EVENT_KIND,
    RUN_EVENT_KIND,
    parse_timestamp,
    record_digest,
)

KEY_PURPOSES = ("producer", "worker", "log", "ledger")


class RegistryError(VerificationError):
    """An admin event that is not validly signed, not well formed, or does not follow."""

    code = "bad_registry_leaf"


@dataclass(frozen=True, slots=True)
class RegisteredKey:
    """A signing key as its registry leaves state it."""

    public_key: bytes
    purpose: str
    name: str
    not_before: datetime
    not_after: datetime | None
    revoked_at: datetime | None = None
    keyid: str = ""
    registered_index: int = -1
    revoked_index: int | None = None
    #: ``policy`` (leaf signed by a trust-policy service key) or ``database`` (by a
    #: ``ledger`` key registered in the database being checked: weaker, an insider can
    #: add one).
    vouched_by: str = "policy"

    @property
    def status(self) -> str:
        return "active" if self.revoked_at is None else "revoked"

    def valid_at_index(self, log_index: int) -> str | None:
        """Why a record at ``log_index`` may not be signed by this key, or None.

        Only revocation is ordered: a record sequenced after its key's revocation leaf is
        refused. A registration leaf may come after records the key signed (keys attested
        after an upgrade, `ledger keys attest`): those records are fixed in the log
        already, so a late registration cannot forge them."""
        if self.revoked_index is not None and log_index > self.revoked_index:
            return (f"key {self.keyid} was revoked at log index {self.revoked_index}, before "
                    f"the record at {log_index}")
        return None


@dataclass(frozen=True, slots=True)
class RegisteredApiKey:
    id: str
    name: str
    role: str
    prefix: str
    key_hash: bytes
    revoked_at: datetime | None
    created_index: int
    last_index: int


@dataclass(frozen=True, slots=True)
class RegisteredPolicy:
    """A re-verification policy as its latest leaf states it (``record``: the settings,
    :func:`ledger.core.statements.policy_record`); ``deleted_index`` once deleted."""

    record: Mapping[str, Any]
    created_index: int
    last_index: int
    deleted_index: int | None = None


@dataclass(frozen=True, slots=True)
class RegisteredRun:
    """A re-verification window the beat claimed (:func:`ledger.core.statements.run_record`)."""

    record: Mapping[str, Any]
    index: int


POLICY_SETTINGS = ("id", "name", "interval_seconds", "sample_size", "sample_rate",
                   "model_sha256", "fingerprint_id", "channel", "min_age_seconds",
                   "max_age_seconds", "enabled", "drift_alert_threshold", "created_by",
                   "created_at", "first_window_start")
RUN_FIELDS = ("id", "policy_id", "window_start", "window_end", "sampled")
GATE_FIELDS = ("id", "new_fingerprint", "model_sha256", "baseline_fingerprint", "sampled")
MATRIX_FIELDS = ("id", "model_sha256", "fingerprints", "cells", "records_sha256", "records",
                 "tolerance", "requested_by")
RETENTION_FIELDS = ("id", "name", "channel", "model_sha256", "erase_after_days", "enabled",
                    "created_by", "created_at")


@dataclass(frozen=True, slots=True)
class AdminEventRecord:
    """A verified admin event: its predicate and the key IDs that signed it."""

    predicate: Mapping[str, Any]
    signed_by: tuple[str, ...]


def _time(value: Any, what: str, *, optional: bool = False) -> datetime | None:
    if value is None and optional:
        return None
    return parse_timestamp(value, what, RegistryError)


def _str(obj: Mapping[str, Any], name: str, what: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise RegistryError(f"{what}.{name} must be a non-empty string")
    return value


def _fields(pred: Mapping[str, Any], name: str, names: tuple[str, ...]) -> Mapping[str, Any]:
    """The record an admin event states under ``name``, with exactly ``names``; its subject
    digest must be the record's."""
    record = pred.get(name)
    if not isinstance(record, dict) or set(record) != set(names):
        raise RegistryError(f"a {pred['kind']} event states the {name} with the fields "
                            f"{', '.join(names)}")
    return record


def open_admin_event(env: dsse.Envelope, public_key_for: Callable[[str], bytes]
                     ) -> AdminEventRecord:
    """Verify an admin event's signatures (``public_key_for`` raises for a key it does not
    trust) and its statement's shape. Returns the predicate."""
    try:
        signed_by = tuple(dsse.verify_envelope(env, public_key_for))
    except LedgerError as exc:
        raise RegistryError(f"admin event signature: {exc.message}") from exc
    try:
        st = orjson.loads(env.payload)
    except orjson.JSONDecodeError as exc:
        raise RegistryError("admin event payload is not JSON") from exc
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE \
            or st.get("predicateType") != ADMIN_EVENT_PREDICATE_TYPE:
        raise RegistryError(f"not an {ADMIN_EVENT_PREDICATE_TYPE} statement")
    pred = st.get("predicate")
    if not isinstance(pred, dict):
        raise RegistryError("admin event predicate must be an object")
    for name in ("event_id", "kind", "actor", "target", "at"):
        _str(pred, name, "predicate")
    if pred["kind"] not in ADMIN_EVENT_KINDS:
        raise RegistryError(f"unknown admin event kind {pred['kind']!r}")
    if pred["kind"].startswith(("policy.", "gate.", "retention.", "matrix.")):
        stated = pred.get({RUN_EVENT_KIND: "run", GATE_EVENT_KIND: "gate",
                           RETENTION_EVENT_KIND: "retention",
                           MATRIX_EVENT_KIND: "matrix"}.get(pred["kind"], "policy"))
        subject = st.get("subject")
        try:
            digest = subject[0]["digest"]["sha256"]  # type: ignore[index]
        except (TypeError, KeyError, IndexError):
            digest = None
        if not isinstance(stated, dict) or digest != record_digest(stated):
            raise RegistryError("the admin event's subject digest is not the SHA-256 of "
                                "the record it states")
    return AdminEventRecord(pred, signed_by)


def check_retention_record(pred: Mapping[str, Any]) -> Mapping[str, Any]:
    """The retention policy a ``retention.created`` predicate states, checked."""
    r = _fields(pred, "retention", RETENTION_FIELDS)
    if pred["target"] != _str(r, "id", "retention"):
        raise RegistryError("the event's target must be the retention policy's id")
    _str(r, "name", "retention")
    days = r["erase_after_days"]
    if not isinstance(days, int) or isinstance(days, bool) or days < 1 \
            or not isinstance(r["enabled"], bool):
        raise RegistryError("a retention policy erases after a whole number of days >= 1")
    _time(r["created_at"], "retention.created_at")
    return r


@dataclass
class Registry:
    """Keys and API keys, folded from admin events in log order."""

    keys: dict[str, RegisteredKey] = field(default_factory=dict)
    api_keys: dict[str, RegisteredApiKey] = field(default_factory=dict)
    #: every policy ever created (deleted ones keep their ``deleted_index``)
    policies: dict[str, RegisteredPolicy] = field(default_factory=dict)
    runs: dict[str, RegisteredRun] = field(default_factory=dict)
    #: fingerprint gates by run id (one per new fingerprint and model)
    gates: dict[str, RegisteredRun] = field(default_factory=dict)
    #: retention policies by id (created once; there is no change or deletion of one)
    retention: dict[str, RegisteredRun] = field(default_factory=dict)
    #: replay matrix runs requested, by run id (the lead job's)
    matrix_runs: dict[str, RegisteredRun] = field(default_factory=dict)

    def apply(self, log_index: int, pred: Mapping[str, Any], *,
              vouched_by: str = "policy") -> None:
        kind = pred["kind"]
        if kind.startswith("signing_key."):
            self._apply_key(log_index, kind, pred, vouched_by)
        elif kind.startswith("api_key."):
            self._apply_api_key(log_index, kind, pred)
        elif kind == RUN_EVENT_KIND:
            self._apply_run(log_index, pred)
        elif kind == GATE_EVENT_KIND:
            self._apply_gate(log_index, pred)
        elif kind == RETENTION_EVENT_KIND:
            self._apply_retention(log_index, pred)
        elif kind == MATRIX_EVENT_KIND:
            self._apply_matrix(log_index, pred)
        else:
            self._apply_policy(log_index, kind, pred)

    def _apply_policy(self, log_index: int, kind: str, pred: Mapping[str, Any]) -> None:
        p = _fields(pred, "policy", POLICY_SETTINGS)
        pid = _str(p, "id", "policy")
        if pred["target"] != pid:
            raise RegistryError("the event's target must be the policy's id")
        _str(p, "name", "policy")
        if not isinstance(p["enabled"], bool):
            raise RegistryError("policy.enabled must be true or false")
        for name in ("created_at", "first_window_start"):
            _time(p[name], f"policy.{name}")
        existing = self.policies.get(pid)
        if kind == "policy.created":
            if existing is not None:
                raise RegistryError(f"policy {pid} is created twice (first at log index "
                                    f"{existing.created_index})")
            self.policies[pid] = RegisteredPolicy(dict(p), log_index, log_index)
            return
        if existing is None:
            raise RegistryError(f"{kind} of policy {pid}, which no leaf created")
        if existing.deleted_index is not None:
            raise RegistryError(f"policy {pid} changes after its deletion at log index "
                                f"{existing.deleted_index}")
        changed = sorted(n for n in POLICY_SETTINGS
                         if n != "enabled" and p[n] != existing.record[n])
        if changed:
            raise RegistryError(f"{kind} of policy {pid} changes {', '.join(changed)}: only "
                                "pausing and resuming change a policy")
        if kind != "policy.deleted" and p["enabled"] != (kind == "policy.resumed"):
            raise RegistryError(f"a {kind} event states enabled={p['enabled']}")
        self.policies[pid] = replace(
            existing, record=dict(p), last_index=log_index,
            deleted_index=log_index if kind == "policy.deleted" else None)

    def _apply_run(self, log_index: int, pred: Mapping[str, Any]) -> None:
        r = _fields(pred, "run", RUN_FIELDS)
        rid = _str(r, "id", "run")
        if pred["target"] != rid:
            raise RegistryError("the event's target must be the run's id")
        if rid in self.runs:
            raise RegistryError(f"run {rid} is claimed twice (first at log index "
                                f"{self.runs[rid].index})")
        policy = self.policies.get(_str(r, "policy_id", "run"))
        if policy is None or policy.deleted_index is not None:
            raise RegistryError(f"run {rid} claims a window of policy {r['policy_id']}, "
                                "which no leaf created or which was deleted")
        start = _time(r["window_start"], "run.window_start")
        end = _time(r["window_end"], "run.window_end")
        assert start is not None and end is not None
        if not isinstance(r["sampled"], int) or r["sampled"] < 0 or end <= start:
            raise RegistryError(f"run {rid}: a window ends after it starts and samples a "
                                "count")
        self.runs[rid] = RegisteredRun(dict(r), log_index)

    def _apply_gate(self, log_index: int, pred: Mapping[str, Any]) -> None:
        g = _fields(pred, "gate", GATE_FIELDS)
        gid = _str(g, "id", "gate")
        if pred["target"] != gid:
            raise RegistryError("the event's target must be the gate run's id")
        pair = (_str(g, "new_fingerprint", "gate"), _str(g, "model_sha256", "gate"))
        for other in self.gates.values():
            if gid == other.record["id"] or pair == (other.record["new_fingerprint"],
                                                     other.record["model_sha256"]):
                raise RegistryError(f"gate {gid} is claimed twice (first at log index "
                                    f"{other.index})")
        if not isinstance(g["sampled"], int) or g["sampled"] < 0:
            raise RegistryError(f"gate {gid} samples a count")
        self.gates[gid] = RegisteredRun(dict(g), log_index)

    def _apply_matrix(self, log_index: int, pred: Mapping[str, Any]) -> None:
        m = _fields(pred, "matrix", MATRIX_FIELDS)
        mid = _str(m, "id", "matrix")
        if pred["target"] != mid:
            raise RegistryError("the event's target must be the matrix run's id")
        if mid in self.matrix_runs:
            raise RegistryError(f"matrix run {mid} is requested twice (first at log index "
                                f"{self.matrix_runs[mid].index})")
        for name in ("fingerprints", "cells"):
            if not isinstance(m[name], list) or not m[name] or \
                    not all(isinstance(v, str) for v in m[name]):
                raise RegistryError(f"matrix run {mid}: {name} is a list of strings")
        if not isinstance(m["records"], int) or m["records"] < 1:
            raise RegistryError(f"matrix run {mid} replays a count of records")
        self.matrix_runs[mid] = RegisteredRun(dict(m), log_index)

    def _apply_retention(self, log_index: int, pred: Mapping[str, Any]) -> None:
        r = check_retention_record(pred)
        if r["id"] in self.retention:
            raise RegistryError(f"retention policy {r['id']} is created twice (first at log "
                                f"index {self.retention[r['id']].index})")
        self.retention[r["id"]] = RegisteredRun(dict(r), log_index)


    def _apply_key(self, log_index: int, kind: str, pred: Mapping[str, Any],
                   vouched_by: str) -> None:
        k = pred.get("key")
        if not isinstance(k, dict):
            raise RegistryError(f"a {kind} event must state the key")
        try:
            public_key = base64.b64decode(_str(k, "public_key", "key"), validate=True)
            kid = key_id(public_key)
        except (binascii.Error, ValueError, LedgerError) as exc:
            raise RegistryError("key.public_key is not a base64 Ed25519 public key") from exc
        if k.get("keyid") != kid or pred["target"] != kid:
            raise RegistryError("the event's keyid and target must be the key's SHA-256")
        purpose = _str(k, "purpose", "key")
        if purpose not in KEY_PURPOSES:
            raise RegistryError(f"key.purpose {purpose!r} is not a key purpose")
        not_before = _time(k.get("not_before"), "key.not_before")
        assert not_before is not None
        not_after = _time(k.get("not_after"), "key.not_after", optional=True)
        revoked_at = _time(k.get("revoked_at"), "key.revoked_at", optional=True)
        existing = self.keys.get(kid)
        if kind == "signing_key.registered":
            if existing is not None:
                raise RegistryError(f"key {kid} is registered twice (first at log index "
                                    f"{existing.registered_index})")
            if k.get("status") != "active" or revoked_at is not None:
                raise RegistryError("a registration states an active key")
            self.keys[kid] = RegisteredKey(public_key, purpose, _str(k, "name", "key"),
                                           not_before, not_after, None, kid, log_index,
                                           None, vouched_by)
            return
        if existing is None:
            raise RegistryError(f"revocation of key {kid}, which no leaf registered")
        if existing.revoked_index is not None:
            raise RegistryError(f"key {kid} is revoked twice (first at log index "
                                f"{existing.revoked_index})")
        if k.get("status") != "revoked" or revoked_at is None:
            raise RegistryError("a revocation states a revoked key and its revoked_at")
        if purpose != existing.purpose:
            raise RegistryError(f"the revocation states purpose {purpose}, the registration "
                                f"{existing.purpose}")
        self.keys[kid] = replace(existing, revoked_at=revoked_at, revoked_index=log_index)

    def _apply_api_key(self, log_index: int, kind: str, pred: Mapping[str, Any]) -> None:
        a = pred.get("api_key")
        if not isinstance(a, dict):
            raise RegistryError(f"a {kind} event must state the API key")
        aid = _str(a, "id", "api_key")
        if pred["target"] != aid:
            raise RegistryError("the event's target must be the API key's id")
        role = _str(a, "role", "api_key")  # which roles exist is the table's business
        try:
            key_hash = bytes.fromhex(_str(a, "key_hash", "api_key"))
        except ValueError as exc:
            raise RegistryError("api_key.key_hash is not hex") from exc
        revoked_at = _time(a.get("revoked_at"), "api_key.revoked_at", optional=True)
        existing = self.api_keys.get(aid)
        if kind == "api_key.created":
            if existing is not None:
                raise RegistryError(f"API key {aid} is created twice (first at log index "
                                    f"{existing.created_index})")
            if revoked_at is not None:
                raise RegistryError("a creation states an unrevoked API key")
            self.api_keys[aid] = RegisteredApiKey(aid, _str(a, "name", "api_key"), role,
                                                  _str(a, "prefix", "api_key"), key_hash,
                                                  None, log_index, log_index)
            return
        if existing is None:
            raise RegistryError(f"{kind} of API key {aid}, which no leaf created")
        if key_hash != existing.key_hash:
            raise RegistryError(f"API key {aid}: the key hash differs from its creation leaf")
        if existing.revoked_at is not None:
            raise RegistryError(f"API key {aid} changes after its revocation")
        if kind == "api_key.revoked":
            if revoked_at is None:
                raise RegistryError("a revocation states revoked_at")
            self.api_keys[aid] = replace(existing, revoked_at=revoked_at,
                                         last_index=log_index)
        else:
            self.api_keys[aid] = replace(existing, role=role, last_index=log_index)
