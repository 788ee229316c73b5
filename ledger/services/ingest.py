"""Envelope ingest: verify over the exact bytes, validate, then sequence and store.

Sequencing: every accepted envelope gets the next log index. Items are classified (new,
existing, conflict) by one read, then the new ones are sequenced and stored by one
statement (:mod:`ledger.services.sequencer`) whose ``log_state`` update serialises index
assignment, so concurrent ingest from any number of API processes yields a gap-free,
duplicate-free index sequence, and a failed statement stores and sequences nothing. A
request_id stored by another process between the read and the statement makes the
statement fail on the ``request_id`` unique constraint; the items are then classified
again (the repeat is "existing" or a conflict), so idempotency never rests on timing. In
the API, concurrent requests of one process share that statement (:class:`GroupCommit`).

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
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import orjson
import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from ledger.core import dsse
from ledger.core.envelope import IndexFields, Limits, index_fields, parse_statement, runtime_of
from ledger.core.errors import FormatError, LedgerError, ValidationFailed
from ledger.core.sealing import KeyEncryptionKey
from ledger.db.arrays import ByteaArray, TextArray, TimestamptzArray
from ledger.db.session import raw_cursor
from ledger.log.store import SequenceRefused
from ledger.privacy import keys as privacy_keys
from ledger.services import credentials, sequencer
from ledger.services.credentials import NotRemembered, Remembered, StaleCredentials, stale
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
    if not _canonical_b64(env.payload_b64, env.payload):
        raise FormatError("DSSE payload is not canonical base64 (RFC 4648 3.5: the pad bits "
                          "of the last character must be zero)", code="non_canonical_base64")
    for i, s in enumerate(env.signatures):
        if not _canonical_b64(s.sig_b64, s.sig):
            raise FormatError(f"DSSE signatures[{i}].sig is not canonical base64 (RFC 4648 "
                              "3.5)", code="non_canonical_base64")


def _canonical_b64(text: str, data: bytes) -> bool:
    """Whether ``text`` (which strict decoding turned into ``data``) is the canonical
    encoding of ``data``. Strict decoding leaves one freedom only, the unused bits of the
    last group, so comparing that group is enough (the whole text need not be encoded
    again: a payload is kilobytes)."""
    tail = len(data) % 3 or 3
    return text[-4:] == base64.b64encode(data[-tail:]).decode("ascii") if data else text == ""


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
    digest = _sha256_held(dsse_bytes)
    runtime = runtime_of(statement)
    return Prepared(dsse_bytes, digest, keyids, fields, runtime)


#: hashlib releases the GIL for an update of 2048 bytes or more (HASHLIB_GIL_MINSIZE)
_HELD_CHUNK = 2047


def _sha256_held(data: bytes) -> bytes:
    """SHA-256 of ``data`` fed in pieces hashlib hashes without releasing the GIL: for an
    18 KB envelope that is ~15 us of hashing, and giving the GIL away for it cost a
    busy API process a wait to take it back (two context switches, ~20 us each on the
    VM: ``voluntary_ctxt_switches`` per POST, with :func:`ledger.core.keys.
    _crypto_sign_open`, 28 -> 24)."""
    h = hashlib.sha256()
    view = memoryview(data)
    for at in range(0, len(view), _HELD_CHUNK):
        h.update(view[at:at + _HELD_CHUNK])
    return h.digest()


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


#: Loads the producer keys of the given key IDs (:func:`ledger.services.keys.load_keyring`
#: over a session, or :func:`~ledger.services.keys.load_keyring_reads`).
KeyLoader = Callable[[Iterable[str]], KeyRing]


def decode_items(raw_items: Sequence[Any], settings: Settings,
                 keys: Session | KeyLoader) -> tuple[list[Prepared | None], list[ItemResult]]:
    """Verify and validate every item. Returns prepared items and, for failures, results.
    ``keys``: a session to read the producer keys in, or a :data:`KeyLoader`."""
    limits = limits_from(settings)
    envs: list[dsse.Envelope | LedgerError] = []
    for raw in raw_items:
        try:
            envs.append(_envelope(raw, settings.max_envelope_bytes))
        except LedgerError as exc:
            envs.append(exc)
    keyids = {s.keyid for e in envs if isinstance(e, dsse.Envelope) for s in e.signatures}
    keyring = load_keyring(keys, keyids, purpose="producer") if isinstance(keys, Session) \
        else keys(keyids)
    not_before = keyring.not_before()
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


@dataclass(slots=True)
class Group:
    """One request's items on their way to storage: the prepared ones (None where an item
    failed to decode, verify or validate; ``failures`` says why) and the batch's mode."""

    prepared: list[Prepared | None]
    failures: list[ItemResult]
    atomic: bool
    report: IngestReport | None = None
    #: the keys it was admitted with from memory, checked before it is stored
    #: (:mod:`ledger.services.credentials`); None: read fresh for this request
    remembered: Remembered | None = None

    @property
    def has_items(self) -> bool:
        """Anything to classify against storage (an atomic batch with an item that failed
        already is still classified: its rejection names every failed item, conflicts
        too)."""
        return any(p is not None for p in self.prepared)


