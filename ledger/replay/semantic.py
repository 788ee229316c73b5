"""Semantic pass rates: per (vendor, model alias), pooled over signed semantic verdicts.

A semantic verdict (``workers.semantic``) states how many of its N re-sampled answers
passed every assertion. Here those counts are pooled per (vendor fingerprint, model
alias): for one re-verification run (:func:`semantic_groups`, a section of the run's
report) and over time (:func:`pass_rate_series`, ``GET /v1/semantic/pass-rates``), with
the Wilson interval of the pooled rate. Values come from the verdicts' ``details``, which
``ledger audit`` checks against the signed bytes, and times from the signed
``replayed_at``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.core.assertions import wilson_interval
from ledger.core.vendor import vendor_fingerprint_id
from ledger.db.models import Envelope, Verdict

SEMANTIC = "semantic"


def _pool(details: Sequence[dict[str, Any]], outcomes: Sequence[str]) -> dict[str, Any]:
    n = sum(int(d["semantic"]["n"]) for d in details)
    passes = sum(int(d["semantic"]["passes"]) for d in details)
    confidence = min((float(d["semantic"]["interval"]["confidence"]) for d in details),
                     default=0.95)
    low, high = wilson_interval(passes, n, confidence)
    return {"records": len(details),
            "reproduced": sum(o == "reproduced" for o in outcomes),
            "diverged": sum(o == "diverged" for o in outcomes),
            "samples": n, "passes": passes, "pass_rate": passes / n if n else None,
            "interval": {"method": "wilson", "confidence": confidence,
                         "low": round(low, 6), "high": round(high, 6)},
            "records_with_drift": sum(bool((d.get("runtime_drift") or {}).get("changed"))
                                      for d in details)}


def _usable(details: Any) -> bool:
    sem = details.get("semantic") if isinstance(details, dict) else None
    return isinstance(sem, dict) and isinstance(sem.get("n"), int)


def semantic_groups(rows: Iterable[Any]) -> list[dict[str, Any]]:
    """Rows with ``tier``, ``outcome``, ``details``, ``recorded_fingerprint`` and
    ``model_name``: one pooled entry per (vendor fingerprint, model alias)."""
    groups: dict[tuple[str, str], list[tuple[dict[str, Any], str]]] = defaultdict(list)
    for row in rows:
        if row.tier == SEMANTIC and _usable(row.details):
            groups[(row.recorded_fingerprint, row.model_name)].append(
                (row.details, row.outcome))
    return [{"fingerprint_id": fp, "model_alias": alias,
             **_pool([d for d, _ in items], [o for _, o in items])}
            for (fp, alias), items in sorted(groups.items())]


def pass_rate_series(session: Session, *, vendor: str | None = None,
                     model_alias: str | None = None, bucket: Literal["day", "hour"] = "day",
                     since: datetime | None = None) -> list[dict[str, Any]]:
    """Pooled pass rates per (vendor fingerprint, model alias, time bucket of the signed
    ``replayed_at``), oldest first."""
    query = (select(Verdict.outcome, Verdict.details, Envelope.fingerprint_id,
                    Envelope.model_name)
             .join(Envelope, Envelope.log_index == Verdict.envelope_index)
             .where(Verdict.tier == SEMANTIC))
    if vendor is not None:
        query = query.where(Envelope.fingerprint_id == vendor_fingerprint_id(vendor))
    if model_alias is not None:
        query = query.where(Envelope.model_name == model_alias)
    width = 13 if bucket == "hour" else 10          # "2026-12-01T10" / "2026-12-01"
    groups: dict[tuple[str, str, str], list[tuple[dict[str, Any], str]]] = defaultdict(list)
    for outcome, details, fp, alias in session.execute(query):
        if not _usable(details):
            continue
        try:
            at = datetime.fromisoformat(str(details["replayed_at"]))
        except (KeyError, ValueError):
            continue
        if since is not None and at < since:
            continue
        groups[(fp, alias, at.isoformat()[:width])].append((details, outcome))
    return [{"fingerprint_id": fp, "model_alias": alias, "bucket": when,
             **_pool([d for d, _ in items], [o for _, o in items])}
            for (fp, alias, when), items in sorted(groups.items(), key=lambda kv: (
                kv[0][2], kv[0][0], kv[0][1]))]
