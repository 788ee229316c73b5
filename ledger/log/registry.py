"""Registry leaves in the database: appending them, and auditing the key tables against them.

Every change to ``signing_keys``, ``api_keys`` and ``reverification_policies`` made
through the services with the ledger's service key, and every window the beat claims in
``reverification_runs``, appends an ``admin_event`` leaf (see :mod:`ledger.core.statements`)
in the same transaction. :func:`vouched_keys` reads the leaves back, believes only those
signed by a trust-policy service key, folds them (:class:`ledger.core.registry.Registry`)
and reports every row of those tables that the leaves do not account for: an insider who
inserts a key row, flips a status, changes a role, pauses, edits or deletes a policy, or
claims a window so that it is never sampled, without the service key, shows up here.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, true
from sqlalchemy.orm import Session

from ledger.core import dsse
from ledger.core.errors import KeyError_, LedgerError
from ledger.core.keys import key_id
from ledger.core.logentry import log_entry_bytes
from ledger.core.registry import (
    RegisteredKey,
    RegisteredRun,
    Registry,
    RegistryError,
    open_admin_event,
)
from ledger.core.statements import (
    MATRIX_EVENT_KIND,
    admin_event_statement,
    api_key_record,
    gate_record,
    matrix_record,
    policy_record,
    retention_record,
    run_record,
    signing_key_record,
    timestamp,
)
from ledger.core.trust import TrustPolicy
from ledger.db.models import (
    AdminEvent,
    ApiKey,
    LogEntry,
    MatrixRun,
    ReplayJob,
    ReplayJobItem,
    RetentionPolicy,
    ReverificationPolicy,
    ReverificationRun,
    SigningKey,
)
from ledger.replay.records import Signer, append_signed

Problem = tuple[int | None, str]

__all__ = [
    "RegisteredKey",
    "api_key_event",
    "append_admin_event",
    "gate_event",
    "key_event",
    "policy_event",
    "registry_from_leaves",
    "retention_event",
    "retention_vouched",
    "run_event",
    "vouched_keys",
]


def append_admin_event(session: Session, signer: Signer, *, kind: str, actor: str,
                       key: Mapping[str, Any] | None = None,
                       api_key: Mapping[str, Any] | None = None,
                       policy: Mapping[str, Any] | None = None,
                       run: Mapping[str, Any] | None = None,
                       gate: Mapping[str, Any] | None = None,
                       retention: Mapping[str, Any] | None = None,
                       matrix: Mapping[str, Any] | None = None) -> AdminEvent:
    """Sign an admin event with the service key and append it as a log leaf; the caller's
    transaction holds the table change it records."""
    if signer.purpose != "ledger":
        raise ValueError("registry leaves are signed by the ledger's service key")
    event_id = f"admin-{uuid.uuid4()}"
    at = datetime.now(UTC)
    statement = admin_event_statement(event_id=event_id, kind=kind, actor=actor, at=at,
                                      key=key, api_key=api_key, policy=policy, run=run,
                                      gate=gate, retention=retention, matrix=matrix)
    appended = append_signed(session, "admin_event", event_id, statement, signer)
    pred = statement["predicate"]
    row = AdminEvent(log_index=appended.log_index, event_id=event_id, kind=kind, actor=actor,
                     target=pred["target"], body=pred, dsse=appended.dsse, at=at)
    session.add(row)
    session.flush()
    return row


def key_event(row: SigningKey) -> dict[str, Any]:
    return signing_key_record(keyid=row.keyid, public_key=bytes(row.public_key),
                              purpose=row.purpose, name=row.name, not_before=row.not_before,
                              not_after=row.not_after, status=row.status,
                              revoked_at=row.revoked_at, revoked_reason=row.revoked_reason)


def api_key_event(row: ApiKey) -> dict[str, Any]:
    return api_key_record(id=str(row.id), name=row.name, role=row.role, prefix=row.prefix,
                          key_hash=bytes(row.key_hash), revoked_at=row.revoked_at)


def policy_event(row: ReverificationPolicy) -> dict[str, Any]:
    return policy_record(
        id=str(row.id), name=row.name, interval_seconds=row.interval_seconds,
        sample_size=row.sample_size, sample_rate=row.sample_rate,
        model_sha256=row.model_sha256, fingerprint_id=row.fingerprint_id, channel=row.channel,
        min_age_seconds=row.min_age_seconds, max_age_seconds=row.max_age_seconds,
        enabled=row.enabled, drift_alert_threshold=row.drift_alert_threshold,
        created_by=row.created_by, created_at=row.created_at,
        first_window_start=row.first_window_start)


def run_event(row: ReverificationRun) -> dict[str, Any]:
    return run_record(id=str(row.id), policy_id=str(row.policy_id),
                      window_start=row.window_start, window_end=row.window_end,
                      sampled=row.sampled)


def gate_event(row: ReverificationRun) -> dict[str, Any]:
    d = row.details
    return gate_record(id=str(row.id), new_fingerprint=str(d.get("new_fingerprint")),
                       model_sha256=str(d.get("model_sha256")),
                       baseline_fingerprint=str(d.get("baseline_fingerprint")),
                       sampled=row.sampled)


def matrix_event(session: Session, job: ReplayJob) -> dict[str, Any]:
    """What a matrix run's ``matrix.requested`` leaf states, read from its lead job and the
    records it holds (the run's parts replay the same records)."""
    params = dict(job.params or {})
    items = session.execute(select(ReplayJobItem.envelope_index, ReplayJobItem.request_id)
                            .where(ReplayJobItem.job_id == job.id)).all()
    return matrix_record(id=str(job.id), model_sha256=str(params.get("model_sha256")),
                         fingerprints=[str(f) for f in params.get("fingerprints") or []],
                         cells=[str(c) for c in params.get("cells") or []],
                         records=[(int(i), str(r)) for i, r in items],
                         tolerance=params.get("tolerance"),
                         requested_by=str(params.get("requested_by")))


def retention_event(row: RetentionPolicy) -> dict[str, Any]:
    return retention_record(id=str(row.id), name=row.name, channel=row.channel,
                            model_sha256=row.model_sha256,
                            erase_after_days=row.erase_after_days, enabled=row.enabled,
                            created_by=row.created_by, created_at=row.created_at)


def signed_leaf(session: Session, kind: str, target: str, trusted: Mapping[str, bytes]
                 ) -> tuple[Mapping[str, Any] | None, str | None]:
    """(the predicate of the one ``kind`` admin event about ``target``, None), or (None,
    why not): the event must be a leaf of the log (its entry commits to the stored DSSE
    bytes) signed by one of ``trusted`` (keyid -> public key)."""
    found = session.execute(
        select(AdminEvent.dsse, AdminEvent.event_id, LogEntry.entry)
        .join(LogEntry, LogEntry.idx == AdminEvent.log_index)
        .where(AdminEvent.target == target, AdminEvent.kind == kind)
    ).all()
    if len(found) != 1:
        return None, f"it has no single {kind} leaf in the log"
    dsse_bytes, event_id, entry = bytes(found[0][0]), found[0][1], bytes(found[0][2])
    if entry != log_entry_bytes("admin_event", event_id,
                                hashlib.sha256(dsse_bytes).hexdigest()):
        return None, "its leaf's log entry does not commit to the stored signed event"
    try:
        return open_admin_event(dsse.envelope_from_json(dsse_bytes),
                                _service_key_lookup(trusted)).predicate, None
    except (LedgerError, KeyError) as exc:
        return None, ("its leaf does not verify: "
                      f"{exc.message if isinstance(exc, LedgerError) else exc}")


def retention_vouched(session: Session, row: RetentionPolicy,
                      trusted: Mapping[str, bytes]) -> str | None:
    """Why the beat must not erase by ``row``, or None: its ``retention.created`` leaf must
    be in the log, signed by one of ``trusted`` (keyid -> public key), and state exactly
    the row. Erasure cannot be undone, so this is checked before, not only by audit."""
    from ledger.core.registry import check_retention_record

    pred, why = signed_leaf(session, "retention.created", str(row.id), trusted)
    if pred is None:
        return why
    try:
        stated = check_retention_record(pred)
    except (LedgerError, KeyError) as exc:
        return f"its leaf does not verify: {exc.message if isinstance(exc, LedgerError) else exc}"
    if dict(stated) != retention_event(row):
        return "its row differs from the policy its signed leaf states"
    return None


def matrix_vouched(session: Session, job: ReplayJob, trusted: Mapping[str, bytes]
                   ) -> str | None:
    """Why a matrix run (its lead job) must not be shown as requested, or None: its
    ``matrix.requested`` leaf must be in the log, signed by one of ``trusted``, and state
    exactly the job's model, fingerprints, cells, tolerance, requester and records
    (:func:`matrix_event`). What ``ledger audit`` names, checked before a run is served."""
    pred, why = signed_leaf(session, MATRIX_EVENT_KIND, str(job.id), trusted)
    if pred is None:
        return why
    stated = pred.get("matrix")
    if not isinstance(stated, Mapping) or dict(stated) != matrix_event(session, job):
        return "its job or records differ from the request its signed leaf states"
    return matrix_parts_problem(session, job)


def matrix_parts_problem(session: Session, lead: ReplayJob) -> str | None:
    """Why a matrix run's jobs are not the ones its lead's request makes, or None: one job
    per fingerprint the request names (the lead's), each over the lead's records. (The
    leaf states the lead; its other parts are checked against the lead here.)"""
    parts = session.scalars(select(ReplayJob).where(
        ReplayJob.kind == "matrix",
        ReplayJob.params["matrix_run"].as_string() == str(lead.id))).all()
    named = sorted(str(f) for f in (lead.params or {}).get("fingerprints") or [])
    found = sorted([lead.fingerprint_id, *(p.fingerprint_id for p in parts)])
    if found != named:
        return (f"its jobs are for fingerprints {found}, its request names {named}")

    def records(job: ReplayJob) -> list[tuple[int, str]]:
        return sorted((int(i), str(r)) for i, r in session.execute(
            select(ReplayJobItem.envelope_index, ReplayJobItem.request_id)
            .where(ReplayJobItem.job_id == job.id)).all())

    def asked(job: ReplayJob, *own: str) -> dict[str, Any]:
        return {k: v for k, v in (job.params or {}).items() if k not in own}

    want, params = records(lead), asked(lead, "idempotency_key")
    for part in parts:
        if records(part) != want:
            return (f"its job {part.id} (fingerprint {part.fingerprint_id}) replays other "
                    "records than the request's")
        if asked(part, "matrix_run", "idempotency_key") != params:
            return (f"its job {part.id} (fingerprint {part.fingerprint_id}) asks for other "
                    "cells or parameters than the request's")
    # a stored report (its row checked against its worker's leaf by the audit) is for
    # the fingerprint of the job it names
    for job in (lead, *parts):
        fp = session.scalar(select(MatrixRun.fingerprint_id).where(MatrixRun.job_id == job.id))
        if fp is not None and fp != job.fingerprint_id:
            return (f"its job {job.id} is for fingerprint {job.fingerprint_id}, the report "
                    f"its worker signed for {fp}")
    return None


def _service_key_lookup(trusted: Mapping[str, bytes]) -> Callable[[str], bytes]:
    """keyid -> public key among ``trusted``; refuses any other key (for open_admin_event)."""
    def public_key_for(kid: str) -> bytes:
        found = trusted.get(kid)
        if found is None:
            raise KeyError_(f"key {kid} is not a trusted service key", code="unknown_key")
        return found
    return public_key_for


def trusted_signers(session: Session, trust: TrustPolicy | None) -> tuple[dict[str, bytes],
                                                                         str]:
    """The service keys believed (keyid -> public key) and where from: the trust policy's,
    or without one every ``ledger`` key of the database."""
    if trust is not None:
        return {key_id(k): bytes(k) for k in trust.service_keys}, "policy"
    rows = session.scalars(select(SigningKey.public_key).where(SigningKey.purpose == "ledger"))
    return {key_id(bytes(k)): bytes(k) for k in rows}, "database"


def registry_from_leaves(session: Session, trust: TrustPolicy | None
                         ) -> tuple[Registry, list[Problem]]:
    """Fold every admin_event leaf that verifies; problems for those that do not."""
    signers, source = trusted_signers(session, trust)
    problems: list[Problem] = []
    public_key_for = _service_key_lookup(signers)

    registry = Registry()
    rows = session.execute(
        select(AdminEvent, LogEntry.entry, LogEntry.kind, LogEntry.ref)
        .join(LogEntry, LogEntry.idx == AdminEvent.log_index, isouter=True)
        .order_by(AdminEvent.log_index)).all()
    recorded = set()
    for row, entry, entry_kind, entry_ref in rows:
        idx = row.log_index
        recorded.add(idx)
        where = f"admin event {row.event_id} (log index {idx})"
        dsse_bytes = bytes(row.dsse)
        if entry is None:
            problems.append((idx, f"{where}: no log entry at its index"))
            continue
        want = log_entry_bytes("admin_event", row.event_id,
                               hashlib.sha256(dsse_bytes).hexdigest())
        if bytes(entry) != want or entry_kind != "admin_event" or entry_ref != row.event_id:
            problems.append((idx, f"{where}: the log entry does not commit to the stored "
                                  "signed event"))
            continue
        try:
            env = dsse.envelope_from_json(dsse_bytes)
            event = open_admin_event(env, public_key_for)
        except (LedgerError, KeyError) as exc:
            message = exc.message if isinstance(exc, LedgerError) else str(exc)
            problems.append((idx, f"{where}: {message}"))
            continue
        pred = event.predicate
        for column in ("event_id", "kind", "actor", "target"):
            if getattr(row, column) != pred.get(column):
                problems.append((idx, f"{where}: column {column} is {getattr(row, column)!r}, "
                                      f"the signed event says {pred.get(column)!r}"))
        if row.body != pred:
            problems.append((idx, f"{where}: column body differs from the signed event"))
        try:
            registry.apply(idx, pred, vouched_by=source)
        except RegistryError as exc:
            problems.append((idx, f"{where}: {exc.message}"))
    orphans = session.scalars(select(LogEntry.idx).where(
        LogEntry.kind == "admin_event", LogEntry.idx.not_in(recorded) if recorded else true())
        .order_by(LogEntry.idx))
    for idx in orphans:
        problems.append((idx, f"log entry {idx} is an admin_event leaf without its record"))
    return registry, problems


def _differs(problems: list[Problem], idx: int | None, what: str, name: str, table: Any,
             leaf: Any) -> None:
    if table != leaf:
        problems.append((idx, f"{what}: {name} is {_show(table)} in the table, {_show(leaf)} "
                              f"in the leaf at log index {idx}"))


def _show(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()[:16] + ("..." if len(value) > 8 else "")
    if isinstance(value, datetime):
        return str(timestamp(value))
    return repr(value)


def vouched_keys(session: Session, trust: TrustPolicy | None
                 ) -> tuple[dict[str, RegisteredKey], list[Problem]]:
    """The signing keys that valid admin_event leaves vouch for (keyid -> key), and every
    disagreement between the leaves and the ``signing_keys`` / ``api_keys`` tables.

    With ``trust``, a leaf counts only when signed by one of ``trust.service_keys``; with
    ``None``, by a ``ledger`` key registered in this database (weaker: the returned keys
    then carry ``vouched_by == "database"``). A problem is ``(log index or None, message)``.
    """
    registry, problems = registry_from_leaves(session, trust)
    seen: set[str] = set()
    for row in session.scalars(select(SigningKey).order_by(SigningKey.keyid)):
        seen.add(row.keyid)
        what = f"signing key {row.keyid} ({row.purpose} {row.name!r})"
        reg = registry.keys.get(row.keyid)
        if reg is None:
            problems.append((None, f"{what} has no registration leaf signed by a trusted "
                                   "service key"))
            continue
        at = reg.registered_index
        _differs(problems, at, what, "public_key", bytes(row.public_key), reg.public_key)
        _differs(problems, at, what, "purpose", row.purpose, reg.purpose)
        _differs(problems, at, what, "name", row.name, reg.name)
        _differs(problems, at, what, "not_before", row.not_before, reg.not_before)
        _differs(problems, at, what, "not_after", row.not_after, reg.not_after)
        at = reg.revoked_index if reg.revoked_index is not None else reg.registered_index
        _differs(problems, at, what, "status", row.status, reg.status)
        _differs(problems, at, what, "revoked_at", row.revoked_at, reg.revoked_at)
    for kid, reg in registry.keys.items():
        if kid not in seen:
            problems.append((reg.registered_index, f"the leaf at log index "
                             f"{reg.registered_index} registers {reg.purpose} key {kid}, "
                             "which signing_keys lacks"))
    seen_api: set[str] = set()
    for api in session.scalars(select(ApiKey).order_by(ApiKey.created_at)):
        aid = str(api.id)
        seen_api.add(aid)
        what = f"API key {aid} ({api.name!r}, {api.role})"
        reg_api = registry.api_keys.get(aid)
        if reg_api is None:
            problems.append((None, f"{what} has no creation leaf signed by a trusted "
                                   "service key"))
            continue
        at = reg_api.last_index
        _differs(problems, reg_api.created_index, what, "key_hash", bytes(api.key_hash),
                 reg_api.key_hash)
        _differs(problems, reg_api.created_index, what, "name", api.name, reg_api.name)
        _differs(problems, reg_api.created_index, what, "prefix", api.prefix, reg_api.prefix)
        _differs(problems, at, what, "role", api.role, reg_api.role)
        _differs(problems, at, what, "revoked_at", api.revoked_at, reg_api.revoked_at)
    for aid, reg_api in registry.api_keys.items():
        if aid not in seen_api:
            problems.append((reg_api.created_index, f"the leaf at log index "
                             f"{reg_api.created_index} creates API key {aid}, which api_keys "
                             "lacks"))
    problems.extend(_policy_problems(session, registry))
    return dict(registry.keys), problems


def _policy_problems(session: Session, registry: Registry) -> list[Problem]:
    """Rows of ``reverification_policies`` and of the policy windows in
    ``reverification_runs`` against the leaves: a policy paused, edited, inserted or deleted
    in the table alone, a window claimed or removed without its leaf."""
    problems: list[Problem] = []
    seen: set[str] = set()
    for row in session.scalars(select(ReverificationPolicy).order_by(
            ReverificationPolicy.created_at)):
        pid = str(row.id)
        seen.add(pid)
        what = f"re-verification policy {pid} ({row.name!r})"
        reg = registry.policies.get(pid)
        if reg is None:
            problems.append((None, f"{what} has no creation leaf signed by a trusted "
                                   "service key"))
            continue
        if reg.deleted_index is not None:
            problems.append((reg.deleted_index, f"{what} was deleted by the leaf at log "
                                                f"index {reg.deleted_index}, but its row "
                                                "is still there"))
            continue
        stated = policy_event(row)
        for name, value in stated.items():
            _differs(problems, reg.last_index, what, name, value, reg.record[name])
    for pid, reg in registry.policies.items():
        if pid not in seen and reg.deleted_index is None:
            problems.append((reg.last_index, f"the leaf at log index {reg.created_index} "
                             f"creates re-verification policy {pid} "
                             f"({reg.record['name']!r}), which reverification_policies "
                             "lacks and no leaf deleted"))
    runs = list(session.scalars(select(ReverificationRun).order_by(
        ReverificationRun.created_at)))
    claimed = []
    for run in runs:
        if run.kind == "gate":
            continue
        stated = run_event(run)
        leaf = registry.runs.get(stated["id"])
        if run.policy_id is None and leaf is not None:  # detached: its policy was deleted
            policy = registry.policies.get(str(leaf.record["policy_id"]))
            if policy is not None and policy.deleted_index is not None:
                stated["policy_id"] = leaf.record["policy_id"]
        claimed.append((f"re-verification run {run.id}", stated))
    _against_leaves(problems, claimed, registry.runs, missing="window-claim",
                    verb="claims", noun="re-verification run", table="reverification_runs")
    _against_leaves(problems, [(f"fingerprint gate {r.id}", gate_event(r)) for r in runs
                               if r.kind == "gate"],
                    registry.gates, missing="claim", verb="claims", noun="fingerprint gate",
                    table="reverification_runs")
    _against_leaves(problems, [(f"retention policy {r.id} ({r.name!r})", retention_event(r))
                               for r in session.scalars(select(RetentionPolicy).order_by(
                                   RetentionPolicy.created_at))],
                    registry.retention, missing="creation", verb="creates",
                    noun="retention policy", table="retention_policies")
    leads = session.scalars(select(ReplayJob).where(
        ReplayJob.kind == "matrix", ReplayJob.params["matrix_run"].as_string().is_(None))
        .order_by(ReplayJob.created_at)).all()
    _against_leaves(problems, [(f"matrix run {j.id}", matrix_event(session, j)) for j in leads],
                    registry.matrix_runs, missing="request", verb="requests",
                    noun="matrix run", table="replay_jobs")
    for j in leads:
        why = matrix_parts_problem(session, j) if str(j.id) in registry.matrix_runs else None
        if why is not None:
            problems.append((registry.matrix_runs[str(j.id)].index, f"matrix run {j.id}: {why}"))
    return problems


def _against_leaves(problems: list[Problem], rows: list[tuple[str, dict[str, Any]]],
                    leaves: Mapping[str, RegisteredRun], *, missing: str, verb: str,
                    noun: str, table: str) -> None:
    """Rows (what, the record their leaf must state) against leaves by id: a row without
    a leaf, a column the leaf states otherwise, a leaf whose row is gone."""
    seen: set[str] = set()
    for what, stated in rows:
        seen.add(stated["id"])
        leaf = leaves.get(stated["id"])
        if leaf is None:
            problems.append((None, f"{what} has no {missing} leaf signed by a trusted "
                                   "service key"))
            continue
        for name, value in stated.items():
            _differs(problems, leaf.index, what, name, value, leaf.record[name])
    for rid, leaf in leaves.items():
        if rid not in seen:
            problems.append((leaf.index, f"the leaf at log index {leaf.index} {verb} {noun} "
                             f"{rid}, which {table} lacks"))
