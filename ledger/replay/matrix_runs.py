"""Matrix runs in the ledger (no torch): the records a run replays, and its signed report.

The records of a matrix run are picked from the database by columns (model, channel),
a deterministic sample (``sha256(seed || request_id)`` order, as the fingerprint gate
samples), and then each is *checked* (:class:`ledger.replay.trusted.RecordChecker`: its
signature under a believed producer key, its inclusion in a checkpoint signed by a
believed log key) and its signed statement read again: a record that fails is listed in
the report with the reason and is not replayed.

The report is a leaf of the log (``matrix_run``, :func:`store_matrix_run`), signed by the
key of the worker that ran it: like a verdict, it states what that worker measured on its
own runtime, and the service key is not on worker nodes (each private key only where it
signs). Before a report is served it is checked against that leaf
(:func:`checked_report`); ``ledger audit`` checks every row.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ledger.core import dsse
from ledger.core.canonical import canonical_json, sha256_hex
from ledger.core.envelope import EnvelopeStatement, Limits, parse_statement
from ledger.core.errors import KeyError_, LedgerError
from ledger.core.logentry import dsse_digest, log_entry_bytes, verify_record_included
from ledger.core.note import open_checkpoint
from ledger.core.statements import MATRIX_EVENT_KIND, matrix_report_bytes, matrix_run_statement
from ledger.core.states import JOB_FINISHED
from ledger.db.models import (
    Fingerprint,
    MatrixRun,
    ReplayJob,
    ReplayJobItem,
    ReverificationRun,
    Worker,
)
from ledger.db.session import raw_cursor
from ledger.errors import BadRequest, Conflict, NotFound
from ledger.log import proofs
from ledger.log.registry import append_admin_event, matrix_event, matrix_vouched
from ledger.replay import views
from ledger.replay.jobs import create_job, live_fingerprints
from ledger.replay.matrix import DEFAULT_CELLS, parse_cell
from ledger.replay.records import Signer, append_signed, require_signer
from ledger.replay.trusted import CheckedRecord, RecordChecker, Unverifiable
from ledger.services.pagination import Page, SortKey, page, query_digest
from ledger.settings import Settings

#: Generous limits for reading envelopes back: the ledger already enforced its own.
READ_LIMITS = Limits(max_prompt_tokens=10**7, max_output_tokens=10**7, max_token_id=2**31,
                     max_top_logprobs=10**4)


@dataclass
class SampledRecords:
    """Checked records (with their signed statements), and those that failed a check."""

    checked: list[tuple[CheckedRecord, EnvelopeStatement]] = field(default_factory=list)
    unverified: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0      # checked, but the signed statement is of another model or dtype


def sample_indices(session: Session, *, model_sha256: str | None, sample: int, seed: int,
                   fingerprint_id: str | None = None) -> list[tuple[int, str]]:
    """(log_index, request_id) of up to ``sample`` deterministic-channel records (0: all),
    in a reproducible order given ``seed``. The columns only choose; nothing chosen is
    believed before it is checked."""
    rows = session.execute(text(
        "SELECT log_index, request_id FROM envelopes WHERE channel = 'deterministic' "
        "AND (CAST(:m AS text) IS NULL OR model_sha256 = :m) "
        "AND (CAST(:fp AS text) IS NULL OR fingerprint_id = :fp) "
        "ORDER BY sha256(convert_to(:seed || request_id, 'UTF8')) "
        "LIMIT CASE WHEN :n > 0 THEN :n END"),
        {"m": model_sha256, "fp": fingerprint_id, "seed": str(seed), "n": sample}).all()
    return [(int(r[0]), str(r[1])) for r in rows]


def check_records(session: Session, checker: RecordChecker,
                  indices: Sequence[tuple[int, str]], *, model_sha256: str | None = None,
                  dtype: str | None = None) -> SampledRecords:
    """Check each record; a failure is listed (``request_id``, ``log_index``, ``reason``),
    never returned for replay. ``model_sha256``/``dtype``: what the signed statement must
    say (else the record is skipped: the columns that chose it were not signed)."""
    out = SampledRecords()
    producers = checker.producer_keys(session)
    for log_index, request_id in indices:
        try:
            checked = checker.check(session, log_index, request_id, producers)
            try:
                statement = parse_statement(checked.envelope.payload, READ_LIMITS)
            except LedgerError as exc:
                raise Unverifiable(f"the envelope does not parse: {exc.message}") from exc
            if not isinstance(statement, EnvelopeStatement):
                raise Unverifiable("a vendor record: no token IDs to replay")
        except Unverifiable as exc:
            out.unverified.append({"request_id": request_id, "log_index": log_index,
                                   "reason": str(exc)})
            continue
        p = statement.predicate
        if (model_sha256 is not None and p.artifacts.model_sha256 != model_sha256) or (
                dtype is not None and p.runtime.model_dump().get("dtype") != dtype):
            out.skipped += 1
            continue
        out.checked.append((checked, statement))
    return out


# --- the signed report -------------------------------------------------------------------

class StoredReportMismatch(Conflict):
    """A stored matrix report that its signed leaf does not vouch for."""

    code = "matrix_report_mismatch"


class StoredRequestMismatch(Conflict):
    """A matrix run whose jobs its signed ``matrix.requested`` leaf does not vouch for."""

    code = "matrix_request_mismatch"


def run_id_for_job(job_id: uuid.UUID | str) -> str:
    """Deterministic, so a second delivery of the same job cannot mint a second report."""
    return f"matrix-{job_id}"


def store_matrix_run(session: Session, *, run_id: str, report: Mapping[str, Any],
                     worker_id: str, fingerprint_id: str, runtime: Mapping[str, Any],
                     signer: Signer, job_id: uuid.UUID | None = None) -> tuple[MatrixRun, bool]:
    """Sign the report with ``signer`` (the worker key that ran it) and append it as a
    ``matrix_run`` leaf, with its ``matrix_runs`` row, in the caller's transaction;
    (row, created)."""
    existing = session.scalar(select(MatrixRun).where(MatrixRun.run_id == run_id))
    if existing is not None:
        return existing, False
    statement = matrix_run_statement(
        run_id=run_id, report=report, job_id=None if job_id is None else str(job_id),
        worker={"worker_id": worker_id, "fingerprint_id": fingerprint_id,
                "runtime": dict(runtime), "keyid": signer.keyid},
        at=datetime.now(UTC))
    appended = append_signed(session, "matrix_run", run_id, statement, signer)
    row = MatrixRun(log_index=appended.log_index, run_id=run_id, job_id=job_id,
                    worker_id=worker_id, fingerprint_id=fingerprint_id,
                    report=matrix_report_bytes(report), dsse=appended.dsse)
    session.add(row)
    session.flush()
    return row, True


def checked_report(session: Session, row: MatrixRun, checker: RecordChecker
                   ) -> tuple[bytes, dict[str, Any]]:
    """The stored report bytes, after checking them against their signed leaf: the DSSE
    bytes are the ones the log entry commits to, signed by a believed worker key, and the
    report hashes to the digest they sign; and, once a checkpoint covers it, the entry is
    in a checkpoint signed by a believed log key. (bytes, what was checked); raises
    :class:`StoredReportMismatch`."""
    dsse_bytes, report = bytes(row.dsse), bytes(row.report)
    where = f"matrix run {row.run_id} (log index {row.log_index})"
    with raw_cursor(session) as cur:
        cur.execute("SELECT entry FROM log_entries WHERE idx = %s", (row.log_index,))
        found = cur.fetchone()
    entry = log_entry_bytes("matrix_run", row.run_id, dsse_digest(dsse_bytes))
    if found is None or bytes(found[0]) != entry:
        raise StoredReportMismatch(f"{where}: the log entry does not commit to the stored "
                                   "signed report; run `ledger audit`")
    workers = checker.keys(session, "worker")

    def worker_key(kid: str) -> bytes:
        key = workers.get(kid)
        if key is None:
            raise KeyError_(f"{kid} is not a believed worker key")
        why = key.valid_at_index(row.log_index)
        if why is not None:
            raise KeyError_(why)
        return key.public_key

    try:
        dsse.verify_envelope(dsse.envelope_from_json(dsse_bytes), worker_key)
        signed = views.matrix_run_view(dsse_bytes)
    except LedgerError as exc:
        raise StoredReportMismatch(f"{where}: {exc.message}") from None
    stored = {"run_id": row.run_id, "job_id": None if row.job_id is None else str(row.job_id),
              "worker_id": row.worker_id,
              "fingerprint_id": row.fingerprint_id, "report_sha256": sha256_hex(report)}
    if any(signed[f] != stored[f] for f in views.MATRIX_RUN_FIELDS):
        raise StoredReportMismatch(f"{where}: the stored report is not the one its worker "
                                   "signed; run `ledger audit`")
    checked: dict[str, Any] = {"log_index": row.log_index, "signed_by": signed["keyids"],
                               "report_sha256": signed["report_sha256"], "checkpoint": None,
                               "worker_id": signed["worker_id"],
                               "fingerprint_id": signed["fingerprint_id"]}
    try:
        receipt = proofs.inclusion(session, row.log_index)
        cp = open_checkpoint(receipt.checkpoint.note, checker.log_verifiers(session),
                             origin=checker.log_name)
        verify_record_included("matrix_run", row.run_id, dsse_bytes, row.log_index,
                               cp.size, cp.root_hash, receipt.proof, served_entry=receipt.entry)
        checked["checkpoint"] = {"tree_size": cp.size, "root_hash": cp.root_hash.hex()}
    except NotFound:
        pass                        # not in a checkpoint yet: signed, not yet proven
    except LedgerError as exc:
        raise StoredReportMismatch(f"{where}: not verifiably in the log: {exc.message}") \
            from None
    return report, checked


# --- requested through the API -------------------------------------------------------------

@dataclass
class Requested:
    job: ReplayJob                 # the run's lead job: its ID is the run's
    created: bool
    parts: list[ReplayJob] = field(default_factory=list)   # every job of a new run


#: ``fingerprints: "all"``: every live fingerprint whose worker holds the model
ALL_FINGERPRINTS = "all"


def _request_digest(**fields: Any) -> str:
    """What an Idempotency-Key stands for: a retry must ask for the same run."""
    return sha256_hex(canonical_json(fields))


def _existing_run(session: Session, idempotency_key: str, digest: str) -> Requested | None:
    existing = session.scalar(select(ReplayJob).where(
        ReplayJob.kind == "matrix",
        ReplayJob.params["idempotency_key"].astext == idempotency_key))
    if existing is None:
        return None
    if (existing.params or {}).get("request_sha256") != digest:
        raise Conflict("this Idempotency-Key was used for another matrix run request",
                       code="idempotency_key_reused")
    return Requested(existing, False)


def _live_holding(session: Session, settings: Settings, model_sha256: str) -> list[str]:
    """Live fingerprints with a worker that holds the model (a job routed to one without
    it would only fail)."""
    live = live_fingerprints(session, settings)
    out = []
    for fp, worker_ids in sorted(live.items()):
        models = session.scalars(select(Worker.models).where(
            Worker.worker_id.in_(worker_ids))).all()
        if any(m.get("model_sha256") == model_sha256 for ms in models for m in ms):
            out.append(fp)
    return out


def request_matrix_run(session: Session, settings: Settings, *, actor: str,
                       model_sha256: str, fingerprint_id: str | None,
                       records_fingerprint_id: str | None, sample: int, seed: int,
                       cells: Sequence[str], idempotency_key: str | None = None,
                       fingerprints: Sequence[str] | str | None = None,
                       tolerance: float | None = None,
                       run_id: uuid.UUID | None = None,
                       indices: Sequence[tuple[int, str]] | None = None,
                       signer: Signer | None = None) -> Requested:
    """A matrix run: ``sample`` records of the model (recorded on
    ``records_fingerprint_id``, or on any runtime), replayed under each cell by the
    workers of ``fingerprint_id`` (default: the runtime most of the sample was recorded
    on), or, with ``fingerprints`` (``"all"``: every live fingerprint whose worker holds
    the model; or a list), by one matrix job per fingerprint over the same records: the
    fingerprint axis. A retry with the same Idempotency-Key returns the first run (409 for
    another request); the key is unique in the database, so concurrent first requests make
    one run. ``tolerance``/``run_id``/``indices``: a fingerprint gate's (its golden
    sample; the reports count replays within the tolerance). The request is a
    ``matrix.requested`` admin event signed by ``signer`` (the service key: 503 without
    it), in the same transaction as the jobs. The caller commits, then publishes
    ``parts``."""
    signer = require_signer(signer, "a matrix run request")
    if fingerprints is not None and fingerprint_id is not None:
        raise BadRequest("give fingerprint_id or fingerprints, not both",
                         code="bad_fingerprints")
    digest = _request_digest(model_sha256=model_sha256, fingerprint_id=fingerprint_id,
                             fingerprints=fingerprints if isinstance(fingerprints, str)
                             else (None if fingerprints is None else sorted(fingerprints)),
                             records_fingerprint_id=records_fingerprint_id, sample=sample,
                             seed=seed, cells=list(cells))
    if idempotency_key and (found := _existing_run(session, idempotency_key, digest)):
        return found
    for spec in cells:
        try:
            parse_cell(spec)
        except ValueError as exc:
            raise BadRequest(str(exc), code="bad_cell") from None
    if indices is None:
        indices = sample_indices(session, model_sha256=model_sha256, sample=sample,
                                 seed=seed, fingerprint_id=records_fingerprint_id)
    if not indices:
        raise NotFound(f"no deterministic record of model {model_sha256}"
                       + (f" on fingerprint {records_fingerprint_id}"
                          if records_fingerprint_id else ""))
    if fingerprints == ALL_FINGERPRINTS:
        targets = _live_holding(session, settings, model_sha256)
        if not targets:
            raise NotFound(f"no live worker holds model {model_sha256}: start one "
                           "(`ledger worker --models DIR`) or name the fingerprints")
    elif isinstance(fingerprints, str):
        raise BadRequest(f"fingerprints is {ALL_FINGERPRINTS!r} or a list of fingerprint "
                         "IDs", code="bad_fingerprints")
    elif fingerprints is not None:
        targets = list(dict.fromkeys(fingerprints))
    elif fingerprint_id is not None:
        targets = [fingerprint_id]
    else:
        targets = [session.execute(text(
            "SELECT fingerprint_id FROM envelopes WHERE log_index = ANY(:ix) "
            "GROUP BY fingerprint_id ORDER BY count(*) DESC, fingerprint_id LIMIT 1"),
            {"ix": [i for i, _ in indices]}).scalar_one()]
    if fingerprints is not None or fingerprint_id is not None:
        live = live_fingerprints(session, settings)
        for fp in targets:
            if session.get(Fingerprint, fp) is None and fp not in live:
                raise NotFound(f"no worker or record has fingerprint {fp}")
    params: dict[str, Any] = {
        "cells": list(cells) or list(DEFAULT_CELLS), "sample": sample, "seed": seed,
        "model_sha256": model_sha256, "records_fingerprint_id": records_fingerprint_id,
        "requested_by": actor, "fingerprints": targets, "request_sha256": digest}
    if tolerance is not None:
        params["tolerance"] = tolerance
    items = [(i, rid, None) for i, rid in indices]
    try:
        with session.begin_nested():      # the lead job holds the key: unique in the DB
            lead = create_job(session, fingerprint_id=targets[0], kind="matrix", items=items,
                              settings=settings, params={**params,
                                                         "idempotency_key": idempotency_key},
                              tolerance=tolerance, run_id=run_id)
    except IntegrityError:
        if not idempotency_key:
            raise
        session.expire_all()   # a concurrent first request with this key won the race
        found = _existing_run(session, idempotency_key, digest)
        if found is None:
            raise
        return found
    parts = [lead] + [create_job(session, fingerprint_id=fp, kind="matrix", items=items,
                                 settings=settings, tolerance=tolerance, run_id=run_id,
                                 params={**params, "matrix_run": str(lead.id)})
                      for fp in targets[1:]]
    append_admin_event(session, signer, kind=MATRIX_EVENT_KIND, actor=actor,
                       matrix=matrix_event(session, lead))
    return Requested(lead, True, parts)


def run_parts(session: Session, lead: ReplayJob) -> list[ReplayJob]:
    """A matrix run's jobs, the lead first, then by fingerprint."""
    others = session.scalars(select(ReplayJob).where(
        ReplayJob.kind == "matrix",
        ReplayJob.params["matrix_run"].astext == str(lead.id))
        .order_by(ReplayJob.fingerprint_id)).all()
    return [lead, *others]


