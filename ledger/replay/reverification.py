"""Scheduled re-verification: policies sample recorded envelopes window by window and
replay them in batches grouped by fingerprint; each run has a drift report.

Windows of a policy are ``[first_window_start + k * interval, + interval)``. A window is
claimed once it has ended, by inserting its run row (unique per policy and window start),
so running the sampler twice, or twice at once, creates and publishes its jobs once. The
candidates of a window are the envelopes recorded in it, shifted back by ``min_age`` (so
each envelope belongs to exactly one window and is old enough), filtered by the policy.
Sampling is deterministic: candidates are ranked by SHA-256(policy id || request_id).
Each claim is also a ``policy.window_claimed`` admin event signed by the service key in the
same transaction, so a window claimed in the database alone (to keep it from ever being
sampled) is reported by ``ledger audit``; a beat without the service key claims nothing.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from ledger.core.states import JOB_FINISHED, VerdictOutcome
from ledger.db.models import (
    AdminEvent,
    Envelope,
    MatrixRun,
    ReplayJob,
    ReverificationPolicy,
    ReverificationRun,
    Verdict,
)
from ledger.db.session import session_scope
from ledger.errors import NotFound
from ledger.replay import jobs
from ledger.replay.records import Signer
from ledger.replay.semantic import semantic_groups
from ledger.settings import Settings

if TYPE_CHECKING:
    from ledger.replay.trusted import RecordChecker

JOB_BATCH = 32          # envelopes per replay job
MAX_WINDOWS_PER_TICK = 20


def window_start_for(policy: ReverificationPolicy, at: datetime) -> datetime:
    step = timedelta(seconds=policy.interval_seconds)
    k = (at - policy.first_window_start) // step
    return policy.first_window_start + k * step


def due_windows(policy: ReverificationPolicy, claimed: set[datetime],
                now: datetime) -> list[datetime]:
    step = timedelta(seconds=policy.interval_seconds)
    out: list[datetime] = []
    start = policy.first_window_start
    if policy.max_age_seconds is not None:  # never look further back than max_age
        floor = now - timedelta(seconds=policy.max_age_seconds)
        if start < floor:
            start = window_start_for(policy, floor)
    while start + step <= now and len(out) < MAX_WINDOWS_PER_TICK:
        if start not in claimed:
            out.append(start)
        start += step
    return out


def sample(session: Session, policy: ReverificationPolicy, window_start: datetime,
           now: datetime) -> list[tuple[int, str, str]]:
    """(log index, request_id, fingerprint_id) of the window's deterministic sample."""
    lag = timedelta(seconds=policy.min_age_seconds)
    lo = window_start - lag
    hi = window_start + timedelta(seconds=policy.interval_seconds) - lag
    conds = ["recorded_at >= :lo", "recorded_at < :hi"]
    params: dict[str, Any] = {"lo": lo, "hi": hi, "seed": str(policy.id)}
    if policy.max_age_seconds is not None:
        conds.append("recorded_at >= :oldest")
        params["oldest"] = now - timedelta(seconds=policy.max_age_seconds)
    for column in ("model_sha256", "fingerprint_id", "channel"):
        value = getattr(policy, column)
        if value:
            conds.append(f"{column} = :{column}")
            params[column] = value
    rank = "sha256(convert_to(:seed || request_id, 'UTF8'))"
    where = " AND ".join(conds)
    if policy.sample_size is not None:
        sql = (f"SELECT log_index, request_id, fingerprint_id FROM envelopes WHERE {where} "  # noqa: S608
               f"ORDER BY {rank} LIMIT :n")
        params["n"] = policy.sample_size
    else:
        # keep a candidate when its rank, read as a fraction of 2^64, is below the rate
        sql = (f"SELECT log_index, request_id, fingerprint_id FROM envelopes WHERE {where} "  # noqa: S608
               f"AND ('x' || substr(encode({rank}, 'hex'), 1, 15))::bit(60)::bigint "
               f"< :threshold ORDER BY log_index")
        params["threshold"] = int((policy.sample_rate or 0) * (1 << 60))
    return [(r[0], r[1], r[2]) for r in session.execute(text(sql), params)]