@dataclass(slots=True)
class _Known:
    dsse_sha256: bytes
    fingerprint_id: str
    log_index: int | None = None     # stored before
    slot: int | None = None          # or new in this statement: its place in it


def _plan(cur: Any, groups: Sequence[Group], *, look_up: bool = True
          ) -> tuple[list[Prepared], list[tuple[ItemResult, int]]]:
    """Classify every group's items, in order, against storage (unless ``look_up`` is
    off: every request_id is then taken for new) and against the earlier items of the
    same statement: new (a slot in the statement), existing (same bytes) or a conflict
    (other bytes). Sets each group's report; returns the new items in slot order and the
    results whose log index is ``start + slot`` once the statement ran."""
    known: dict[str, _Known] = {}
    if look_up:
        ids = sorted({p.fields.request_id for g in groups for p in g.prepared
                      if p is not None})
        cur.execute("SELECT request_id, dsse_sha256, log_index, fingerprint_id FROM envelopes "
                    "WHERE request_id = ANY(%s)", (ids,))
        known = {r[0]: _Known(bytes(r[1]), r[3], log_index=r[2]) for r in cur.fetchall()}
    new: list[Prepared] = []
    pending: list[tuple[ItemResult, int]] = []
    for g in groups:
        results: list[ItemResult | None] = [None] * len(g.prepared)
        for f in g.failures:
            results[f.position] = f
        mine: dict[str, _Known] = {}
        my_new: list[Prepared] = []
        my_pending: list[tuple[ItemResult, int]] = []
        for pos, p in enumerate(g.prepared):
            if p is None:
                continue
            rid, digest = p.fields.request_id, p.dsse_sha256
            prior = mine.get(rid) or known.get(rid)
            if prior is None:
                slot = len(new) + len(my_new)
                my_new.append(p)
                mine[rid] = prior = _Known(digest, p.fields.fingerprint_id, slot=slot)
                outcome = ItemOutcome.CREATED
            else:
                outcome = ItemOutcome.EXISTING if prior.dsse_sha256 == digest \
                    else ItemOutcome.CONFLICT
            r = results[pos] = ItemResult(pos, outcome, rid, prior.log_index, digest.hex())
            if outcome is ItemOutcome.CONFLICT:
                r.existing_dsse_sha256 = prior.dsse_sha256.hex()
            else:
                r.fingerprint_id = prior.fingerprint_id
            if prior.slot is not None:
                my_pending.append((r, prior.slot))
        failed = [r for r in results if r is not None and r.failed]
        if g.atomic and failed:  # every failed item named, conflicts included; nothing stored
            g.report = _rejected(len(g.prepared), failed)
            continue
        known.update(mine)
        new += my_new
        pending += my_pending
        g.report = IngestReport([r for r in results if r is not None], BatchOutcome.STORED)
    return new, pending