def _part_state(session: Session, job: ReplayJob, checker: RecordChecker) -> dict[str, Any]:
    out: dict[str, Any] = {"job_id": str(job.id), "fingerprint_id": job.fingerprint_id,
                           "state": job.state, "state_reason": job.state_reason,
                           "finished_at": job.finished_at, "report": None, "signed": None}
    row = session.scalar(select(MatrixRun).where(MatrixRun.job_id == job.id))
    if row is not None:
        report, checked = checked_report(session, row, checker)
        if checked["fingerprint_id"] != job.fingerprint_id:
            raise StoredReportMismatch(
                f"matrix run {row.run_id}: its worker signed a report for fingerprint "
                f"{checked['fingerprint_id']}, its job is for {job.fingerprint_id}; run "
                "`ledger audit`")
        out["report"] = orjson.loads(report)
        out["signed"] = {**checked, "run_id": row.run_id}
    return out


def lead_job(session: Session, run_id: uuid.UUID | str) -> ReplayJob:
    try:
        job_id = uuid.UUID(str(run_id))
    except ValueError as exc:             # the path's pattern lets through e.g. "0"
        raise NotFound(f"no matrix run {run_id}") from exc
    job = session.get(ReplayJob, job_id)
    if job is None or job.kind != "matrix" or (job.params or {}).get("matrix_run"):
        raise NotFound(f"no matrix run {run_id}")
    return job