def claim_window(session: Session, policy: ReverificationPolicy, window_start: datetime,
                 settings: Settings, now: datetime, signer: Signer) -> ReverificationRun | None:
    """Claim one window, create its jobs and sign the claim; None if another sampler
    claimed it."""
    from ledger.log.registry import append_admin_event, run_event

    run_id = uuid.uuid4()
    window_end = window_start + timedelta(seconds=policy.interval_seconds)
    inserted = session.execute(pg_insert(ReverificationRun).values(
        id=run_id, policy_id=policy.id, kind="policy", window_start=window_start,
        window_end=window_end, details={"policy": policy.name}).on_conflict_do_nothing(
        index_elements=["policy_id", "window_start"]).returning(ReverificationRun.id)).first()
    if inserted is None:
        return None
    picked = sample(session, policy, window_start, now)
    by_fp: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for index, rid, fp in picked:
        by_fp[fp].append((index, rid))
    for fp, items in sorted(by_fp.items()):
        for start in range(0, len(items), JOB_BATCH):
            chunk = items[start:start + JOB_BATCH]
            jobs.create_job(session, fingerprint_id=fp, kind="reverification",
                            items=[(i, r, None) for i, r in chunk], settings=settings,
                            priority=0, run_id=run_id)
    run = session.get(ReverificationRun, run_id)
    assert run is not None
    run.sampled = len(picked)
    session.flush()
    append_admin_event(session, signer, kind="policy.window_claimed", actor="beat",
                       run=run_event(run))
    return run


def run_due(engine: Engine, settings: Settings, signer: Signer | None,
            now: datetime | None = None) -> list[uuid.UUID]:
    """Claim every due window of every enabled policy (the beat calls this each tick);
    nothing without the service key (``signer``), whose leaves make the claims
    auditable."""
    if signer is None:
        return []
    now = now or datetime.now(UTC)
    made: list[uuid.UUID] = []
    with session_scope(engine) as session:
        policies = list(session.scalars(select(ReverificationPolicy).where(
            ReverificationPolicy.enabled.is_(True))))
        for policy in policies:
            claimed = set(session.scalars(select(ReverificationRun.window_start).where(
                ReverificationRun.policy_id == policy.id)))
            for window_start in due_windows(policy, claimed, now):
                run = claim_window(session, policy, window_start, settings, now, signer)
                if run is not None:
                    made.append(run.id)
    return made


def report(session: Session, run_id: str, checker: RecordChecker | None = None
           ) -> dict[str, Any]:
    """A run's report; ``checker``: what a gate's signed matrix report is checked against
    (default: ``LEDGER_TRUST_POLICY_FILE``'s keys, else the database's)."""
    try:
        rid = uuid.UUID(run_id)
    except ValueError as exc:
        raise NotFound(f"no re-verification run {run_id}") from exc
    run = session.get(ReverificationRun, rid)
    if run is None:
        raise NotFound(f"no re-verification run {run_id}")
    job_rows = session.execute(select(ReplayJob.id, ReplayJob.state, ReplayJob.fingerprint_id)
                               .where(ReplayJob.run_id == rid)).all()
    # the replay's runtime (the job's fingerprint): for a gate, the NEW fingerprint, which
    # the drift is about; for a policy run the same as the envelope's
    verdicts = session.execute(
        select(Verdict.request_id, Verdict.outcome, Verdict.tier, Verdict.verdict_id,
               Verdict.details, ReplayJob.fingerprint_id, Envelope.model_sha256,
               Envelope.model_name, Envelope.fingerprint_id.label("recorded_fingerprint"))
        .join(Envelope, Envelope.log_index == Verdict.envelope_index)
        .join(ReplayJob, ReplayJob.id == Verdict.job_id)
        .where(ReplayJob.run_id == rid)).all()
    outcomes = Counter(v.outcome for v in verdicts)
    tiers = Counter(v.tier for v in verdicts if v.outcome == VerdictOutcome.REPRODUCED)
    drift: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for v in verdicts:
        drift[(v.fingerprint_id, v.model_sha256)][v.outcome] += 1
    per_group = []
    for (fp, model), counts in sorted(drift.items()):
        diverged_n = counts[VerdictOutcome.DIVERGED]
        judged = counts[VerdictOutcome.REPRODUCED] + diverged_n
        per_group.append({"fingerprint_id": fp, "model_sha256": model, "counts": dict(counts),
                          "drift_rate": (diverged_n / judged) if judged else None})
    diverged = [{"request_id": v.request_id, "verdict_id": v.verdict_id,
                 "first_divergence": (v.details.get("first_divergence") or {}).get("index")}
                for v in verdicts if v.outcome == VerdictOutcome.DIVERGED]
    pending = sum(1 for j in job_rows if j.state not in JOB_FINISHED)
    total_jobs = len(job_rows)
    complete = pending == 0 and len(verdicts) >= run.sampled
    out = {
        "id": str(run.id), "kind": run.kind,
        "policy_id": str(run.policy_id) if run.policy_id else None,
        "window_start": run.window_start, "window_end": run.window_end,
        "created_at": run.created_at, "sampled": run.sampled, "details": run.details,
        "jobs": {"total": total_jobs, "pending": pending},
        "complete": complete,
        "counts": dict(outcomes), "tiers": dict(tiers),
        "drift": per_group, "diverged": diverged,
        "summary": comparison_summary([v.details for v in verdicts]),
        # vendor records: pooled pass rates per (vendor, model alias) (tier semantic)
        "semantic": semantic_groups(verdicts),
    }
    if run.kind == "gate":
        out["gate"] = {"new_fingerprint": run.details.get("new_fingerprint"),
                       "baseline_fingerprint": run.details.get("baseline_fingerprint"),
                       **_gate_decision(session, run, out, complete, checker)}
    return out