#: The envelopes (and their fingerprints) stored by the sequencing statement; the
#: fingerprints wait for ``seq`` (the one-time filter), so the sequencer lock is always the
#: first thing the statement takes.
_STORE_ENVELOPES = """, stored AS (
  INSERT INTO envelopes (log_index, request_id, dsse, dsse_sha256, keyids, model_sha256,
                         model_name, fingerprint_id, channel, tier, recorded_at,
                         prompt_tokens, output_tokens)
  SELECT seq.start + e.ord - 1, e.request_id, e.dsse, e.dsse_sha256,
         string_to_array(e.keyids, ','), e.model_sha256, e.model_name, e.fingerprint_id,
         e.channel, e.tier, e.recorded_at, e.prompt_tokens, e.output_tokens
  FROM seq, unnest(%(request_id)b::text[], %(dsse)b::bytea[], %(dsse_sha256)b::bytea[],
                   %(keyids)b::text[], %(model_sha256)b::text[], %(model_name)s::text[],
                   %(fingerprint_id)b::text[], %(channel)b::text[], %(tier)b::text[],
                   %(recorded_at)b::timestamptz[], %(prompt_tokens)s::int4[],
                   %(output_tokens)s::int4[])
       WITH ORDINALITY AS e(request_id, dsse, dsse_sha256, keyids, model_sha256, model_name,
                            fingerprint_id, channel, tier, recorded_at, prompt_tokens,
                            output_tokens, ord)
), fingerprinted AS (
  INSERT INTO fingerprints (fingerprint_id, runtime)
  SELECT f.fingerprint_id, f.runtime::jsonb
  FROM unnest(%(fp_id)b::text[], %(fp_runtime)b::text[]) AS f(fingerprint_id, runtime)
  WHERE (SELECT start FROM seq) IS NOT NULL
  ON CONFLICT (fingerprint_id) DO NOTHING
)"""


def _stored_bytes(cur: Any, kek: KeyEncryptionKey | None,
                  new: Sequence[Prepared]) -> list[bytes]:
    """What goes into ``envelopes.dsse``: the DSSE bytes, sealed under each record's data
    key when a KEK is configured (:mod:`ledger.privacy.keys`; the leaf still commits to
    the DSSE bytes' SHA-256)."""
    if kek is None:
        return [p.dsse_bytes for p in new]
    return privacy_keys.seal_rows(cur, kek, [
        (privacy_keys.scope_of(p.fields.data_subject, p.fields.channel,
                               p.fields.model_sha256, p.fields.recorded_at),
         p.dsse_bytes, p.dsse_sha256) for p in new])


def _write(cur: Any, new: Sequence[Prepared], settings: Settings | None = None,
           remembered: Sequence[Remembered] = ()) -> int:
    """Sequence and store ``new`` in one statement; returns the first log index. With
    ``remembered`` credentials the statement stores nothing unless they are as remembered
    (:data:`ledger.services.credentials.GUARD`; :class:`~ledger.log.store.SequenceRefused`).

    With a KEK the data keys are taken ``FOR SHARE`` (an erasure cannot destroy a key
    between sealing and storing) inside the caller's transaction, after the sequencer lock,
    in the order erasure takes them (``ledger.privacy.erasure``): that path holds the lock
    for a few statements."""
    kek = privacy_keys.kek_from_settings(settings) if settings is not None else None
    if kek is not None:
        sequencer.lock(cur)
    stored = _stored_bytes(cur, kek, new)
    fields = [p.fields for p in new]
    fingerprints = {p.fields.fingerprint_id: p.runtime for p in new}
    # Typed arrays (ledger.db.arrays) for the values validation already held to a pattern,
    # an enum or a type, and our own JSON (orjson escapes a NUL); the model name (free
    # text) and the token counts are adapted by psycopg as before.
    params = {
        "request_id": TextArray(f.request_id for f in fields), "dsse": ByteaArray(stored),
        "dsse_sha256": ByteaArray(p.dsse_sha256 for p in new),
        # 64-hex each (dsse.py): no commas
        "keyids": TextArray(",".join(p.keyids) for p in new),
        "model_sha256": TextArray(f.model_sha256 for f in fields),
        "model_name": [f.model_name for f in fields],
        "fingerprint_id": TextArray(f.fingerprint_id for f in fields),
        "channel": TextArray(f.channel for f in fields),
        "tier": TextArray(f.tier for f in fields),
        "recorded_at": TimestamptzArray(f.recorded_at for f in fields),
        "prompt_tokens": [f.prompt_tokens for f in fields],
        "output_tokens": [f.output_tokens for f in fields],
        "fp_id": TextArray(sorted(fingerprints)),
        "fp_runtime": TextArray(orjson.dumps(fingerprints[k]).decode()
                                for k in sorted(fingerprints)),
    }
    if remembered:
        params.update(credentials.guard_params(remembered))
    return sequencer.append(cur, [("envelope", f.request_id, p.dsse_sha256.hex())
                                  for f, p in zip(fields, new, strict=True)],
                            _STORE_ENVELOPES, params,
                            credentials.GUARD if remembered else "")[0]