def matrix_run_state(session: Session, job_id: uuid.UUID | str, checker: RecordChecker
                     ) -> dict[str, Any]:
    """A matrix run's state and, part by part (one per fingerprint), each report its
    worker signed, checked against its leaf first (:func:`checked_report`). ``report``,
    ``signed``, ``fingerprint_id`` are the lead part's; ``state`` is the parts' common
    state, or ``running`` while some run, or ``partial`` when they ended differently.

    The run itself is checked first against its signed request (:func:`ledger.log.
    registry.matrix_vouched`): model, fingerprints, cells, tolerance, requester and
    records are served only when the leaf states them (:class:`StoredRequestMismatch`
    otherwise). ``sample``, ``seed`` and ``records_fingerprint_id`` say how the records
    were drawn; the leaf binds the records themselves."""
    job = lead_job(session, job_id)
    why = matrix_vouched(session, job, checker.service_keys(session))
    if why is not None:
        raise StoredRequestMismatch(f"matrix run {job.id}: {why}; run `ledger audit`")
    parts = [_part_state(session, j, checker) for j in run_parts(session, job)]
    states = {p["state"] for p in parts}
    state = (states.pop() if len(states) == 1
             else "running" if states - JOB_FINISHED else "partial")
    out: dict[str, Any] = {
        "id": str(job.id), "state": state, "state_reason": job.state_reason,
        "fingerprint_id": job.fingerprint_id, "params": dict(job.params or {}),
        "records": session.scalar(select(func.count()).select_from(ReplayJobItem).where(
            ReplayJobItem.job_id == job.id)),
        "created_at": job.created_at,
        "finished_at": max((p["finished_at"] for p in parts if p["finished_at"]),
                           default=None)
        if all(p["state"] in JOB_FINISHED for p in parts) else None,
        "report": parts[0]["report"], "signed": parts[0]["signed"], "parts": parts,
        # the fingerprint axis: a cell per fingerprint, each from a checked, signed part
        "by_fingerprint": [
            {"fingerprint_id": p["fingerprint_id"], "worker_id": p["signed"]["worker_id"],
             "cell": c["cell"], "records": c["records"],
             "token_identical": c["token_identical"], "bitwise": c["bitwise"],
             "max_abs_logprob_diff": c["max_abs_logprob_diff"],
             "first_divergence_histogram": c["first_divergence_histogram"]}
            for p in parts if p["report"] is not None for c in p["report"]["cells"]],
        "gate_run_id": gate_of(session, job)}
    for hidden in ("idempotency_key", "request_sha256"):
        out["params"].pop(hidden, None)
    return out