def _gate_decision(session: Session, run: ReverificationRun, out: dict[str, Any],
                   complete: bool, checker: RecordChecker | None) -> dict[str, Any]:
    """A gate's pass/fail from the signed report of its matrix run over the new
    fingerprint (checked against its leaf first); a gate claimed before gates were matrix
    runs is decided by its verdicts, as it was."""
    from ledger.log.registry import matrix_vouched
    from ledger.replay import matrix_runs
    from ledger.replay.gate import GATE_TOLERANCE
    from ledger.replay.matrix import gate_decision
    from ledger.settings import get_settings

    checker = checker or matrix_runs.checker_for(get_settings())
    model, new_fp = run.details.get("model_sha256"), run.details.get("new_fingerprint")
    lead = session.scalar(select(ReplayJob).where(
        ReplayJob.run_id == run.id, ReplayJob.kind == "matrix").order_by(ReplayJob.created_at))
    if lead is None:
        # only a gate claimed before gates were matrix runs: one whose matrix run exists
        # (a signed request at the gate's tolerance, for its fingerprint and model) but
        # is no longer tied to it in the database is not decided by verdicts instead
        if _gate_requests(session, checker, model, new_fp):
            return {"passed": False, "decided_by": "signed matrix report", "matrix_run": None,
                    "reason": "a signed matrix request of this gate exists, but no matrix "
                              "run of the database is tied to the gate; run `ledger audit`"}
        return {"passed": gate_passed(out) if complete else None, "decided_by": "verdicts",
                "matrix_run": None, "reason": None}
    decided: dict[str, Any] = {"decided_by": "signed matrix report",
                               "matrix_run": str(lead.id), "passed": None, "reason": None}
    # the gate-to-run tie is a database column: the run must be vouched for by its
    # signed request, and that request must be a gate's (the code's tolerance; only the
    # gate asks for one) over this gate's new fingerprint and model
    why = matrix_vouched(session, lead, checker.service_keys(session))
    if why is None and matrix_runs.gate_of(session, lead) != str(run.id):
        why = "its signed request is not this gate's (fingerprint, model or tolerance)"
    if why is not None:
        decided.update(passed=False, reason=f"matrix run {lead.id}: {why}; run `ledger audit`")
        return decided
    if not complete:
        return decided
    row = session.scalar(select(MatrixRun).where(MatrixRun.job_id == lead.id))
    if row is None:
        decided.update(passed=False, reason=f"the matrix run ended {lead.state} without a "
                                            f"signed report: {lead.state_reason or ''}")
        return decided
    try:
        report_bytes, checked = matrix_runs.checked_report(session, row, checker)
        if checked["fingerprint_id"] != new_fp:
            raise matrix_runs.StoredReportMismatch(
                f"matrix run {row.run_id}: its worker signed a report for fingerprint "
                f"{checked['fingerprint_id']}, not the gate's {new_fp}")
    except matrix_runs.StoredReportMismatch as exc:
        decided.update(passed=False, reason=exc.message)
        return decided
    passed, reason = gate_decision(
        # the code's tolerance, not the run row's (which the database holds, unsigned)
        orjson.loads(report_bytes), tolerance=GATE_TOLERANCE, expected_records=run.sampled)
    decided.update(passed=passed, reason=reason)
    return decided


