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
from sqlalchemy.orm import Session

from ledger.core import dsse
from ledger.core.canonical import sha256_hex
from ledger.core.envelope import EnvelopeStatement, Limits, parse_statement
from ledger.core.errors import KeyError_, LedgerError
from ledger.core.logentry import dsse_digest, log_entry_bytes, verify_record_included
from ledger.core.note import open_checkpoint
from ledger.core.statements import matrix_report_bytes, matrix_run_statement
from ledger.db.models import Fingerprint, MatrixRun, ReplayJob, ReplayJobItem
from ledger.db.session import raw_cursor
from ledger.errors import BadRequest, Conflict, NotFound
from ledger.log import proofs
from ledger.replay import views
from ledger.replay.jobs import create_job, live_fingerprints
from ledger.replay.matrix import DEFAULT_CELLS, parse_cell
from ledger.replay.records import Signer, append_signed
from ledger.replay.trusted import CheckedRecord, RecordChecker, Unverifiable
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
    if signed["run_id"] != row.run_id or signed["report_sha256"] != sha256_hex(report):
        raise StoredReportMismatch(f"{where}: the stored report is not the one its worker "
                                   "signed; run `ledger audit`")
    checked: dict[str, Any] = {"log_index": row.log_index, "signed_by": signed["keyids"],
                               "report_sha256": signed["report_sha256"], "checkpoint": None}
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

MAX_SAMPLE = 256
MAX_CELLS = 16


@dataclass
class Requested:
    job: ReplayJob
    created: bool


def request_matrix_run(session: Session, settings: Settings, *, actor: str,
                       model_sha256: str, fingerprint_id: str | None,
                       records_fingerprint_id: str | None, sample: int, seed: int,
                       cells: Sequence[str], idempotency_key: str | None = None) -> Requested:
    """A matrix job: ``sample`` records of the model (recorded on
    ``records_fingerprint_id``, or on any runtime) routed to the workers of
    ``fingerprint_id`` (default: the runtime most of the sample was recorded on). A retry
    with the same Idempotency-Key returns the first job. The caller commits, then
    publishes the job."""
    if idempotency_key:
        existing = session.scalar(select(ReplayJob).where(
            ReplayJob.kind == "matrix",
            ReplayJob.params["idempotency_key"].astext == idempotency_key))
        if existing is not None:
            return Requested(existing, False)
    for spec in cells:
        try:
            parse_cell(spec)
        except ValueError as exc:
            raise BadRequest(str(exc), code="bad_cell") from None
    indices = sample_indices(session, model_sha256=model_sha256, sample=sample, seed=seed,
                             fingerprint_id=records_fingerprint_id)
    if not indices:
        raise NotFound(f"no deterministic record of model {model_sha256}"
                       + (f" on fingerprint {records_fingerprint_id}"
                          if records_fingerprint_id else ""))
    if fingerprint_id is None:
        fingerprint_id = session.execute(text(
            "SELECT fingerprint_id FROM envelopes WHERE log_index = ANY(:ix) "
            "GROUP BY fingerprint_id ORDER BY count(*) DESC, fingerprint_id LIMIT 1"),
            {"ix": [i for i, _ in indices]}).scalar_one()
    elif session.get(Fingerprint, fingerprint_id) is None and fingerprint_id not in \
            live_fingerprints(session, settings):
        raise NotFound(f"no worker or record has fingerprint {fingerprint_id}")
    params = {"cells": list(cells) or list(DEFAULT_CELLS), "sample": sample, "seed": seed,
              "model_sha256": model_sha256, "records_fingerprint_id": records_fingerprint_id,
              "requested_by": actor, "idempotency_key": idempotency_key}
    job = create_job(session, fingerprint_id=fingerprint_id, kind="matrix",
                     items=[(i, rid, None) for i, rid in indices], settings=settings,
                     params=params)
    return Requested(job, True)


def matrix_run_state(session: Session, job_id: uuid.UUID, checker: RecordChecker
                     ) -> dict[str, Any]:
    """A matrix job's state and, once its worker has signed it, the report (checked
    against its leaf first: :func:`checked_report`)."""
    job = session.get(ReplayJob, job_id)
    if job is None or job.kind != "matrix":
        raise NotFound(f"no matrix run {job_id}")
    out: dict[str, Any] = {
        "id": str(job.id), "state": job.state, "state_reason": job.state_reason,
        "fingerprint_id": job.fingerprint_id, "params": dict(job.params or {}),
        "records": session.scalar(select(func.count()).select_from(ReplayJobItem).where(
            ReplayJobItem.job_id == job.id)),
        "created_at": job.created_at, "finished_at": job.finished_at,
        "report": None, "signed": None}
    out["params"].pop("idempotency_key", None)
    row = session.scalar(select(MatrixRun).where(MatrixRun.job_id == job.id))
    if row is not None:
        report, checked = checked_report(session, row, checker)
        out["report"] = orjson.loads(report)
        out["signed"] = {**checked, "run_id": row.run_id, "worker_id": row.worker_id}
    return out


def checker_for(settings: Settings) -> RecordChecker:
    """What the API believes when it checks a report: the trust policy
    (``LEDGER_TRUST_POLICY_FILE``) where there is one, else the database's keys."""
    from ledger.core.trust import load_trust_policy

    trust = (load_trust_policy(settings.trust_policy_file)
             if settings.trust_policy_file is not None else None)
    return RecordChecker(settings.log_name, trust, wait_s=0)
