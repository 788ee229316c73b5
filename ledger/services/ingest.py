"""Envelope ingest: verify over the exact bytes, validate, then sequence and store.

Sequencing: every accepted envelope gets the next log index. The ``log_state`` row is
locked (``FOR UPDATE``) for the short storing step, so concurrent ingest from any number
of API processes yields a gap-free, duplicate-free index sequence; a rolled-back
transaction rolls its indices back with it. Duplicate detection runs under the same lock,
so the ``request_id`` unique constraint is never what settles a race.

One set of limits for every item: an envelope in a batch is held to exactly what a single
envelope is (``max_envelope_bytes`` over its stored bytes, the token limits, canonical
base64, the ``recorded_at`` window), so a batch is never a way around a limit.

Batch atomicity: each item is verified, validated and classified (new, existing,
conflict) before anything is written. By default the new items of a batch are stored
together in one transaction and failed ones (conflicts included) are reported per item.
With ``atomic=True`` a single failed item, a ``request_id`` conflict included, rejects the
whole batch: :func:`ingest_batch` then writes nothing and says so
(:attr:`BatchOutcome.REJECTED`), and the caller rolls back instead of committing.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import select
from sqlalchemy.orm import Session

from ledger.core import dsse
from ledger.core.envelope import IndexFields, Limits, index_fields, parse_statement, runtime_of
from ledger.core.errors import FormatError, LedgerError, ValidationFailed
from ledger.db.models import SigningKey
from ledger.db.session import raw_cursor
from ledger.privacy import keys as privacy_keys
from ledger.services import sequencer
from ledger.services.keys import KeyRing, load_keyring
from ledger.settings import Settings

#: Tolerated difference between the gateway's clock and the ledger's, both ways: a
#: ``recorded_at`` may lie this far in the future, or this far before its key's
#: ``not_before``.
MAX_CLOCK_SKEW = timedelta(minutes=10)


class BatchOutcome(StrEnum):
    STORED = "stored"        # every new item was written (failed ones reported per item)
    REJECTED = "rejected"    # atomic batch with a failed item: nothing was written


@dataclass(slots=True)
class Prepared:
    """A verified, validated envelope ready to store."""

    dsse_bytes: bytes
    dsse_sha256: bytes
    keyids: list[str]
    fields: IndexFields
    runtime: dict[str, Any]


class ItemOutcome(StrEnum):
    CREATED = "created"      # stored now, with a new log index
    EXISTING = "existing"    # stored before with these very bytes
    CONFLICT = "conflict"    # the request_id is stored with other bytes
    REJECTED = "rejected"    # did not verify or validate (``error`` says why)
    ABORTED = "aborted"      # valid, but not stored: another item of an atomic batch failed


#: The codes results carried before they had outcomes, kept for callers that read
#: :attr:`ItemResult.status`; the API maps outcomes (and a rejection's error) itself.
_LEGACY_STATUS = {ItemOutcome.CREATED: 201, ItemOutcome.EXISTING: 200,
                  ItemOutcome.CONFLICT: 409, ItemOutcome.ABORTED: 424}


@dataclass(slots=True)
class ItemResult:
    position: int
    outcome: ItemOutcome
    request_id: str | None = None
    log_index: int | None = None
    dsse_sha256: str | None = None
    fingerprint_id: str | None = None
    error: LedgerError | None = None
    existing_dsse_sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> int:
        """Compatibility: 201, 200, 409 or 424 as before; 400 for any rejection (the API
        serves a rejection with its error's own status)."""
        return _LEGACY_STATUS.get(self.outcome, 400)

    @property
    def stored(self) -> bool:
        return self.outcome in (ItemOutcome.CREATED, ItemOutcome.EXISTING)

    @property
    def failed(self) -> bool:
        """A conflict or a rejection (an aborted item, "not stored because another item
        failed", is not a failure of this item)."""
        return self.outcome in (ItemOutcome.CONFLICT, ItemOutcome.REJECTED)


@dataclass(slots=True)
class IngestReport:
    results: list[ItemResult]
    outcome: BatchOutcome

    @property
    def failed(self) -> list[ItemResult]:
        return [r for r in self.results if r.failed]


def limits_from(settings: Settings) -> Limits:
    return Limits(max_prompt_tokens=settings.max_prompt_tokens,
                  max_output_tokens=settings.max_output_tokens,
                  max_token_id=settings.max_token_id,
                  max_top_logprobs=settings.max_top_logprobs)


def check_canonical_base64(env: dsse.Envelope) -> None:
    """Refuse base64 text that is not the one canonical encoding of its bytes.

    Standard base64 decoders ignore the unused low bits of the last character, so one
    payload or signature has several texts (``QQ==`` and ``QR==`` are both ``A``). The
    ledger stores the text as received and hashes it into ``dsse_sha256``; accepting a
    second text would give the same signed content a second digest (a 409 against its own
    stored copy, or two "different" envelopes). Every encoder writes the canonical form
    (RFC 4648 section 3.5: pad bits zero), so only a hand-made text is refused.
    """
    if base64.b64encode(env.payload).decode("ascii") != env.payload_b64:
        raise FormatError("DSSE payload is not canonical base64 (RFC 4648 3.5: the pad bits "
                          "of the last character must be zero)", code="non_canonical_base64")
    for i, s in enumerate(env.signatures):
        if base64.b64encode(s.sig).decode("ascii") != s.sig_b64:
            raise FormatError(f"DSSE signatures[{i}].sig is not canonical base64 (RFC 4648 "
                              "3.5)", code="non_canonical_base64")


def prepare(env: dsse.Envelope, keyring: KeyRing, limits: Limits, now: datetime,
            not_before: dict[str, datetime] | None = None) -> Prepared:
    """Signature first (over the payload bytes as received), then parse and validate.

    ``not_before``: keyid -> the key's ``not_before``; ``recorded_at`` may not be earlier
    (less :data:`MAX_CLOCK_SKEW`) than that of any key that signed it: a key registered
    today does not vouch for a record dated years ago (register the key with an earlier
    ``not_before`` to backfill)."""
    keyids = dsse.verify_envelope(env, keyring.public_key_for)
    statement = parse_statement(env.payload, limits)
    fields = index_fields(statement)
    if fields.recorded_at > now + MAX_CLOCK_SKEW:
        raise ValidationFailed(
            f"recorded_at {fields.recorded_at.isoformat()} is in the future",
            code="recorded_in_future")
    for kid in keyids:
        start = (not_before or {}).get(kid)
        if start is not None and fields.recorded_at < start - MAX_CLOCK_SKEW:
            raise ValidationFailed(
                f"recorded_at {fields.recorded_at.isoformat()} is before signing key {kid} "
                f"became valid ({start.isoformat()})", code="recorded_before_key_valid")
    dsse_bytes = env.canonical_bytes()
    digest = hashlib.sha256(dsse_bytes).digest()
    runtime = runtime_of(statement)
    return Prepared(dsse_bytes, digest, keyids, fields, runtime)


def _envelope(raw: Any, max_bytes: int) -> dsse.Envelope:
    """One item, raw JSON bytes or an already parsed object, decoded and held to the
    single-envelope byte limit over the bytes it would be stored as."""
    if isinstance(raw, (bytes, bytearray)):
        env = dsse.envelope_from_json(bytes(raw), max_bytes=max_bytes)
    else:
        env = dsse.envelope_from_obj(raw)
    size = len(env.canonical_bytes())
    if size > max_bytes:
        raise ValidationFailed(f"envelope is {size} bytes; the limit is {max_bytes}",
                               code="too_large")
    check_canonical_base64(env)
    return env


def _not_before(session: Session, keyids: set[str]) -> dict[str, datetime]:
    if not keyids:
        return {}
    rows = session.execute(select(SigningKey.keyid, SigningKey.not_before).where(
        SigningKey.keyid.in_(sorted(keyids)))).all()
    return {kid: nb for kid, nb in rows}


def decode_items(raw_items: Sequence[Any], settings: Settings,
                 session: Session) -> tuple[list[Prepared | None], list[ItemResult]]:
    """Verify and validate every item. Returns prepared items and, for failures, results."""
    limits = limits_from(settings)
    envs: list[dsse.Envelope | LedgerError] = []
    for raw in raw_items:
        try:
            envs.append(_envelope(raw, settings.max_envelope_bytes))
        except LedgerError as exc:
            envs.append(exc)
    keyids = {s.keyid for e in envs if isinstance(e, dsse.Envelope) for s in e.signatures}
    keyring = load_keyring(session, keyids, purpose="producer")
    not_before = _not_before(session, keyids)
    now = datetime.now(UTC)
    prepared: list[Prepared | None] = []
    failures: list[ItemResult] = []
    for pos, env in enumerate(envs):
        if isinstance(env, LedgerError):
            prepared.append(None)
            failures.append(ItemResult(pos, ItemOutcome.REJECTED, error=env))
            continue
        try:
            prepared.append(prepare(env, keyring, limits, now, not_before))
        except LedgerError as exc:
            prepared.append(None)
            failures.append(ItemResult(pos, ItemOutcome.REJECTED, error=exc))
    return prepared, failures


def _classify(cur: Any, size: int, prepared: Sequence[Prepared | None]
              ) -> tuple[list[ItemResult | None], list[tuple[int, Prepared]]]:
    """Under the sequencer lock, read only: each prepared item is new (with the index
    it will get), existing (same bytes) or a conflict (other bytes)."""
    results: list[ItemResult | None] = [None] * len(prepared)
    todo = [(pos, p) for pos, p in enumerate(prepared) if p is not None]
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
            results[pos] = ItemResult(pos, ItemOutcome.CREATED, rid, idx, p.dsse_sha256.hex(),
                                      p.fields.fingerprint_id)
        elif prior[0] == p.dsse_sha256:
            results[pos] = ItemResult(pos, ItemOutcome.EXISTING, rid, prior[1],
                                      p.dsse_sha256.hex(), prior[2])
        else:
            results[pos] = ItemResult(pos, ItemOutcome.CONFLICT, rid, prior[1],
                                      p.dsse_sha256.hex(),
                                      existing_dsse_sha256=prior[0].hex())
    return results, new_rows


def _stored_bytes(cur: Any, settings: Settings | None,
                  new_rows: list[tuple[int, Prepared]]) -> list[bytes]:
    """What goes into ``envelopes.dsse``: the DSSE bytes, sealed under each record's data
    key when a KEK is configured (:mod:`ledger.privacy.keys`; the leaf still commits to
    the DSSE bytes' SHA-256)."""
    kek = privacy_keys.kek_from_settings(settings) if settings is not None else None
    if kek is None:
        return [p.dsse_bytes for _, p in new_rows]
    return privacy_keys.seal_rows(cur, kek, [
        (privacy_keys.scope_of(p.fields.data_subject, p.fields.channel,
                               p.fields.model_sha256, p.fields.recorded_at),
         p.dsse_bytes, p.dsse_sha256) for _, p in new_rows])


def _write(cur: Any, size: int, new_rows: list[tuple[int, Prepared]],
           settings: Settings | None = None) -> None:
    stored = _stored_bytes(cur, settings, new_rows)
    sequencer.append(cur, size, [("envelope", p.fields.request_id, p.dsse_sha256.hex())
                                 for _, p in new_rows])
    with cur.copy(
        "COPY envelopes (log_index, request_id, dsse, dsse_sha256, keyids, model_sha256,"
        " model_name, fingerprint_id, channel, tier, recorded_at, prompt_tokens,"
        " output_tokens) FROM STDIN (FORMAT BINARY)"
    ) as copy:
        copy.set_types(["int8", "text", "bytea", "bytea", "text[]", "text", "text",
                        "text", "text", "text", "timestamptz", "int4", "int4"])
        for (idx, p), content in zip(new_rows, stored, strict=True):
            f = p.fields
            copy.write_row((idx, f.request_id, content, p.dsse_sha256, p.keyids,
                            f.model_sha256, f.model_name, f.fingerprint_id, f.channel,
                            f.tier, f.recorded_at, f.prompt_tokens, f.output_tokens))
    fingerprints = {p.fields.fingerprint_id: p.runtime for _, p in new_rows}
    cur.executemany(
        "INSERT INTO fingerprints (fingerprint_id, runtime) VALUES (%s, %s) "
        "ON CONFLICT (fingerprint_id) DO NOTHING",
        [(fp, Jsonb(rt)) for fp, rt in sorted(fingerprints.items())])


def ingest_batch(session: Session, raw_items: Sequence[Any], settings: Settings, *,
                 atomic: bool = False) -> IngestReport:
    """Verify, validate and classify every item, then (unless an atomic batch has a failed
    item) sequence and store the new ones. Flushes only: the caller commits when the
    outcome is STORED and rolls back when it is REJECTED (nothing was written then)."""
    n = len(raw_items)
    prepared, failures = decode_items(raw_items, settings, session)
    results: list[ItemResult | None] = [None] * n
    new_rows: list[tuple[int, Prepared]] = []
    with raw_cursor(session) as cur:
        if any(p is not None for p in prepared):
            size = sequencer.lock(cur)
            results, new_rows = _classify(cur, size, prepared)
        for f in failures:
            results[f.position] = f
        failed = [r for r in results if r is not None and r.failed]
        if atomic and failed:  # every failed item named, conflicts included; nothing written
            return _rejected(n, failed)
        if new_rows:
            _write(cur, size, new_rows, settings)
    return IngestReport([r for r in results if r is not None], BatchOutcome.STORED)


def ingest(session: Session, raw_items: Sequence[Any], settings: Settings, *,
           atomic: bool = False) -> list[ItemResult]:
    """:func:`ingest_batch`'s results (for callers that only ingest valid items)."""
    return ingest_batch(session, raw_items, settings, atomic=atomic).results


def _rejected(n: int, failures: list[ItemResult]) -> IngestReport:
    out: list[ItemResult] = [ItemResult(pos, ItemOutcome.ABORTED,
                                                     extra={"reason": "another item failed"})
                             for pos in range(n)]
    for f in failures:
        f.extra["atomic"] = True
        out[f.position] = f
    return IngestReport(out, BatchOutcome.REJECTED)
