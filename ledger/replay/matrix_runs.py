"""Matrix runs in the ledger (no torch): sampling and checking the records a run replays.

The records of a matrix run are picked from the database by columns (model, channel),
a deterministic sample (``sha256(seed || request_id)`` order, as the fingerprint gate
samples), and then each is *checked* (:class:`ledger.replay.trusted.RecordChecker`: its
signature under a believed producer key, its inclusion in a checkpoint signed by a
believed log key) and its signed statement read again: a record that fails is listed in
the report with the reason and is not replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from ledger.core.envelope import EnvelopeStatement, Limits, parse_statement
from ledger.core.errors import LedgerError
from ledger.replay.trusted import CheckedRecord, RecordChecker, Unverifiable

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
