"""The fingerprint-change gate: a new runtime is checked before anyone relies on it.

When a live worker has a fingerprint that no recorded envelope carries, then for each
model it holds, a golden sample of that model's envelopes recorded under the nearest
earlier fingerprint (the most similar runtime; the most recent on ties) is replayed on the
new runtime at the tolerance tier, and the run's report is the drift report. One gate per
(new fingerprint, model), however many times the beat looks.

The same golden records are also a *matrix run* over the new fingerprint (one cell,
``alone``, at the gate's tolerance): the new runtime's worker signs its report, and the
gate passes or fails by that signed report (``ledger.replay.matrix.gate_decision``), while
the per-record verdicts stay the evidence each golden record's drift is read from.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, exists, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.core.fingerprint import fingerprint_material
from ledger.db.models import Envelope, Fingerprint, ReverificationRun, Worker
from ledger.db.session import session_scope
from ledger.replay import jobs, matrix_runs
from ledger.replay.matrix import GATE_CELL
from ledger.replay.records import Signer
from ledger.replay.reverification import JOB_BATCH
from ledger.settings import Settings

GOLDEN_SAMPLE = 16
GATE_TOLERANCE = 1e-2   # max |logprob difference| before divergence counted as tolerance


def _similarity(a: dict[str, Any], b: dict[str, Any]) -> int:
    ma, mb = fingerprint_material(a), fingerprint_material(b)
    return sum(1 for k in set(ma) | set(mb) if ma.get(k) == mb.get(k))


def check_new_fingerprints(engine: Engine, settings: Settings,
                           signer: Signer | None) -> list[uuid.UUID]:
    """Claim a gate for each live fingerprint that is new for a model its worker serves;
    each claim is a ``gate.claimed`` admin event signed by the service key (``signer``;
    nothing is claimed without it), so a gate claimed in the database alone is reported by
    ``ledger audit``."""
    from ledger.log.registry import append_admin_event, gate_event

    made: list[uuid.UUID] = []
    if signer is None:
        return made
    with session_scope(engine) as session:
        live = jobs.live_fingerprints(session, settings)
        for fp in sorted(live):
            if session.scalar(select(exists().where(Envelope.fingerprint_id == fp))):
                continue  # not new: envelopes were recorded on it
            worker = session.scalar(select(Worker).where(Worker.worker_id == live[fp][0]))
            if worker is None:
                continue
            for model in worker.models:
                digest = model["model_sha256"]
                done = session.execute(text(
                    "SELECT 1 FROM reverification_runs WHERE kind = 'gate' AND "
                    "details->>'new_fingerprint' = :fp AND details->>'model_sha256' = :m"),
                    {"fp": fp, "m": digest}).first()
                if done:
                    continue
                earlier = session.execute(
                    select(Fingerprint.fingerprint_id, Fingerprint.runtime,
                           Fingerprint.first_seen_at)
                    .where(exists().where(Envelope.fingerprint_id == Fingerprint.fingerprint_id,
                                          Envelope.model_sha256 == digest))).all()
                if not earlier:
                    continue  # nothing recorded for this model yet: nothing to compare
                best = max(earlier, key=lambda r: (_similarity(r.runtime, worker.runtime),
                                                   r.first_seen_at))
                sample = session.execute(text(
                    "SELECT log_index, request_id FROM envelopes WHERE fingerprint_id = :fp "
                    "AND model_sha256 = :m ORDER BY sha256(convert_to(:seed || request_id, "
                    "'UTF8')) LIMIT :n"),
                    {"fp": best.fingerprint_id, "m": digest, "seed": fp,
                     "n": GOLDEN_SAMPLE}).all()
                now = datetime.now(UTC)
                run_id = uuid.uuid4()
                inserted = session.execute(pg_insert(ReverificationRun).values(
                    id=run_id, policy_id=None, kind="gate", window_start=now, window_end=now,
                    sampled=len(sample),
                    details={"new_fingerprint": fp, "model_sha256": digest,
                             "model_name": model.get("name"),
                             "baseline_fingerprint": best.fingerprint_id,
                             "tolerance": GATE_TOLERANCE,
                             "runtime_changes": _changes(best.runtime, worker.runtime)})
                    .on_conflict_do_nothing().returning(ReverificationRun.id)).first()
                if inserted is None:
                    continue
                run = session.get(ReverificationRun, run_id)
                assert run is not None
                append_admin_event(session, signer, kind="gate.claimed", actor="beat",
                                   gate=gate_event(run))
                for start in range(0, len(sample), JOB_BATCH):
                    jobs.create_job(session, fingerprint_id=fp, kind="gate",
                                    items=[(r.log_index, r.request_id, None)
                                           for r in sample[start:start + JOB_BATCH]],
                                    settings=settings, priority=2, tolerance=GATE_TOLERANCE,
                                    run_id=run_id)
                # the decision: a matrix run over the new fingerprint on the same records,
                # whose report the new runtime's worker signs
                matrix_runs.request_matrix_run(
                    session, settings, actor="beat (fingerprint gate)", model_sha256=digest,
                    fingerprint_id=fp, records_fingerprint_id=best.fingerprint_id,
                    sample=len(sample), seed=0, cells=[GATE_CELL], tolerance=GATE_TOLERANCE,
                    run_id=run_id, indices=[(r.log_index, r.request_id) for r in sample],
                    signer=signer)
                made.append(run_id)
    return made


def _changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    a, b = fingerprint_material(old), fingerprint_material(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
