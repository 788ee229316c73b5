"""What the console's pages read: search, a request with its verification, disputes, verdict
diffs and re-verification runs.

Every value shown comes from signed bytes (the stored DSSE payloads, through
:mod:`ledger.replay.views`), and each page says where a table column disagrees with them.
The request page checks the record itself: the producer's signature, the log entry it
should have, the inclusion proof against the latest signed checkpoint, and that
checkpoint's signature (with the trust policy's log keys when one is configured).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, exists, func, or_, select
from sqlalchemy.orm import Session

from ledger.db.models import (
    Dispute,
    DisputeEvent,
    Envelope,
    JobAttempt,
    ReplayJob,
    ReverificationRun,
    Verdict,
)
from ledger.errors import BadRequest, NotFound
from ledger.log import proofs
from ledger.replay import queries as replay_queries
from ledger.replay import views
from ledger.settings import Settings

PAGE_SIZE = 50
DISPUTE_STATES = ("opened", "queued", "awaiting_worker", "replaying", "verdict", "resolved")


# --- search -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SearchQuery:
    request_id: str | None = None        # a request ID or its prefix
    client_request_id: str | None = None  # the client's X-Request-Id (capture proxy IDs)
    model_name: str | None = None        # case-insensitive, exact
    channel: str | None = None
    fingerprint_id: str | None = None
    dispute: str | None = None           # a dispute state, "any" or "none"
    recorded_after: datetime | None = None
    recorded_before: datetime | None = None

    @property
    def by_request_id(self) -> bool:
        return bool(self.request_id or self.client_request_id)

    def digest(self) -> str:
        blob = json.dumps(asdict(self), default=str, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _like_prefix(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _cursor(query: SearchQuery, last: Any) -> str:
    raw = json.dumps({"q": query.digest(), "last": last}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _after(query: SearchQuery, cursor: str) -> Any:
    try:
        obj = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        q, last = obj["q"], obj["last"]
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise BadRequest("this page link is not one the console made", code="bad_cursor") from exc
    if q != query.digest() or not isinstance(last, (int, str)) or isinstance(last, bool):
        raise BadRequest("this page link belongs to another search; search again",
                         code="bad_cursor")
    return last


def search(session: Session, query: SearchQuery, *, cursor: str | None = None,
           limit: int = PAGE_SIZE) -> tuple[list[dict[str, Any]], str | None]:
    """Matching envelopes and the next page's cursor.

    Searches by request ID (or the client's ``X-Request-Id``) are prefix searches in
    request-ID (byte) order, on the ``COLLATE "C"`` index; the rest are newest first by log
    index, on the (column, log_index) indexes, so a page costs one short index range."""
    e = Envelope
    rid_c = e.request_id.collate("C")  # byte order: the prefix index (migration 0011)
    stmt = select(e.request_id, e.log_index, e.recorded_at, e.channel, e.tier,
                               e.model_name, e.fingerprint_id, e.prompt_tokens,
                               e.output_tokens)
    if query.request_id:
        stmt = stmt.where(rid_c.like(_like_prefix(query.request_id), escape="\\"))
    if query.client_request_id:
        # the capture proxy's IDs: "cmpl-<X-Request-Id>" / "chatcmpl-<X-Request-Id>", with
        # "-<index>" for several prompts in one request (docs/capture.md)
        x = query.client_request_id
        stmt = stmt.where(or_(*[cond for p in ("cmpl-", "chatcmpl-") for cond in (
            rid_c == p + x, rid_c.like(_like_prefix(f"{p}{x}-"), escape="\\"))],
            rid_c == x))
    if query.model_name:
        stmt = stmt.where(func.lower(e.model_name) == query.model_name.lower())
    if query.channel:
        stmt = stmt.where(e.channel == query.channel)
    if query.fingerprint_id:
        stmt = stmt.where(e.fingerprint_id == query.fingerprint_id)
    if query.recorded_after:
        stmt = stmt.where(e.recorded_at >= query.recorded_after)
    if query.recorded_before:
        stmt = stmt.where(e.recorded_at < query.recorded_before)
    if query.dispute == "none":
        stmt = stmt.where(~exists().where(Dispute.request_id == e.request_id))
    elif query.dispute == "any":
        stmt = stmt.where(exists().where(Dispute.request_id == e.request_id))
    elif query.dispute:
        stmt = stmt.where(exists().where(and_(Dispute.request_id == e.request_id,
                                              Dispute.state == query.dispute)))
    if query.by_request_id:
        if cursor:
            stmt = stmt.where(rid_c > str(_after(query, cursor)))
        stmt = stmt.order_by(rid_c)
    else:
        if cursor:
            last = _after(query, cursor)
            if not isinstance(last, int):
                raise BadRequest("this page link is not one the console made",
                                 code="bad_cursor")
            stmt = stmt.where(e.log_index < last)
        stmt = stmt.order_by(e.log_index.desc())
    rows = [dict(r._mapping) for r in session.execute(stmt.limit(limit + 1))]
    more = len(rows) > limit
    rows = rows[:limit]
    states = dispute_states(session, [r["request_id"] for r in rows])
    for r in rows:
        r["disputes"] = states.get(r["request_id"], [])
    nxt = None
    if more and rows:
        nxt = _cursor(query, rows[-1]["request_id"] if query.by_request_id
                      else rows[-1]["log_index"])
    return rows, nxt


def dispute_states(session: Session, request_ids: list[str]) -> dict[str, list[str]]:
    if not request_ids:
        return {}
    out: dict[str, list[str]] = {}
    for rid, state in session.execute(select(Dispute.request_id, Dispute.state).where(
            Dispute.request_id.in_(request_ids)).order_by(Dispute.opened_at)):
        out.setdefault(rid, []).append(state)
    return out


# --- one request ----------------------------------------------------------------------------

@dataclass
class Check:
    """One verification step as the page shows it."""

    name: str
    ok: bool | None                 # None: could not be checked (yet)
    detail: str


@dataclass
class RequestView:
    request_id: str
    log_index: int
    ingested_at: datetime
    dsse_sha256: str
    statement: dict[str, Any]
    keyids: list[str]
    integrity: dict[str, Any]
    fingerprint_id: str
    checks: list[Check] = field(default_factory=list)
    proof: dict[str, Any] | None = None
    disputes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def predicate(self) -> dict[str, Any]:
        return self.statement.get("predicate") or {}

    @property
    def verified(self) -> bool:
        """Every check holds (a witness quorum not reached yet is shown, not required)."""
        return all(c.ok is True for c in self.checks if c.name != "witnesses") and \
            not any(c.ok is False for c in self.checks)


def request_view(session: Session, settings: Settings, request_id: str) -> RequestView:
    row = session.execute(select(Envelope.dsse, Envelope.log_index, Envelope.ingested_at,
                                 Envelope.dsse_sha256, *[getattr(Envelope, n) for n in (
                                     "request_id", "recorded_at", "channel", "tier",
                                     "model_sha256", "model_name", "fingerprint_id",
                                     "prompt_tokens", "output_tokens", "keyids")]).where(
        Envelope.request_id == request_id)).first()
    if row is None:
        raise NotFound(f"no envelope with request_id {request_id!r}")
    from ledger.privacy.keys import kek_from_settings
    from ledger.services.envelopes import open_stored

    # sealed content opened with the KEK; an erased envelope is a 410 with its tombstone
    dsse_bytes = open_stored(session, bytes(row.dsse), {
        "dsse_sha256": bytes(row.dsse_sha256).hex(), "log_index": row.log_index,
        "request_id": row.request_id, "ingested_at": row.ingested_at},
        kek_from_settings(settings))
    digest = hashlib.sha256(dsse_bytes).hexdigest()
    columns = {**{k: v for k, v in row._mapping.items() if k not in (
        "dsse", "log_index", "ingested_at")}, "dsse_sha256": bytes(row.dsse_sha256).hex()}
    try:
        signed = views.open_signed(dsse_bytes)
        statement = signed.statement
        index = views.envelope_index(dsse_bytes)
        integrity = views.integrity(columns, index, views.ENVELOPE_INDEX_FIELDS)
    except views.SignedRecordError as exc:
        raise NotFound(f"the stored bytes of {request_id!r} do not parse: {exc}") from None
    view = RequestView(request_id, row.log_index, row.ingested_at, digest, statement,
                       list(signed.keyids), integrity, index["fingerprint_id"])
    view.checks, view.proof = verify_record(session, settings, "envelope", request_id,
                                            dsse_bytes, row.log_index, purpose="producer")
    view.disputes = [{"id": str(d.id), "state": d.state, "reason": d.reason,
                      "opened_at": d.opened_at, "opened_by": d.opened_by,
                      "verdict_id": d.verdict_id, "resolution": d.resolution}
                     for d in session.scalars(select(Dispute).where(
                         Dispute.request_id == request_id).order_by(Dispute.opened_at))]
    return view


def _trust(settings: Settings) -> Any:
    if settings.trust_policy_file is None:
        return None
    from ledger.core.trust import load_trust_policy

    return load_trust_policy(settings.trust_policy_file)


def _log_verifiers(session: Session, settings: Settings, trust: Any) -> tuple[list[Any], str]:
    from ledger.log.signer import log_verifiers, trusted_log_verifiers

    if trust is not None:
        return trusted_log_verifiers(trust, settings.log_name), \
            f"the trust policy's log keys ({settings.trust_policy_file.name})"  # type: ignore[union-attr]
    return log_verifiers(session, settings.log_name), \
        "log keys registered in this database (no trust policy is configured)"


def _witness_check(session: Session, trust: Any, tree_size: int) -> Check | None:
    """The trust policy's witnesses that cosigned this checkpoint (None: none configured).
    Witnessing lags the log, so a checkpoint below quorum is pending, not failed."""
    from ledger.core.cosignature import verified_witnesses
    from ledger.core.errors import LedgerError
    from ledger.log.witnessing import cosigned_note

    if trust is None or not trust.witnesses:
        return None
    try:
        names = verified_witnesses(cosigned_note(session, tree_size), trust.witnesses)
    except LedgerError as exc:  # a cosignature by a trusted witness that does not verify
        return Check("witnesses", False, str(exc))
    need = trust.quorum
    detail = (f"cosigned by {len(names)} of the policy's {len(trust.witnesses)} witnesses"
              + (f" ({', '.join(names)})" if names else "") + f"; quorum {need}")
    if need and len(names) < need:
        return Check("witnesses", None, detail + ": not yet (witnessing lags the log)")
    return Check("witnesses", True, detail)


def verify_record(session: Session, settings: Settings, kind: str, ref: str,
                  dsse_bytes: bytes, log_index: int | None, *,
                  purpose: str) -> tuple[list[Check], dict[str, Any] | None]:
    """The checks ``ledger verify`` makes offline, made here on the stored bytes."""
    from ledger.core import dsse, merkle
    from ledger.core.errors import LedgerError
    from ledger.core.logentry import log_entry_bytes
    from ledger.core.note import open_checkpoint
    from ledger.services.keys import load_keyring

    checks: list[Check] = []
    try:
        env = dsse.envelope_from_json(dsse_bytes)
        ring = load_keyring(session, [s.keyid for s in env.signatures], purpose=purpose)
        keyids = dsse.verify_envelope(env, ring.public_key_for)
        checks.append(Check("signature", True,
                            f"Ed25519 over DSSE PAE by {purpose} key(s) {', '.join(keyids)}"))
    except (LedgerError, ValueError) as exc:
        checks.append(Check("signature", False, str(exc)))
    if log_index is None:
        checks.append(Check("inclusion", None, "not sequenced into the log yet"))
        return checks, None
    entry = log_entry_bytes(kind, ref, hashlib.sha256(dsse_bytes).hexdigest())
    try:
        receipt = proofs.inclusion(session, log_index)
    except proofs.NotYetIntegrated as exc:
        session.rollback()
        checks.append(Check("inclusion", None, str(exc)))
        return checks, None
    except LedgerError as exc:
        checks.append(Check("inclusion", False, str(exc)))
        return checks, None
    checks.append(Check("log entry", receipt.entry == entry,
                        f"leaf {log_index} commits to SHA-256 of these bytes"
                        if receipt.entry == entry else
                        f"leaf {log_index} holds other bytes than this record's entry"))
    try:
        trust = _trust(settings)
        verifiers, source = _log_verifiers(session, settings, trust)
        cp = open_checkpoint(receipt.checkpoint.note, verifiers, origin=settings.log_name)
        cp_ok = cp.size == receipt.tree_size and cp.root_hash == receipt.checkpoint.root_hash
        checks.append(Check("checkpoint", cp_ok, f"signed checkpoint of size {cp.size}, "
                            f"verified with {source}" if cp_ok else
                            "the checkpoint's signed size or root differs from the stored one"))
        merkle.verify_inclusion(merkle.leaf_hash(entry), log_index, cp.size, receipt.proof,
                                cp.root_hash)
        checks.append(Check("inclusion", True, f"RFC 9162 inclusion proof of leaf {log_index} "
                            f"in the tree of size {cp.size} ({len(receipt.proof)} hashes)"))
        witnessed = _witness_check(session, trust, cp.size)
        if witnessed is not None:
            checks.append(witnessed)
    except (LedgerError, ValueError, OSError) as exc:
        checks.append(Check("inclusion", False, str(exc)))
    return checks, receipt.to_json()


# --- disputes --------------------------------------------------------------------------------

def dispute_queue(session: Session, state: str | None = None,
                  limit: int = 200) -> list[dict[str, Any]]:
    stmt = select(Dispute).order_by(Dispute.opened_at.desc()).limit(limit)
    if state == "open":
        stmt = stmt.where(Dispute.state != "resolved")
    elif state:
        stmt = stmt.where(Dispute.state == state)
    rows = session.scalars(stmt).all()
    verdicts = {v.verdict_id: v for v in session.execute(
        select(Verdict.verdict_id, Verdict.outcome, Verdict.tier).where(
            Verdict.verdict_id.in_([d.verdict_id for d in rows if d.verdict_id])))}
    out = []
    for d in rows:
        v = verdicts.get(d.verdict_id)
        out.append({"id": str(d.id), "request_id": d.request_id, "state": d.state,
                    "priority": d.priority, "reason": d.reason, "opened_by": d.opened_by,
                    "opened_at": d.opened_at, "resolution": d.resolution,
                    "outcome": v.outcome if v else None, "tier": v.tier if v else None,
                    "verdict_id": d.verdict_id})
    return out


_dispute = replay_queries.find_dispute


def dispute_view(session: Session, dispute_id: str) -> dict[str, Any]:
    """A dispute folded from its signed events, with its attempts and verdict."""
    d = _dispute(session, dispute_id)
    stored = session.scalars(select(DisputeEvent).where(DisputeEvent.dispute_id == d.id)
                             .order_by(DisputeEvent.seq)).all()
    events = views.served_events(
        (bytes(e.dsse), {"event_id": e.event_id, "dispute_id": e.dispute_id, "seq": e.seq,
                         "kind": e.kind, "actor": e.actor, "body": e.body, "at": e.at})
        for e in stored)
    derived = views.served_dispute(events, {
        "id": d.id, "request_id": d.request_id, "state": d.state,
        "state_reason": d.state_reason, "resolution": d.resolution,
        "resolution_note": d.resolution_note, "resolved_by": d.resolved_by,
        "resolved_at": d.resolved_at, "verdict_id": d.verdict_id})
    for ev, row in zip(events, stored, strict=True):
        ev["log_index"] = row.log_index
    attempts = session.scalars(select(JobAttempt).where(JobAttempt.job_id == d.job_id)
                               .order_by(JobAttempt.id)).all() if d.job_id else []
    timeline: list[dict[str, Any]] = [
        {"at": views.parse_time(e["at"]) if isinstance(e["at"], str) else e["at"],
         "what": "event", **e} for e in events]
    for a in attempts:
        timeline.append({"at": a.started_at, "what": "attempt", "kind": "attempt",
                         "attempt": a.attempt, "worker_id": a.worker_id,
                         "outcome": a.outcome, "detail": a.detail,
                         "finished_at": a.finished_at})
    timeline.sort(key=lambda t: (t["at"], 0 if t["what"] == "event" else 1))
    verdict = verdict_view(session, derived["verdict_id"]) if derived["verdict_id"] else None
    return {"id": str(d.id), "request_id": d.request_id, "reason": d.reason,
            "priority": d.priority, "opened_by": d.opened_by, "opened_at": d.opened_at,
            "fingerprint_id": d.fingerprint_id, "envelope_log_index": d.envelope_index,
            **derived, "timeline": timeline, "verdict": verdict}


def verdict_view(session: Session, verdict_id: str) -> dict[str, Any] | None:
    v = session.scalar(select(Verdict).where(Verdict.verdict_id == verdict_id))
    if v is None:
        return None
    signed = views.served_verdict(bytes(v.dsse), {
        "verdict_id": v.verdict_id, "request_id": v.request_id,
        "envelope_index": v.envelope_index, "outcome": v.outcome, "tier": v.tier,
        "worker_id": v.worker_id, "fingerprint_id": v.fingerprint_id, "details": v.details})
    return {**signed, "log_index": v.log_index, "created_at": v.created_at,
            "dsse": bytes(v.dsse)}


# --- the verdict diff -------------------------------------------------------------------------

@dataclass
class Step:
    index: int
    expected: int | None
    replayed: int | None
    expected_logprob: float | None
    replayed_logprob: float | None

    @property
    def same(self) -> bool:
        return self.expected == self.replayed

    @property
    def logprob_diff(self) -> float | None:
        if self.expected_logprob is None or self.replayed_logprob is None:
            return None
        return self.replayed_logprob - self.expected_logprob


def diff_steps(expected: dict[str, Any], replayed: dict[str, Any]) -> list[Step]:
    """Expected (recorded) and replayed outputs step by step."""
    et, rt = expected.get("token_ids") or [], replayed.get("token_ids") or []
    el, rl = expected.get("logprobs"), replayed.get("logprobs")

    def at(seq: list[Any] | None, i: int) -> Any:
        return seq[i] if seq is not None and i < len(seq) else None

    return [Step(i, at(et, i), at(rt, i), at(el, i), at(rl, i))
            for i in range(max(len(et), len(rt)))]


# --- re-verification ------------------------------------------------------------------------

def runs_with_drift(session: Session, kind: str | None = None,
                    limit: int = 200) -> list[dict[str, Any]]:
    """Runs newest first, each with its verdict counts and drift rate
    (diverged / (reproduced + diverged))."""
    stmt = select(ReverificationRun).order_by(ReverificationRun.created_at.desc()).limit(limit)
    if kind:
        stmt = stmt.where(ReverificationRun.kind == kind)
    runs = session.scalars(stmt).all()
    counts: dict[uuid.UUID, Counter[str]] = {r.id: Counter() for r in runs}
    if runs:
        for run_id, outcome, n in session.execute(
                select(ReplayJob.run_id, Verdict.outcome, func.count())
                .join(ReplayJob, ReplayJob.id == Verdict.job_id)
                .where(ReplayJob.run_id.in_(list(counts)))
                .group_by(ReplayJob.run_id, Verdict.outcome)):
            if run_id is not None:
                counts[run_id][outcome] = n
    out = []
    for r in runs:
        c = counts[r.id]
        judged = c["reproduced"] + c["diverged"]
        out.append({"id": str(r.id), "kind": r.kind, "created_at": r.created_at,
                    "window_start": r.window_start, "window_end": r.window_end,
                    "sampled": r.sampled, "details": r.details, "counts": dict(c),
                    "drift_rate": c["diverged"] / judged if judged else None})
    return out