#: Matrix runs newest first (lead jobs: their ID is the run's)
MATRIX_ORDER = SortKey(((ReplayJob.created_at, True), (ReplayJob.id, True)), ("time", "uuid"))


def gate_of(session: Session, job: ReplayJob) -> str | None:
    """The fingerprint gate a matrix run (vouched for by its signed request) decides, or
    None. Its tie, ``run_id``, is a database column: it counts only where the gate's
    claim (held to its ``gate.claimed`` leaf by ``ledger audit``) is for the run's one
    fingerprint and model, at the gate's tolerance, which only a gate asks for."""
    from ledger.replay.gate import GATE_TOLERANCE

    run = session.get(ReverificationRun, job.run_id) if job.run_id else None
    asked = job.params or {}
    if run is None or run.kind != "gate" or asked.get("tolerance") != GATE_TOLERANCE \
            or asked.get("fingerprints") != [run.details.get("new_fingerprint")] \
            or asked.get("model_sha256") != run.details.get("model_sha256"):
        return None
    return str(run.id)


def list_matrix_runs(session: Session, checker: RecordChecker, *, limit: int = 100,
                     cursor: str | None = None) -> Page[dict[str, Any]]:
    """Matrix runs (lead jobs), newest first, a page at a time, each checked against its
    signed request (:func:`ledger.log.registry.matrix_vouched`) before its fields are
    given: ``problem`` says why one is not vouched for, and then only its ID and time
    (what the page is ordered by) are given; model, cells, requester and the parts'
    fingerprints and states for the rest (no report: a run's own page checks those)."""
    trusted = checker.service_keys(session)
    leads, next_cursor = page(
        session, select(ReplayJob).where(ReplayJob.kind == "matrix",
                                         ReplayJob.params["matrix_run"].astext.is_(None)),
        MATRIX_ORDER, limit=limit, cursor=cursor,
        digest=query_digest({"list": "matrix-runs"}), key_of=lambda j: (j.created_at, j.id))
    out = []
    for job in leads:
        problem = matrix_vouched(session, job, trusted)
        item: dict[str, Any] = {"id": str(job.id), "created_at": job.created_at,
                                "problem": problem, "model_sha256": None, "cells": [],
                                "requested_by": None, "gate_run_id": None, "parts": []}
        if problem is None:
            params = job.params or {}
            item.update(model_sha256=params.get("model_sha256"),
                        cells=params.get("cells") or [],
                        requested_by=params.get("requested_by"),
                        gate_run_id=gate_of(session, job),
                        parts=[(p.fingerprint_id, p.state) for p in run_parts(session, job)])
        out.append(item)
    return Page(out, next_cursor)


def checker_for(settings: Settings) -> RecordChecker:
    """What the API believes when it checks a report: the trust policy
    (``LEDGER_TRUST_POLICY_FILE``) where there is one, else the database's keys."""
    from ledger.core.trust import load_trust_policy

    trust = (load_trust_policy(settings.trust_policy_file)
             if settings.trust_policy_file is not None else None)
    return RecordChecker(settings.log_name, trust, wait_s=0)