def _gate_requests(session: Session, checker: RecordChecker, model: Any, new_fp: Any
                   ) -> list[str]:
    """IDs of the matrix runs whose signed request (a leaf by a believed service key) is a
    fingerprint gate's for ``new_fp`` and ``model``."""
    from ledger.core.statements import MATRIX_EVENT_KIND
    from ledger.log.registry import signed_leaf
    from ledger.replay.gate import GATE_TOLERANCE

    trusted, found = checker.service_keys(session), []
    for target in session.scalars(select(AdminEvent.target).where(
            AdminEvent.kind == MATRIX_EVENT_KIND,
            AdminEvent.body["matrix"]["model_sha256"].as_string() == str(model))):
        pred, _ = signed_leaf(session, MATRIX_EVENT_KIND, target, trusted)
        m = (pred or {}).get("matrix") or {}
        if m.get("fingerprints") == [new_fp] and m.get("tolerance") == GATE_TOLERANCE:
            found.append(target)
    return found


def comparison_summary(details: list[dict[str, Any]]) -> dict[str, Any]:
    """Over a run's verdicts: steps compared, max and median of each verdict's max |logprob
    difference| (before any divergence), and the first-divergence positions."""
    diffs = sorted(float(d["max_abs_logprob_diff"]) for d in details
                   if d.get("max_abs_logprob_diff") is not None)
    positions = sorted(int((d.get("first_divergence") or {})["index"]) for d in details
                       if (d.get("first_divergence") or {}).get("index") is not None)
    median = None
    if diffs:
        mid = len(diffs) // 2
        median = diffs[mid] if len(diffs) % 2 else (diffs[mid - 1] + diffs[mid]) / 2
    return {"replays": len(details),
            "steps_compared": sum(int(d.get("steps_compared") or 0) for d in details),
            "max_abs_logprob_diff": diffs[-1] if diffs else None,
            "median_abs_logprob_diff": median,
            "first_divergence_positions": positions}


def gate_passed(report_: dict[str, Any]) -> bool:
    """A gate passes when every golden envelope reproduced (at the tolerance tier or
    better): no divergence, nothing unverifiable, no engine error."""
    counts = report_["counts"]
    return bool(counts) and set(counts) == {"reproduced"}


def set_policy_enabled(session: Session, policy_id: str, enabled: bool) -> ReverificationPolicy:
    """Pause (False) or resume (True) a policy: a paused one claims no window; resuming
    does not back-fill the windows that ended meanwhile beyond ``max_age``."""
    policy = get_policy(session, policy_id, lock=True)
    policy.enabled = enabled
    session.flush()
    return policy


def delete_policy(session: Session, policy_id: str) -> str:
    """Delete a policy; its runs stay, with their reports, detached (``policy_id`` null,
    the policy's name in ``details``). Returns the name."""
    policy = get_policy(session, policy_id, lock=True)
    session.execute(update(ReverificationRun).where(
        ReverificationRun.policy_id == policy.id).values(policy_id=None))
    name = policy.name
    session.delete(policy)
    session.flush()
    return name


def get_policy(session: Session, policy_id: str, *, lock: bool = False) -> ReverificationPolicy:
    try:
        pid = uuid.UUID(policy_id)
    except ValueError as exc:
        raise NotFound(f"no re-verification policy {policy_id}") from exc
    policy = session.get(ReverificationPolicy, pid, with_for_update=lock)
    if policy is None:
        raise NotFound(f"no re-verification policy {policy_id}")
    return policy


def count_runs(session: Session, policy_id: uuid.UUID) -> int:
    return int(session.scalar(select(func.count()).select_from(ReverificationRun).where(
        ReverificationRun.policy_id == policy_id)) or 0)
