"""Envelope ingest: verify over the exact bytes, validate, then sequence and store.

Sequencing: every accepted envelope gets the next log index. The ``log_state`` row is
locked (``FOR UPDATE``) for the short storing step, so concurrent ingest from any number
of API processes yields a gap-free, duplicate-free index sequence; a rolled-back
transaction rolls its indices back with it. Duplicate detection runs under the same lock,
so the ``request_id`` unique constraint is never what settles a race.

Batch atomicity: each item is verified and validated on its own; by default the valid
items of a batch are stored together in one transaction and invalid ones are reported per
item. With ``atomic=True`` a single invalid item rejects the whole batch and nothing is
written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy.orm import Session

from ledger.core import dsse
from ledger.core.envelope import IndexFields, Limits, index_fields, parse_statement
from ledger.core.errors import LedgerError, ValidationFailed
from ledger.services import sequencer
from ledger.services.keys import KeyRing, load_keyring
from ledger.settings import Settings

MAX_CLOCK_SKEW = timedelta(minutes=10)


@dataclass(slots=True)
class Prepared:
    """A verified, validated envelope ready to store."""

    dsse_bytes: bytes
    dsse_sha256: bytes
    keyids: list[str]
    fields: IndexFields
    runtime: dict[str, Any]


@dataclass(slots=True)
class ItemResult:
    position: int
    status: int                     # 201 created, 200 existing, 409 conflict, 4xx rejected
    request_id: str | None = None
    log_index: int | None = None
    dsse_sha256: str | None = None
    fingerprint_id: str | None = None
    error: LedgerError | None = None
    existing_dsse_sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def outcome(self) -> str:
        return {201: "created", 200: "existing", 409: "conflict"}.get(self.status, "rejected")


def limits_from(settings: Settings) -> Limits:
    return Limits(max_prompt_tokens=settings.max_prompt_tokens,
                  max_output_tokens=settings.max_output_tokens,
                  max_token_id=settings.max_token_id,
                  max_top_logprobs=settings.max_top_logprobs)


def prepare(env: dsse.Envelope, keyring: KeyRing, limits: Limits, now: datetime) -> Prepared:
    """Signature first (over the payload bytes as received), then parse and validate."""
    keyids = dsse.verify_envelope(env, keyring.public_key_for)
    statement = parse_statement(env.payload, limits)
    fields = index_fields(statement)
    if fields.recorded_at > now + MAX_CLOCK_SKEW:
        raise ValidationFailed(
            f"recorded_at {fields.recorded_at.isoformat()} is in the future",
            code="recorded_in_future")
    dsse_bytes = env.canonical_bytes()
    digest = hashlib.sha256(dsse_bytes).digest()
    runtime = statement.predicate.runtime.model_dump(mode="json")
    return Prepared(dsse_bytes, digest, keyids, fields, runtime)


def decode_items(raw_items: Sequence[Any], settings: Settings,
                 session: Session) -> tuple[list[Prepared | None], list[ItemResult]]:
    """Verify and validate every item. Returns prepared items and, for failures, results."""
    limits = limits_from(settings)
    envs: list[dsse.Envelope | LedgerError] = []
    for raw in raw_items:
        try:
            if isinstance(raw, (bytes, bytearray)):
                envs.append(dsse.envelope_from_json(bytes(raw),
                                                    max_bytes=settings.max_envelope_bytes))
            else:
                envs.append(dsse.envelope_from_obj(raw))
        except LedgerError as exc:
            envs.append(exc)
    keyids = {s.keyid for e in envs if isinstance(e, dsse.Envelope) for s in e.signatures}
    keyring = load_keyring(session, keyids, purpose="producer")
    now = datetime.now(UTC)
    prepared: list[Prepared | None] = []
    failures: list[ItemResult] = []
    for pos, env in enumerate(envs):
        if isinstance(env, LedgerError):
            prepared.append(None)
            failures.append(ItemResult(pos, _status_of(env), error=env))
            continue
        try:
            prepared.append(prepare(env, keyring, limits, now))
        except LedgerError as exc:
            prepared.append(None)
            failures.append(ItemResult(pos, _status_of(exc), error=exc))
    return prepared, failures


def _status_of(exc: LedgerError) -> int:
    from ledger.problems import status_for  # local: problems imports services for types

    return status_for(exc)


def store(session: Session, prepared: Sequence[Prepared | None]) -> list[ItemResult | None]:
    """Sequence and store; one result per position (None where the item was not prepared)."""
    results: list[ItemResult | None] = [None] * len(prepared)
    todo = [(pos, p) for pos, p in enumerate(prepared) if p is not None]
    if not todo:
        return results
    conn = session.connection().connection.driver_connection
    assert conn is not None
    with conn.cursor() as cur:
        size = sequencer.lock(cur)
        cur.execute(
            "SELECT request_id, dsse_sha256, log_index, fingerprint_id FROM envelopes "
            "WHERE request_id = ANY(%s)",
            ([p.fields.request_id for _, p in todo],),
        )
        known: dict[str, tuple[bytes, int, str]] = {
            r[0]: (bytes(r[1]), r[2], r[3]) for r in cur.fetchall()}
        new_rows: list[tuple[int, Prepared]] = []
        for pos, p in todo:
            rid = p.fields.request_id
            prior = known.get(rid)
            if prior is None:
                idx = size + len(new_rows)
                new_rows.append((idx, p))
                known[rid] = (p.dsse_sha256, idx, p.fields.fingerprint_id)
                results[pos] = ItemResult(pos, 201, rid, idx, p.dsse_sha256.hex(),
                                          p.fields.fingerprint_id)
            elif prior[0] == p.dsse_sha256:
                results[pos] = ItemResult(pos, 200, rid, prior[1], p.dsse_sha256.hex(), prior[2])
            else:
                results[pos] = ItemResult(pos, 409, rid, prior[1], p.dsse_sha256.hex(),
                                          existing_dsse_sha256=prior[0].hex())
        if new_rows:
            sequencer.append(cur, size, [("envelope", p.fields.request_id, p.dsse_sha256.hex())
                                         for _, p in new_rows])
            with cur.copy(
                "COPY envelopes (log_index, request_id, dsse, dsse_sha256, keyids, model_sha256,"
                " model_name, fingerprint_id, channel, tier, recorded_at, prompt_tokens,"
                " output_tokens) FROM STDIN (FORMAT BINARY)"
            ) as copy:
                copy.set_types(["int8", "text", "bytea", "bytea", "text[]", "text", "text",
                                "text", "text", "text", "timestamptz", "int4", "int4"])
                for idx, p in new_rows:
                    f = p.fields
                    copy.write_row((idx, f.request_id, p.dsse_bytes, p.dsse_sha256, p.keyids,
                                    f.model_sha256, f.model_name, f.fingerprint_id, f.channel,
                                    f.tier, f.recorded_at, f.prompt_tokens, f.output_tokens))
            fingerprints = {p.fields.fingerprint_id: p.runtime for _, p in new_rows}
            cur.executemany(
                "INSERT INTO fingerprints (fingerprint_id, runtime) VALUES (%s, %s) "
                "ON CONFLICT (fingerprint_id) DO NOTHING",
                [(fp, Jsonb(rt)) for fp, rt in sorted(fingerprints.items())])
    return results


def ingest(session: Session, raw_items: Sequence[Any], settings: Settings, *,
           atomic: bool = False) -> list[ItemResult]:
    """Verify, validate, sequence and store. The caller commits."""
    prepared, failures = decode_items(raw_items, settings, session)
    if failures and atomic:
        for f in failures:
            f.extra["atomic"] = True
        return _merge(len(raw_items), failures, [None] * len(raw_items), abort=True)
    stored = store(session, prepared)
    return _merge(len(raw_items), failures, stored, abort=False)


def _merge(n: int, failures: list[ItemResult], stored: list[ItemResult | None], *,
           abort: bool) -> list[ItemResult]:
    out: list[ItemResult | None] = list(stored)
    for f in failures:
        out[f.position] = f
    if abort:
        for pos in range(n):
            if out[pos] is None:
                out[pos] = ItemResult(pos, 424, extra={"reason": "another item failed"})
    return [r for r in out if r is not None]
