"""The replay matrix checks every sampled record before replaying it (issue 16, item 3):
its DSSE signature under a producer key the trust policy vouches for, and its inclusion in
a checkpoint signed by a policy log key. An insider's edits to stored envelopes, and a
record no checkpoint covers yet, are listed in the report with the reason, not replayed."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import select

pytest.importorskip("torch")

from typer.testing import CliRunner

from ledger.cli.main import app
from ledger.core.envelope import output_digest
from ledger.db.models import ReplayJobItem
from ledger.db.session import session_scope
from ledger.producer import sign_statement
from ledger.services import ingest
from tests.replay.conftest import Stack, record
from tests.replay.test_replay_inprocess import ingest_all


def _superuser(db_url: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True)
    conn.execute("SET session_replication_role = replica")   # the insider: no triggers
    return conn


def test_matrix_reports_records_that_fail_their_checks_and_replays_only_the_rest(
        stack: Stack, tiny_engine: Any, tmp_path: Path) -> None:
    recs = record(tiny_engine, stack.producer, 6, seed=5, prefix="mx")
    ingest_all(stack, [r.envelope for r in recs])
    late = record(tiny_engine, stack.producer, 1, seed=6, prefix="late")[0]
    with session_scope(stack.db) as s:    # sequenced, but no checkpoint covers it yet
        assert ingest.ingest(s, [late.envelope], stack.settings)[0].status == 201
    bad_sig, rewritten = recs[1].request_id, recs[2].request_id
    with _superuser(stack.settings.database_url) as conn:
        # 1. a signature byte changed in the stored bytes
        (raw,) = conn.execute("SELECT dsse FROM envelopes WHERE request_id = %s",
                              (bad_sig,)).fetchone()
        obj = json.loads(bytes(raw))
        sig = bytearray(base64.b64decode(obj["signatures"][0]["sig"]))
        sig[0] ^= 1
        obj["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
        conn.execute("UPDATE envelopes SET dsse = %s WHERE request_id = %s",
                     (json.dumps(obj).encode(), bad_sig))
        # 2. the output rewritten and re-signed with the real producer key (a compromised
        # gateway rewriting history): the signature holds, the log does not
        st = copy.deepcopy(recs[2].statement)
        tokens = st["predicate"]["output"]["token_ids"]
        tokens[1] = (tokens[1] + 1) % 256
        st["subject"] = [{"name": rewritten, "digest": {"sha256": output_digest(tokens)}}]
        forged = sign_statement(st, stack.producer).canonical_bytes()
        conn.execute("UPDATE envelopes SET dsse = %s, dsse_sha256 = sha256(%s) "
                     "WHERE request_id = %s", (forged, forged, rewritten))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, [
        "matrix", "run", "--database-url", stack.settings.database_url, "--trust",
        str(stack.settings.trust_policy_file), "--sample", "0", "--output", str(out),
        "--cell", "alone", "--cell", "batch:4"])
    assert result.exit_code == 0, result.output
    rep = json.loads(out.read_text())
    reasons = {u["request_id"]: u["reason"] for u in rep["unverified"]}
    assert set(reasons) == {bad_sig, rewritten, late.request_id}, reasons
    assert reasons[bad_sig].startswith("bad signature"), reasons
    assert reasons[rewritten].startswith("not verifiably in the log"), reasons
    assert "not in a signed checkpoint" in reasons[late.request_id], reasons
    honest = {r.request_id for r in recs} - {bad_sig, rewritten}
    assert set(rep["records"]) == honest
    assert rep["verification"].startswith("trust policy")
    for cell in rep["cells"]:      # only the checked records were replayed, all bitwise
        assert cell["records"] == len(honest) and cell["bitwise"] == len(honest), cell
    assert "Not replayed" in (tmp_path / "report.html").read_text()


def test_records_from_a_file_are_refused_without_no_verify(tmp_path: Path) -> None:
    path = tmp_path / "envelopes.jsonl"
    path.write_text("{}\n")
    result = CliRunner().invoke(app, ["matrix", "run", "--envelopes", str(path),
                                      "--cell", "alone"])
    assert result.exit_code != 0
    assert "--no-verify" in result.output






def test_signed_report_is_a_leaf_that_audit_and_verify_accept_and_edits_are_caught(
        stack: Stack, tiny_engine: Any, tmp_path: Path) -> None:
    from ledger.core.bundle import verify_bundle
    from ledger.core.keys import private_pem
    from ledger.db.models import MatrixRun
    from ledger.log.audit import audit
    from ledger.log.export import Selection, bundle_lines
    from ledger.log.integrator import integrate_all
    from ledger.replay.matrix_runs import StoredReportMismatch, checked_report
    from ledger.replay.trusted import RecordChecker

    recs = record(tiny_engine, stack.producer, 4, seed=7, prefix="leaf")
    ingest_all(stack, [r.envelope for r in recs])
    key = tmp_path / "worker.pem"
    key.write_bytes(private_pem(stack.worker_signer.key))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, [
        "matrix", "run", "--database-url", stack.settings.database_url, "--trust",
        str(stack.settings.trust_policy_file), "--sample", "0", "--output", str(out),
        "--cell", "alone", "--sign-with", str(key)])
    assert result.exit_code == 0, result.output
    integrate_all(stack.db, stack.log_signer)
    checker = RecordChecker(stack.settings.log_name, stack.trust)
    with session_scope(stack.db) as s:
        (row,) = s.scalars(select(MatrixRun)).all()
        served, checked = checked_report(s, row, checker)
        assert json.loads(served) == json.loads(out.read_text())
        assert checked["checkpoint"] is not None and checked["log_index"] == row.log_index
        run_id, index = row.run_id, row.log_index
    report = audit(stack.db, stack.settings.log_name, signatures=True, trust=stack.trust)
    # (the fixture's API keys are provisioned without registry leaves: reported as such)
    assert [p for p in report.problems if not p.startswith("registry: ")] == []
    assert report.signatures_checked == report.entries
    assert report.records_checked.get("matrix_run") == 1
    bundle = b"".join(bundle_lines(stack.db, Selection(), signer=stack.service))
    summary = verify_bundle(bundle, trust=stack.trust)
    assert summary.by_kind.get("matrix_run") == 1, summary
    with _superuser(stack.settings.database_url) as conn:   # the insider edits the report
        (raw,) = conn.execute("SELECT report FROM matrix_runs").fetchone()
        edited = bytes(raw).replace(b'"bitwise":4', b'"bitwise":3')
        assert edited != bytes(raw)
        conn.execute("UPDATE matrix_runs SET report = %s", (edited,))
    report = audit(stack.db, stack.settings.log_name)
    assert not report.ok and report.first_bad_index == index
    assert any("report_sha256" in p and run_id in p for p in report.problems), report.problems
    with session_scope(stack.db) as s, pytest.raises(StoredReportMismatch):
        checked_report(s, s.scalars(select(MatrixRun)).one(), checker)


def test_the_fingerprint_gate_is_decided_by_its_signed_matrix_report(
        stack: Stack, tiny_engine: Any) -> None:
    """The gate claims a matrix run over the new fingerprint on its golden records; the
    new runtime's worker signs the report, and the gate's pass/fail is read from it (the
    same decision as the verdicts', which stay the per-record evidence); an insider who
    edits the stored report makes the gate fail, not pass."""
    from ledger.db.models import MatrixRun, ReplayJob
    from ledger.log.integrator import integrate_all
    from ledger.replay import gate, reverification
    from ledger.replay.matrix_runs import matrix_run_state
    from ledger.replay.trusted import RecordChecker
    from workers.replay import ReplayWorker

    recs = record(tiny_engine, stack.producer, 5, seed=41, prefix="gmx")
    ingest_all(stack, [r.envelope for r in recs])
    bf16 = ReplayWorker(stack.settings, stack.db, models=["tiny-demo"], dtype="bfloat16",
                        signer=stack.worker_signer, trust=stack.trust)
    bf16.register()
    [run_id] = gate.check_new_fingerprints(stack.db, stack.settings, stack.service)
    with session_scope(stack.db) as s:
        jobs = list(s.scalars(select(ReplayJob).where(ReplayJob.run_id == run_id)))
        [matrix] = [j for j in jobs if j.kind == "matrix"]
        assert {j.kind for j in jobs} == {"gate", "matrix"}
        assert matrix.fingerprint_id == bf16.fingerprint_id
        assert matrix.params["cells"] == ["alone"]
        assert matrix.params["tolerance"] == gate.GATE_TOLERANCE
        gate_items = sorted(s.scalars(select(ReplayJobItem.request_id).join(
            ReplayJob, ReplayJob.id == ReplayJobItem.job_id).where(
            ReplayJob.run_id == run_id, ReplayJob.kind == "gate")))
        matrix_items = sorted(s.scalars(select(ReplayJobItem.request_id).where(
            ReplayJobItem.job_id == matrix.id)))
        assert gate_items == matrix_items and len(matrix_items) == 5   # the same records
        ids = [str(j.id) for j in jobs]
        matrix_id = matrix.id
    checker = RecordChecker(stack.settings.log_name, stack.trust)
    with session_scope(stack.db) as s:   # not complete: undecided
        assert reverification.report(s, str(run_id), checker)["gate"]["passed"] is None
    for jid in ids:
        assert bf16.run_job(jid) == "done"
    integrate_all(stack.db, stack.log_signer)
    with session_scope(stack.db) as s:
        rep = reverification.report(s, str(run_id), checker)
        state = matrix_run_state(s, matrix_id, checker)
    decision = rep["gate"]
    assert rep["complete"] and decision["decided_by"] == "signed matrix report"
    assert decision["matrix_run"] == str(matrix_id) and decision["reason"]
    assert decision["passed"] is reverification.gate_passed(rep), (decision, rep["counts"])
    signed = state["report"]
    assert state["signed"]["checkpoint"] is not None and signed["tolerance"] == 1e-2
    [cell] = signed["cells"]
    assert cell["records"] == 5
    assert (cell["within_tolerance"] == 5) is decision["passed"]
    assert state["gate_run_id"] == str(run_id)
    # a matrix run the API requested, tied to the gate in the database: not the gate's
    from ledger.replay.matrix_runs import request_matrix_run

    with session_scope(stack.db) as s:
        other = request_matrix_run(
            s, stack.settings, signer=stack.service, actor="eve", sample=5, seed=0,
            model_sha256=recs[0].statement["predicate"]["artifacts"]["model_sha256"],
            fingerprint_id=bf16.fingerprint_id, records_fingerprint_id=None,
            cells=["alone"]).job.id
    with _superuser(stack.settings.database_url) as conn:
        conn.execute("UPDATE replay_jobs SET run_id = %s WHERE id = %s", (run_id, other))
    with session_scope(stack.db) as s:
        assert matrix_run_state(s, other, checker)["gate_run_id"] is None
        assert matrix_run_state(s, matrix_id, checker)["gate_run_id"] == str(run_id)
    with _superuser(stack.settings.database_url) as conn:
        conn.execute("UPDATE replay_jobs SET run_id = NULL WHERE id = %s", (other,))
    # the insider raises the within-tolerance count of a failing gate (or lowers a passing
    # one's): the stored report no longer matches its signed leaf, and the gate fails
    with session_scope(stack.db) as s:
        raw = bytes(s.scalars(select(MatrixRun.report).where(
            MatrixRun.job_id == matrix_id)).one())
    edited = raw.replace(f'"within_tolerance":{cell["within_tolerance"]}'.encode(),
                         f'"within_tolerance":{4 if cell["within_tolerance"] == 5 else 5}'.encode())
    assert edited != raw
    with _superuser(stack.settings.database_url) as conn:
        conn.execute("UPDATE matrix_runs SET report = %s WHERE job_id = %s",
                     (edited, matrix_id))
    with session_scope(stack.db) as s:
        tampered = reverification.report(s, str(run_id), checker)["gate"]
    assert tampered["passed"] is False and "not the one its worker signed" in tampered["reason"]
    # the tie of gate and run is a column: untied, the gate does not fall back to its
    # verdicts while a signed request of it exists; tied to a run asking for something
    # else, it fails
    with _superuser(stack.settings.database_url) as conn:
        conn.execute("UPDATE matrix_runs SET report = %s WHERE job_id = %s", (raw, matrix_id))
        conn.execute("UPDATE replay_jobs SET run_id = NULL WHERE id = %s", (matrix_id,))
    with session_scope(stack.db) as s:
        untied = reverification.report(s, str(run_id), checker)["gate"]
    assert untied["passed"] is False and "tied to the gate" in untied["reason"], untied
    with _superuser(stack.settings.database_url) as conn:
        conn.execute("UPDATE replay_jobs SET run_id = %s, params = jsonb_set(params, "
                     "'{tolerance}', '0.5') WHERE id = %s", (run_id, matrix_id))
    with session_scope(stack.db) as s:
        retied = reverification.report(s, str(run_id), checker)["gate"]
    assert retied["passed"] is False and "signed leaf" in retied["reason"], retied


def test_a_matrix_run_request_is_a_signed_leaf_the_audit_holds_its_jobs_to(
        stack: Stack, tiny_engine: Any) -> None:
    """``request_matrix_run`` signs a ``matrix.requested`` leaf with the service key in the
    transaction that makes the jobs (no key: 503, nothing made); an insider who rewrites a
    run's cells or records, plants a matrix job, or deletes one is named by the audit."""
    import uuid

    from ledger.db.models import AdminEvent, ReplayJob
    from ledger.errors import Unavailable
    from ledger.log.audit import audit
    from ledger.log.integrator import integrate_all
    from ledger.replay.matrix_runs import request_matrix_run

    recs = record(tiny_engine, stack.producer, 4, seed=43, prefix="mxr")
    ingest_all(stack, [r.envelope for r in recs])
    model = recs[0].statement["predicate"]["artifacts"]["model_sha256"]
    ask = {"actor": "alice", "model_sha256": model, "fingerprint_id": None,
           "records_fingerprint_id": None, "sample": 3, "seed": 0, "cells": ["alone"]}
    with session_scope(stack.db) as s, pytest.raises(Unavailable):
        request_matrix_run(s, stack.settings, **ask)                          # no signer
    with session_scope(stack.db) as s:
        assert s.scalars(select(ReplayJob).where(ReplayJob.kind == "matrix")).all() == []
    runs = []
    for seed in (0, 1, 2):
        with session_scope(stack.db) as s:
            runs.append(request_matrix_run(s, stack.settings, signer=stack.service,
                                           **{**ask, "seed": seed}).job.id)
    with session_scope(stack.db) as s:
        leaves = {e.target: e.body["matrix"] for e in s.scalars(
            select(AdminEvent).where(AdminEvent.kind == "matrix.requested"))}
    assert set(leaves) == {str(r) for r in runs}
    assert leaves[str(runs[0])]["cells"] == ["alone"] and leaves[str(runs[0])]["records"] == 3
    assert leaves[str(runs[0])]["requested_by"] == "alice"
    integrate_all(stack.db, stack.log_signer)

    def matrix_problems() -> list[str]:
        report = audit(stack.db, stack.settings.log_name, signatures=True, trust=stack.trust)
        return [p for p in report.problems if "matrix run" in p]

    assert matrix_problems() == []
    rewritten, repointed, dropped, planted = runs[0], runs[1], runs[2], uuid.uuid4()
    with _superuser(stack.settings.database_url) as conn:
        # the cells of a run rewritten: the default kernels, where divergence is expected
        conn.execute("UPDATE replay_jobs SET params = jsonb_set(params, '{cells}', "
                     "'[\"kernels:default\"]') WHERE id = %s", (rewritten,))
        # one record of a run swapped for one it did not sample
        (index, rid), = conn.execute(
            "SELECT log_index, request_id FROM envelopes WHERE request_id LIKE 'mxr%%' AND "
            "request_id NOT IN (SELECT request_id FROM replay_job_items WHERE job_id = %s)",
            (repointed,)).fetchall()
        conn.execute("UPDATE replay_job_items SET envelope_index = %s, request_id = %s "
                     "WHERE job_id = %s AND position = 0", (index, rid, repointed))
        # a run deleted, and one planted that nobody requested
        conn.execute("DELETE FROM replay_job_items WHERE job_id = %s", (dropped,))
        conn.execute("DELETE FROM replay_jobs WHERE id = %s", (dropped,))
        conn.execute("INSERT INTO replay_jobs (id, fingerprint_id, kind, state, params, "
                     "created_at) SELECT %s, fingerprint_id, kind, state, "
                     "params - 'idempotency_key', created_at FROM replay_jobs "
                     "WHERE id = %s", (planted, rewritten))
    found = matrix_problems()
    assert any(f"matrix run {rewritten}" in p and "cells" in p for p in found), found
    assert any(f"matrix run {repointed}" in p and "records_sha256" in p for p in found), found
    assert any(f"requests matrix run {dropped}" in p and "replay_jobs lacks" in p
               for p in found), found
    assert any(f"matrix run {planted}" in p and "no request leaf" in p for p in found), found


def test_a_matrix_run_is_served_only_as_its_signed_request_states_it(
        stack: Stack, tiny_engine: Any) -> None:
    """``GET /v1/matrix-runs/{id}`` and the console (``matrix_run_state``,
    ``list_matrix_runs``) check a run against its ``matrix.requested`` leaf before serving
    it: a rewritten request, a deleted leaf, a planted part or a part replaying other
    records is refused (409 ``matrix_request_mismatch``) or listed as not vouched for, and
    named by ``ledger audit``; an untouched run is served."""
    import uuid

    from ledger.db.models import Fingerprint
    from ledger.log.audit import audit
    from ledger.log.integrator import integrate_all
    from ledger.replay.matrix_runs import (
        StoredRequestMismatch,
        checker_for,
        list_matrix_runs,
        matrix_run_state,
        request_matrix_run,
    )

    recs = record(tiny_engine, stack.producer, 4, seed=44, prefix="mxs")
    ingest_all(stack, [r.envelope for r in recs])
    model = recs[0].statement["predicate"]["artifacts"]["model_sha256"]
    with session_scope(stack.db) as s:
        fp = s.scalars(select(Fingerprint.fingerprint_id)).first()
        assert fp is not None
        other = "f" * 64                      # a second fingerprint the run can name
        s.add(Fingerprint(fingerprint_id=other, runtime={"engine": "other"}))
    ask = {"actor": "bob", "model_sha256": model, "records_fingerprint_id": None,
           "sample": 3, "cells": ["alone"], "fingerprint_id": None}
    runs = []
    for seed in range(6):
        with session_scope(stack.db) as s:
            runs.append(request_matrix_run(
                s, stack.settings, signer=stack.service,
                **{**ask, "seed": seed, **({"fingerprint_id": None, "fingerprints":
                                            [fp, other]} if seed >= 3 else {})}).job.id)
    integrate_all(stack.db, stack.log_signer)
    checker = checker_for(stack.settings)

    def served(run: uuid.UUID) -> str | None:
        with session_scope(stack.db) as s:
            try:
                state = matrix_run_state(s, run, checker)
            except StoredRequestMismatch as exc:
                assert exc.code == "matrix_request_mismatch"
                return exc.message
            assert state["params"]["requested_by"] == "bob"
            return None

    def listed() -> dict[str, str | None]:
        with session_scope(stack.db) as s:
            found = list_matrix_runs(s, checker, limit=2)   # pages of two, newest first
            items = list(found.items)
            while found.next_cursor:
                found = list_matrix_runs(s, checker, limit=2, cursor=found.next_cursor)
                items += found.items
            assert [r["id"] for r in items] == [str(r) for r in reversed(runs)]
            for r in items:   # a run not vouched for gives only its ID and time
                assert (r["requested_by"] is None) == (r["problem"] is not None), r
            return {r["id"]: r["problem"] for r in items}

    assert [served(r) for r in runs] == [None] * 6
    assert set(listed().values()) == {None}
    rewritten, unsigned, fine, planted_in, repointed, recelled = runs
    with _superuser(stack.settings.database_url) as conn:
        conn.execute("UPDATE replay_jobs SET params = jsonb_set(params, '{requested_by}', "
                     "'\"mallory\"') WHERE id = %s", (rewritten,))
        conn.execute("DELETE FROM admin_events WHERE target = %s", (str(unsigned),))
        # a part planted in a two-fingerprint run: a second job for the lead's fingerprint
        conn.execute("INSERT INTO replay_jobs (id, fingerprint_id, kind, state, params, "
                     "created_at) SELECT %s, fingerprint_id, kind, state, "
                     "jsonb_build_object('matrix_run', id::text), created_at "
                     "FROM replay_jobs WHERE id = %s", (uuid.uuid4(), planted_in))
        # the other part of a two-fingerprint run replays a record the request did not
        (index, rid), = conn.execute(
            "SELECT log_index, request_id FROM envelopes WHERE request_id LIKE 'mxs%%' AND "
            "request_id NOT IN (SELECT request_id FROM replay_job_items WHERE job_id = %s) "
            "LIMIT 1", (repointed,)).fetchall()
        conn.execute("UPDATE replay_job_items SET envelope_index = %s, request_id = %s "
                     "WHERE position = 0 AND job_id = (SELECT id FROM replay_jobs "
                     "WHERE params->>'matrix_run' = %s)", (index, rid, str(repointed)))
        # the other part of a two-fingerprint run asks its worker for other cells
        conn.execute("UPDATE replay_jobs SET params = jsonb_set(params, '{cells}', "
                     "'[\"kernels:default\"]') WHERE params->>'matrix_run' = %s",
                     (str(recelled),))
    why = {r: served(r) for r in runs}
    assert why[fine] is None
    assert "differ from the request its signed leaf states" in str(why[rewritten])
    assert "no single matrix.requested leaf" in str(why[unsigned])
    assert "its jobs are for fingerprints" in str(why[planted_in])
    assert "replays other records than the request's" in str(why[repointed])
    assert "asks for other cells or parameters" in str(why[recelled])
    assert {k for k, v in listed().items() if v} == {str(r) for r in runs if r != fine}
    found = [p for p in audit(stack.db, stack.settings.log_name, signatures=True,
                              trust=stack.trust).problems if "matrix run" in p]
    for run, words in ((rewritten, "requested_by"), (planted_in, "its jobs are for"),
                       (repointed, "replays other records"),
                       (recelled, "asks for other cells")):
        assert any(f"matrix run {run}" in p and words in p for p in found), (run, found)
    assert any(f"requests matrix run {unsigned}" in p or f"matrix run {unsigned}" in p
               for p in found), found