#: Attempts at storing one statement's groups: after the first, a retry follows only a
#: race with another process that stored one of the same request_ids between classifying
#: and sequencing.
_ATTEMPTS = 5


def store_groups(cur: Any, groups: Sequence[Group], *, optimistic: bool = False,
                 settings: Settings | None = None) -> None:
    """Classify and store ``groups`` (each gets its report). ``cur`` is either in
    autocommit (the statement commits as it runs: :class:`GroupCommit`) or inside the
    caller's transaction (a savepoint then undoes a lost race).

    Groups admitted with remembered credentials are stored only if those are as
    remembered, tested by the storing statement itself, or by a statement of its own when
    nothing is new; if not, nothing is stored and
    :class:`~ledger.log.store.SequenceRefused` is raised.

    ``optimistic``: the first attempt takes every request_id for new without reading
    storage (one round trip instead of two, for the common case of new envelopes); a
    stored one fails that statement on the unique constraint, and the next attempt reads.
    An atomic batch is only ever rejected on a classification that read storage."""
    conn = cur.connection
    sealing = settings is not None and settings.kek_file is not None
    remembered = [g.remembered for g in groups if g.remembered is not None]
    for attempt in range(_ATTEMPTS):
        try:  # autocommit: one statement, unless sealing (a transaction of its own then)
            with conn.transaction() if sealing or not conn.autocommit else nullcontext():
                look_up = attempt > 0 or not optimistic
                new, pending = _plan(cur, groups, look_up=look_up)
                if not look_up and any(g.report is not None and
                                       g.report.outcome is BatchOutcome.REJECTED
                                       for g in groups):
                    # a rejection names every failed item: conflicts with storage too
                    new, pending = _plan(cur, groups)
                if new:
                    start = _write(cur, new, settings, remembered)
                    for result, slot in pending:
                        result.log_index = start + slot
                elif remembered:  # answered "existing" only to credentials as remembered
                    credentials.check(cur, remembered)
            return
        except psycopg.errors.UniqueViolation:
            # another process stored one of these request_ids after _plan read: classify
            # again (it is "existing" or a conflict now); nothing of ours was stored
            if attempt == _ATTEMPTS - 1:
                raise


class GroupCommit:
    """Ingest's storing step for one API process: requests hand their verified items over;
    one thread at a time (the leader) stores every group waiting, in one statement that
    commits as it runs, on a connection of its own, and goes on with the groups that came
    meanwhile until none is left. Concurrent single-envelope requests then share one
    sequencer lock and one WAL flush instead of queueing for the lock one by one; with
    nobody leading, a request's own thread stores it at once (no batching delay).
    Failures reach every request of the statement (a lost database is a 503 to each of
    them); nothing of a failed statement is stored. A bad value in one group fails the
    statement with a ``DataError``; the groups are then stored one at a time, each told
    its own outcome (a failure after some were stored reaches only those not stored yet).

    :meth:`submit` does not wait for a group another thread stores: it returns a future
    that the leader completes, so a request's thread is free as soon as its group is
    queued and the API awaits the answer on its event loop
    (``ledger.api.routes.envelopes``), instead of a thread sleeping until the leader
    wakes it (a context switch and a wait for the GIL each, ~20 us apiece on the VM).
    :meth:`store` waits."""

    def __init__(self, engine: Engine, settings: Settings | None = None,
                 max_items: int = 2000,
                 spawn: Callable[[Callable[[], None]], object] | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.max_items = max_items
        #: runs a function in another thread (the API's ingest threads): a leader that
        #: stored its own group hands the lead on to one, so that its request is answered
        #: now; without it, a leader leads until nothing waits
        self._spawn = spawn
        self._lock = threading.Lock()
        self._waiting: list[_Ticket] = []
        self._busy = False                     # a leader is storing, or about to
        self._conn: Connection | None = None   # the leader's; kept between statements

    def submit(self, group: Group, *, here: bool = True) -> Future[None]:
        """Queue ``group``; when nobody leads, this thread leads (stores it and whatever
        else is waiting, until nothing is) before returning, or with ``here`` off another
        thread does (``spawn``'s: the caller is an event loop, which must not wait for the
        database). The future is done once the group was stored (``group.report`` set) or
        failed (its exception); it is running from the start, so a caller that stops
        waiting cannot cancel it (what is queued is stored all the same)."""
        ticket = _Ticket(group)
        with self._lock:
            self._waiting.append(ticket)
            lead = not self._busy
            self._busy = True
        if lead and not here:
            try:
                self._lead_elsewhere()
            except RuntimeError:  # no thread could be started: lead here after all
                here = True
        if lead and here:
            self._hand_over()
        return ticket.stored

    def store(self, group: Group) -> None:
        """:meth:`submit`, then wait until the group is stored (or raise its failure)."""
        self.submit(group).result()

    def _hand_over(self) -> None:
        """Lead: store the oldest waiting groups and complete their futures; while any are
        waiting then, lead on, in another thread when there is ``spawn`` (this thread's
        own request is answered now), else here. With nothing waiting nobody is busy."""
        while True:
            with self._lock:
                if not self._waiting:
                    self._busy = False
                    return
                batch = self._take()
            try:
                self._flush(batch)
            except BaseException:
                with self._lock:
                    self._busy = bool(self._waiting)
                if self._busy:    # what waits meanwhile is not left without a leader
                    self._lead_elsewhere()
                raise
            finally:
                for t in batch:
                    t.settle()
            if self._spawn is not None and self._led_on():
                return

    def _led_on(self) -> bool:
        """After a statement: False if this thread is to lead on (``spawn`` refused);
        True once another thread leads what is waiting, or nothing is."""
        with self._lock:
            if not self._waiting:
                self._busy = False
                return True
        assert self._spawn is not None
        try:
            self._spawn(self._hand_over)
        except Exception:  # noqa: BLE001 - RuntimeError: the threads are shut down (the
            return False   # lifespan ended); anything else: this thread leads on all the same
        return True

    def _lead_elsewhere(self) -> None:
        """Lead what waits from another thread (this one is raising, or must not wait):
        ``spawn``'s, or one of its own when there is none or it refuses."""
        if self._spawn is not None:
            try:
                self._spawn(self._hand_over)
                return
            except Exception:  # noqa: BLE001, S110 - whatever refused, a thread leads
                pass
        threading.Thread(target=self._hand_over, name="group-commit-lead",
                         daemon=True).start()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        self.engine.dispose()

    def _take(self) -> list[_Ticket]:
        """The oldest waiting tickets, up to ``max_items`` items (at least one ticket)."""
        n, items = 0, 0
        for t in self._waiting:
            items += len(t.group.prepared)
            if n and items > self.max_items:
                break
            n += 1
        batch, self._waiting = self._waiting[:n], self._waiting[n:]
        return batch

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def _flush(self, batch: list[_Ticket]) -> None:
        try:
            with raw_cursor(self._connection()) as cur:
                todo = batch
                for _ in range(_ATTEMPTS):
                    try:
                        self._store(cur, todo)
                        return
                    except SequenceRefused:  # a remembered key changed: find which, store
                        todo = _current(cur, todo)  # the rest (checked again as it is stored)
                # still refused (the rows keep changing): every request admitted from
                # memory takes the fresh path; the others are stored
                for t in todo:
                    if t.group.remembered is not None:
                        t.error, t.settled = StaleCredentials(), True
                self._store(cur, [t for t in todo if not t.settled])
        except BaseException as exc:
            for t in batch:  # not the groups stored one by one before the failure
                if not t.settled:
                    t.error = t.error or exc
            if not isinstance(exc, psycopg.errors.DataError) and self._conn is not None:
                self._conn.invalidate()  # lost or in doubt: the next leader connects afresh
                self._conn.close()
                self._conn = None
            if not isinstance(exc, Exception):
                raise

    def _store(self, cur: Any, batch: list[_Ticket]) -> None:
        """Store ``batch`` in one statement (:class:`SequenceRefused` if a remembered key
        changed: nothing stored); when a bad value in one group fails it with a
        ``DataError``, one statement per group, each settled with its own outcome (one
        whose remembered credentials changed: :class:`StaleCredentials`)."""
        if not batch:
            return
        try:
            store_groups(cur, [t.group for t in batch], optimistic=True,
                         settings=self.settings)
        except psycopg.errors.DataError:
            if len(batch) == 1:
                raise
            for t in batch:  # one group's bad value fails that group only
                try:
                    store_groups(cur, [t.group], settings=self.settings)
                except psycopg.errors.DataError as exc:
                    t.error = exc
                except SequenceRefused:
                    t.error = StaleCredentials()
                t.settled = True  # committed (or failed) on its own: told so


def _current(cur: Any, batch: list[_Ticket]) -> list[_Ticket]:
    """After the storing statement refused ``batch``: the tickets to store now. A group
    admitted from memory whose keys are no longer as remembered
    (:func:`ledger.services.credentials.stale`) is not stored but settled with
    :class:`~ledger.services.credentials.StaleCredentials`, for its request to be taken
    again with fresh reads."""
    held = [(t, t.group.remembered) for t in batch if t.group.remembered is not None]
    changed = stale(cur, [r for _, r in held])  # (a refusal needs one: held is not empty)
    for (t, _), is_stale in zip(held, changed, strict=True):
        if is_stale:
            t.error, t.settled = StaleCredentials(), True
    return [t for t in batch if not t.settled]


def _running_future() -> Future[None]:
    """A future already running: ``cancel()`` refuses it (asyncio's ``wrap_future``
    cancels the future it wraps when its awaiter is cancelled)."""
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()
    return future


@dataclass(slots=True)
class _Ticket:
    group: Group
    #: its own outcome is known (stored on its own, or failed by its own value): a later
    #: group's failure is not its
    settled: bool = False
    error: BaseException | None = None
    stored: Future[None] = field(default_factory=_running_future)

    def settle(self) -> None:
        if self.error is not None:
            self.stored.set_exception(self.error)
        else:
            self.stored.set_result(None)


def ingest_batch(session: Session, raw_items: Sequence[Any], settings: Settings,
                 *, atomic: bool = False) -> IngestReport:
    """Verify, validate and classify every item, then (unless an atomic batch has a failed
    item) sequence and store the new ones. This flushes only, in the session's
    transaction: the caller commits when the outcome is STORED and rolls back when it is
    REJECTED (nothing was written then). The API stores through a :class:`GroupCommit`
    instead (:func:`submit_batch`)."""
    prepared, failures = decode_items(raw_items, settings, session)
    group = Group(prepared, failures, atomic)
    if group.has_items:
        with raw_cursor(session) as cur:
            store_groups(cur, [group], settings=settings)
    return _report_of(group)


@dataclass(slots=True)
class Submitted:
    """A request's items, verified and handed to a :class:`GroupCommit`: ``stored`` (None
    when there was nothing to store) is done once they are stored and committed, or
    failed; :meth:`report` then says what became of each."""

    group: Group
    stored: Future[None] | None

    def report(self) -> IngestReport:
        """The report (waiting for ``stored`` if need be; raises its failure)."""
        if self.stored is not None:
            self.stored.result()
        return _report_of(self.group)


def submit_batch(keys: Session | KeyLoader, raw_items: Sequence[Any], settings: Settings, *,
                 atomic: bool, group_commit: GroupCommit) -> Submitted:
    """:func:`ingest_batch`'s verification and classification, the storing handed to
    ``group_commit`` without waiting for another thread to do it (the API awaits
    :attr:`Submitted.stored` on its event loop)."""
    prepared, failures = decode_items(raw_items, settings, keys)
    group = Group(prepared, failures, atomic)
    return Submitted(group, group_commit.submit(group) if group.has_items else None)


def submit_admitted(keys: KeyLoader, raw: bytes, settings: Settings, *,
                    remembered: Remembered, group_commit: GroupCommit) -> Submitted | None:
    """:func:`submit_batch` for one envelope admitted from memory (``keys`` from the
    :class:`~ledger.services.credentials.CredentialCache`): None, with nothing handed
    over, when it fails to decode, verify or validate, or names a key not remembered
    (``keys`` raises :class:`~ledger.services.credentials.NotRemembered`), for the
    request to be answered from fresh reads. Reads nothing and never stores in this
    thread (another leads: ``GroupCommit.submit``'s ``here``), so an event loop may call
    it."""
    try:
        prepared, failures = decode_items([raw], settings, keys)
    except NotRemembered:
        return None
    if failures:
        return None
    group = Group(prepared, failures, False, remembered=remembered)
    return Submitted(group, group_commit.submit(group, here=False))


def _report_of(group: Group) -> IngestReport:
    """A group's report once stored; for one with nothing to store (every item failed
    before storage) its failures, or an atomic batch's rejection."""
    if group.report is None:
        failed = sorted(group.failures, key=lambda r: r.position)
        group.report = _rejected(len(group.prepared), failed) if group.atomic else \
            IngestReport(failed, BatchOutcome.STORED)
    return group.report


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
