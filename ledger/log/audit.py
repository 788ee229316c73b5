"""`ledger audit`: recompute the whole log from the stored records and check every
checkpoint against it.

What is checked, in one pass over the entries in index order:

1. the index sequence has no gap;
2. every leaf kind is recomputed from its own record table (:data:`LEAF_KINDS`): the
   record's stored DSSE bytes give the digest, the record's ID gives ``ref``; the result
   must equal the stored entry and leaf hash. A record whose ``log_index`` has no entry,
   or whose entry is of another kind, is reported too;
3. every served column of the record is cross-checked against the signed payload
   (``ledger.replay.views``): an edited ``outcome``, ``model_sha256`` or dispute event
   ``body`` is named with the column and both values;
4. optionally (``signatures=True``) every record's DSSE signatures verify: producer keys
   for envelopes, worker keys for verdicts, the ledger's service keys for dispute events
   (worker keys too for the ``replaying`` and ``verdict`` events a worker signs);
5. the mutable ``disputes`` rows must agree with the state folded from their signed
   event trails (state, resolution, note, resolver, verdict), and verdicts and events
   must name an envelope the log holds with the digest they signed;
6. the Merkle tree is rebuilt from the recomputed leaves; at every checkpoint size the
   recomputed root must equal the checkpoint's, whose note must carry a valid signature
   by a log key (with ``trust``: only the trust policy's log keys, never rows of
   ``signing_keys``); successive checkpoints must be consistent;
7. the stored tiles must equal the recomputed ones, and so must the stored subtree hashes
   of full tiles (``tile_nodes``) that proofs are built from;
8. with ``against`` (checkpoints saved outside the database), each saved checkpoint's
   signature is checked and its root must equal the recomputed root at its size. This is
   what catches a history rewritten consistently by someone holding the log key, and a
   tail truncated together with its checkpoints (the witness quorum is the online form
   of the same check).

The report names the first bad index it can pin down.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import multiprocessing
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from ledger.core import dsse
from ledger.core.cosignature import append_signature_lines, verified_witnesses
from ledger.core.errors import LedgerError
from ledger.core.keys import key_id
from ledger.core.logentry import log_entry_bytes, parse_log_entry
from ledger.core.merkle import EMPTY_ROOT, leaf_hash, verify_consistency
from ledger.core.note import NoteVerifier, open_checkpoint
from ledger.core.registry import RegisteredKey
from ledger.core.sealing import KeyEncryptionKey
from ledger.core.tiles import (
    FULL_TILE_BYTES,
    MemoryTileStore,
    Tile,
    _mth_aligned,
    consistency_proof_from_tiles,
    integrate,
    root_from_tiles,
    tiles_for_size,
)
from ledger.core.trust import TrustPolicy
from ledger.db.session import session_scope
from ledger.log.registry import trusted_signers, vouched_keys
from ledger.log.signer import log_verifiers
from ledger.log.witnessing import audit_cosignatures, stored_cosignature_lines
from ledger.privacy.audit import ErasureState, Opened, erasure_state
from ledger.replay import views

CHUNK = 5_000


@dataclass
class AuditReport:
    entries: int = 0
    tree_size: int = 0
    checkpoints: int = 0
    saved_checkpoints: int = 0
    signatures_checked: int = 0
    records_checked: dict[str, int] = field(default_factory=dict)
    disputes_checked: int = 0
    erased_records: int = 0  # envelopes checked against their erasure leaf's tombstone
    sealed_records: int = 0  # envelopes stored encrypted (opened or erased)
    trusted: bool = False
    problems: list[str] = field(default_factory=list)
    first_bad_index: int | None = None
    bad_range: tuple[int, int] | None = None
    since: int | None = None  # ``--since``: the audited checkpoint's size

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, message: str, index: int | None = None) -> None:
        self.problems.append(message)
        if index is not None and (self.first_bad_index is None or index < self.first_bad_index):
            self.first_bad_index = index


@dataclass
class _Checkpoint:
    size: int
    root: bytes
    note: bytes
    source: str  # "db" or a saved file's name


class SinceCheckpointError(LedgerError):
    """The checkpoint given to ``audit(since=...)`` does not verify under the log's keys
    (with a trust policy: its log keys): nothing can be audited from it."""

    code = "since_checkpoint"


# --- the leaf kinds ------------------------------------------------------------------

WORKER_EVENT_KINDS = frozenset({"replaying", "verdict"})
"""Dispute events a replay worker signs (with its worker key); the ledger's service key
signs every other event."""


@dataclass(frozen=True)
class LeafKind:
    """How one kind of leaf is audited from its own record.

    - ``table``: the record table; ``log_index`` names the record's leaf;
    - ``ref_column``: the record's ID, which the log entry names as ``ref``;
    - the entry bytes are rebuilt as ``log_entry_bytes(kind, <ref_column>,
      sha256(<dsse>))`` from the stored DSSE bytes (the same rule for every kind);
    - ``view``: derives the signed field values from the DSSE bytes
      (``ledger.replay.views``);
    - ``checked``: the served columns cross-checked against the view (same names);
    - ``signers``: key purposes whose keys may have signed a record, given its view;
    - ``columns``: puts the stored columns in the view's shape before comparing.
    """

    kind: str
    table: str
    ref_column: str
    view: Callable[[bytes], dict[str, Any]]
    checked: tuple[str, ...]
    signers: Callable[[Mapping[str, Any]], tuple[str, ...]]
    columns: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] = \
        lambda rec, signed: rec
    casts: tuple[tuple[str, str], ...] = ()  # (column, SQL giving it in the view's form)
    # optional fast path: the signed values of ``checked`` as a tuple, given the DSSE bytes
    # and their hex SHA-256 (for kinds whose audit needs nothing else from the view)
    values: Callable[[bytes, str], tuple[Any, ...]] | None = None

    @property
    def select(self) -> str:
        """Rows of (log_index, dsse, ref, *checked)."""
        cast = dict(self.casts)
        cols = ", ".join([self.ref_column, *(cast.get(c, c) for c in self.checked)])
        # names from the LEAF_KINDS constants, never from input
        return f"SELECT log_index, dsse, {cols} FROM {self.table} ORDER BY log_index"  # noqa: S608

    def select_from(self, start: int) -> str:
        """:attr:`select`, for the records at ``log_index >= start`` only."""
        head, order = self.select.rsplit(" ORDER BY ", 1)
        return f"{head} WHERE log_index >= {int(start)} ORDER BY {order}"

    def signed_values(self, signed: Mapping[str, Any]) -> tuple[Any, ...]:
        try:
            return tuple(self._getter(signed))
        except KeyError:
            return tuple(signed.get(c) for c in self.checked)

    @functools.cached_property
    def _getter(self) -> Callable[[Mapping[str, Any]], Any]:
        if not self.checked:
            return lambda d: ()
        if len(self.checked) == 1:
            name = self.checked[0]
            return lambda d: (d[name],)
        return operator.itemgetter(*self.checked)


def _event_view(dsse_bytes: bytes) -> dict[str, Any]:
    v = views.event_view(dsse_bytes)
    return v


def _admin_view(dsse_bytes: bytes) -> dict[str, Any]:
    """The signed admin event (``ledger.core.statements.admin_event_statement``): the row's
    ``body`` holds the whole predicate."""
    p = views.open_signed(dsse_bytes).statement["predicate"]
    try:
        return {"event_id": p["event_id"], "kind": p["kind"], "actor": p["actor"],
                "target": p.get("target"), "body": p, "at": views.parse_time(p["at"])}
    except (KeyError, TypeError) as exc:
        raise views.SignedRecordError(f"the signed admin event lacks {exc}") from None


def _erasure_view(dsse_bytes: bytes) -> dict[str, Any]:
    """The signed erasure statement (``ledger.core.erasure``): the row's ``body`` holds
    the whole predicate."""
    p = views.open_signed(dsse_bytes).statement["predicate"]
    try:
        return {"erasure_id": p["erasure_id"], "kind": p["kind"], "actor": p["actor"],
                "data_subject_sha256": p.get("data_subject_sha256"),
                "policy": p.get("policy"), "body": p, "at": views.parse_time(p["at"])}
    except (KeyError, TypeError) as exc:
        raise views.SignedRecordError(f"the signed erasure lacks {exc}") from None


LEAF_KINDS: tuple[LeafKind, ...] = (
    LeafKind("envelope", "envelopes", "request_id", views.envelope_index,
             views.ENVELOPE_INDEX_FIELDS, lambda v: ("producer",),
             casts=(("dsse_sha256", "encode(dsse_sha256, 'hex')"),),
             values=views.envelope_values),
    LeafKind("verdict", "verdicts", "verdict_id", views.verdict_view, views.VERDICT_FIELDS,
             lambda v: ("worker",), views.verdict_columns),
    LeafKind("dispute_event", "dispute_events", "event_id", _event_view, views.EVENT_FIELDS,
             lambda v: ("ledger", "worker") if v["kind"] in WORKER_EVENT_KINDS
             else ("ledger",), casts=(("dispute_id", "dispute_id::text"),)),
    # Audited once its table exists (migration 0006, the registry work).
    LeafKind("admin_event", "admin_events", "event_id", _admin_view,
             ("event_id", "kind", "actor", "target", "body", "at"),
             lambda v: ("ledger",)),
    # Erasure leaves (migration 0015); what they say of envelopes: ledger.privacy.audit.
    LeafKind("erasure", "erasures", "erasure_id", _erasure_view,
             ("erasure_id", "kind", "actor", "data_subject_sha256", "policy", "body", "at"),
             lambda v: ("ledger",)),
    # Replay matrix reports (migration 0016): the stored report bytes must hash to the
    # digest the worker signed.
    LeafKind("matrix_run", "matrix_runs", "run_id", views.matrix_run_view,
             views.MATRIX_RUN_FIELDS, lambda v: ("worker",),
             casts=(("job_id", "job_id::text"),
                    ("report_sha256", "encode(sha256(report), 'hex')"))),
)
"""Every leaf kind of the log. One more kind is one more entry."""

ENVELOPE_DIGEST_ONLY: tuple[LeafKind, ...] = (
    LeafKind("envelope", "envelopes", "request_id", lambda b: {}, (), lambda v: ("producer",)),
)
"""What ``ledger audit`` checked before every kind had a record table: envelope leaves
only, digest only (kept as the benchmark's baseline)."""


def _signing_keys(session: Any, trust: TrustPolicy | None,
                  vouched: Mapping[str, RegisteredKey] | None = None,
                  ) -> dict[str, dict[str, bytes]]:
    """{purpose: {keyid: raw public key}} that record signatures are checked with.

    The one place audit looks keys up. With a trust policy: the ledger's service keys come
    from the policy, producer and worker keys from the registry leaves that a policy
    service key signed (``vouched``, :func:`ledger.log.registry.vouched_keys`); rows of
    ``signing_keys`` alone are never believed. Without one, from ``signing_keys`` rows.
    """
    keys: dict[str, dict[str, bytes]] = {"producer": {}, "worker": {}, "ledger": {}}
    if trust is not None:
        for keyid, reg in (vouched or {}).items():
            if reg.purpose in ("producer", "worker"):
                keys[reg.purpose][keyid] = bytes(reg.public_key)
        keys["ledger"] = {key_id(k): bytes(k) for k in trust.service_keys}
        return keys
    from sqlalchemy import select

    from ledger.db.models import SigningKey

    for keyid, public_key, purpose in session.execute(
            select(SigningKey.keyid, SigningKey.public_key, SigningKey.purpose)).all():
        if purpose in keys:
            keys[purpose][keyid] = bytes(public_key)
    return keys


def _log_verifiers(session: Any, origin: str, trust: TrustPolicy | None) -> list[NoteVerifier]:
    """Checkpoints are believed with the trust policy's log keys only, when one is given."""
    if trust is not None:
        return trust.log_verifiers()
    return log_verifiers(session, origin)


class _Stream:
    """One kind's records in ``log_index`` order, read through a server-side cursor."""

    def __init__(self, spec: LeafKind, rows: Iterator[tuple[Any, ...]]):
        self.spec, self.rows = spec, rows
        self.head: tuple[Any, ...] | None = next(self.rows, None)

    def pop(self) -> tuple[Any, ...]:
        """(log_index, dsse, ref, *checked columns) of the next record."""
        row = self.head
        assert row is not None
        self.head = next(self.rows, None)
        return row


def _table_exists(cur: Any, table: str) -> bool:
    cur.execute("SELECT to_regclass(%s) IS NOT NULL", (f"public.{table}",))
    return bool(cur.fetchone()[0])


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


@dataclass
class _Context:
    """What the pass collects for the checks that span records."""

    trails: dict[str, views.DisputeTrail] = field(default_factory=dict)
    verdicts: dict[str, tuple[int, str]] = field(default_factory=dict)  # id -> (idx, outcome)
    # (record's index, what it is, envelope index named or None, request_id, digest)
    subjects: list[tuple[int, str, int | None, str, str]] = field(default_factory=list)


class _Where:
    """``entry <idx> (<kind> <ref>)``, formatted only when a problem is reported."""

    __slots__ = ("idx", "kind", "ref")

    def __init__(self, idx: int, kind: str, ref: str) -> None:
        self.idx, self.kind, self.ref = idx, kind, ref

    def __format__(self, spec: str) -> str:
        return f"entry {self.idx} ({self.kind} {self.ref})"


def _trail(ctx: _Context, signed: Mapping[str, Any], idx: int) -> views.DisputeTrail:
    """The dispute trail ``signed`` (an event) belongs to; a new one names its subject."""
    did = str(signed["dispute_id"])
    trail = ctx.trails.get(did)
    if trail is None:
        trail = ctx.trails[did] = views.DisputeTrail(did)
        ctx.subjects.append((idx, f"dispute {did}", None, signed["request_id"],
                             signed["envelope_dsse_sha256"]))
    return trail


def _check_record(report: AuditReport, spec: LeafKind, idx: int, entry: bytes,
                  row: tuple[Any, ...], keys: dict[str, dict[str, bytes]] | None,
                  ctx: _Context) -> bytes:
    """Audit one record (a ``_Stream`` row) against its entry; returns the entry
    recomputed from it."""
    decoded = row[-1] if type(row[-1]) in (_Decoded, Opened) else None
    if decoded is not None:
        row = row[:-1]
    dsse_bytes, ref = bytes(row[1]), row[2]
    where = _Where(idx, spec.kind, ref)
    report.records_checked[spec.kind] = report.records_checked.get(spec.kind, 0) + 1
    digest = decoded.digest if decoded is not None else hashlib.sha256(dsse_bytes).hexdigest()
    recomputed = log_entry_bytes(spec.kind, ref, digest)
    if recomputed != entry:
        report.fail(f"{where}: the stored entry does not match its record (record changed "
                    "or moved)", idx)
    if not spec.checked and keys is None:
        return recomputed
    signed: dict[str, Any] = {}
    try:
        if decoded is not None:
            if decoded.error is not None:
                raise LedgerError(decoded.error)
            assert decoded.values is not None
            values = decoded.values
        elif spec.values is not None:
            values = spec.values(dsse_bytes, digest)
        else:
            signed = spec.view(dsse_bytes)
            values = spec.signed_values(signed)
    except LedgerError as exc:
        report.fail(f"{where}: {exc.message}", idx)
        return recomputed
    stored = row[3:]
    if stored != values:  # the common case costs one comparison
        signed = signed or dict(zip(spec.checked, values, strict=True))
        rec = spec.columns(dict(zip(spec.checked, stored, strict=True)), signed)
        for column, have, want in views.disagreements(rec, signed, spec.checked):
            report.fail(f"{where}: column {column} says {_show(have)}, the signed "
                        f"{spec.kind} says {_show(want)}", idx)
    if keys is not None and type(decoded) is Opened and decoded.erased:
        pass  # erased: its signed bytes are gone; its erasure leaf's signature vouches
    elif keys is not None:
        allowed: dict[str, bytes] = {}
        for purpose in spec.signers(signed):
            allowed.update(keys.get(purpose, {}))
        try:
            dsse.verify_envelope(dsse.envelope_from_json(dsse_bytes), lambda k: allowed[k])
            report.signatures_checked += 1
        except KeyError as exc:
            report.fail(f"{where}: signed by key {exc.args[0][:16]}..., which is not a "
                        f"{' or '.join(spec.signers(signed))} key", idx)
        except LedgerError as exc:
            report.fail(f"{where}: signature: {exc.message}", idx)
    if spec.kind == "verdict":
        ctx.verdicts[signed["verdict_id"]] = (idx, signed["outcome"])
        ctx.subjects.append((idx, f"verdict {ref}", signed["envelope_index"],
                             signed["request_id"], signed["envelope_dsse_sha256"]))
    elif spec.kind == "dispute_event":
        trail = _trail(ctx, signed, idx)
        before = len(trail.problems)
        trail.add(signed, idx)
        for problem in trail.problems[before:]:
            report.fail(f"{where}: dispute {trail.dispute_id}: {problem}", idx)
    return recomputed


def _rows(conn: Any, name: str, query: str) -> Iterator[tuple[Any, ...]]:
    """The rows of ``query`` through a binary server-side cursor, fetched CHUNK at a time
    (iterating the cursor itself costs a Python call per row)."""
    with conn.cursor(name=name, binary=True) as stream:
        stream.execute(query)
        while batch := stream.fetchmany(CHUNK):
            yield from batch


def _entry_stream(conn: Any, start: int = 0) -> Iterator[tuple[Any, ...]]:
    where = f"WHERE idx >= {int(start)}"
    query = f"SELECT idx, kind, ref, entry, leaf_hash FROM log_entries {where} ORDER BY idx"  # noqa: S608
    return _rows(conn, "audit_entries", query)


def _record_stream(conn: Any, spec: LeafKind, start: int = 0) -> Iterator[tuple[Any, ...]]:
    return _rows(conn, f"audit_{spec.table}", spec.select_from(start) if start
                 else spec.select)




@dataclass(frozen=True, slots=True)
class _Decoded:
    """What a helper process computed from one record's DSSE bytes."""

    digest: str
    values: tuple[Any, ...] | None
    error: str | None


def _decode_envelopes(dsse_list: list[bytes]) -> list[_Decoded]:
    """In a helper process: each envelope's digest and signed index values."""
    out = []
    for dsse_bytes in dsse_list:
        digest = hashlib.sha256(dsse_bytes).hexdigest()
        try:
            out.append(_Decoded(digest, views.envelope_values(dsse_bytes, digest), None))
        except LedgerError as exc:
            out.append(_Decoded(digest, None, exc.message))
    return out


def _decoded_in(pool: Executor, rows: Iterator[tuple[Any, ...]], chunk: int = 2000,
                ahead: int = 3) -> Iterator[tuple[Any, ...]]:
    """``rows`` in order, each with its :class:`_Decoded` appended, decoded by ``pool``
    ``ahead`` chunks in advance."""
    pending: deque[tuple[list[tuple[Any, ...]], Future[list[_Decoded]]]] = deque()

    def submit() -> None:
        batch = list(itertools.islice(rows, chunk))
        if batch:
            pending.append((batch, pool.submit(_decode_envelopes,
                                               [bytes(r[1]) for r in batch])))

    for _ in range(ahead):
        submit()
    while pending:
        batch, future = pending.popleft()
        submit()
        for row, decoded in zip(batch, future.result(), strict=True):
            yield (*row, decoded)


def audit(engine: Engine, origin: str, *, against: Iterable[tuple[str, bytes]] = (),
          witnessed: Iterable[tuple[str, int, bytes]] = (),
          signatures: bool = False, trust: TrustPolicy | None = None,
          kinds: tuple[LeafKind, ...] = LEAF_KINDS,
          progress: Callable[[int, int], None] | None = None,
          workers: int = 0, since: bytes | None = None,
          kek: KeyEncryptionKey | None = None) -> AuditReport:
    """Audit the whole log, or with ``since`` what was added after a checkpoint audited
    before (:func:`_check_stored_tree` says what that checks). With ``trust``, checkpoints
    (stored and saved) count only when signed by one of ``trust.log_keys`` and dispute
    events only when signed by one of ``trust.service_keys`` (or, for the events a worker
    signs, by a worker key); producer and worker keys only when registry leaves signed by a
    policy service key vouch for them
    (and every key or API-key row without its leaf is reported); stored cosignatures must
    verify under the policy's witness keys and reach its quorum.

    ``witnessed``: (witness, size, root) that witnesses report having cosigned (``ledger
    audit --witness URL``); like ``against``, the stored log must reach each size with that
    root, which is what catches a tail deleted together with its checkpoints.

    ``workers``: helper processes that decode envelope payloads (default: none). Since
    envelopes are decoded field by field (:func:`ledger.replay.views.envelope_values`,
    ~4 us each), handing them to a helper costs the main pass more than decoding them
    itself (measured at 200,000 entries on 2 cores: 4.1 s of main-process CPU with one
    helper, 3.2 s without).

    ``since``: a signed checkpoint note (a file ``ledger audit`` checked before, the
    checkpoint sink's, an export's). It must verify under the same log keys as every
    checkpoint (with ``trust``: the policy's); if not, :class:`SinceCheckpointError` is
    raised and nothing is audited. Then only the entries from its size on are rechecked
    from their records, exactly as the full audit checks them; for the entries before it
    the stored tree must be the one its root commits to, every stored tile included, and
    the tree rebuilt from the new entries on top of it must reach every later checkpoint's
    root (an RFC 9162 consistency proof from the stored tiles is verified as well).
    Rehashing the old entries and records is left to the full audit.

    ``kek``: the key-encryption key, to open envelopes encrypted at rest; erased envelopes
    are checked against their erasure leaf's tombstone (:mod:`ledger.privacy.audit`).
    """
    with contextlib.ExitStack() as stack:
        return _audit(engine, origin, against, witnessed, signatures, trust, kinds,
                      progress, workers, stack, since, kek)


def _audit(engine: Engine, origin: str, against: Iterable[tuple[str, bytes]],
           witnessed: Iterable[tuple[str, int, bytes]], signatures: bool,
           trust: TrustPolicy | None, kinds: tuple[LeafKind, ...],
           progress: Callable[[int, int], None] | None, workers: int,
           stack: contextlib.ExitStack, since_note: bytes | None = None,
           kek: KeyEncryptionKey | None = None) -> AuditReport:
    report = AuditReport(trusted=trust is not None)
    if trust is not None:
        origin = trust.origin
    ctx = _Context()
    with session_scope(engine) as session:
        verifiers = _log_verifiers(session, origin, trust)
        since: _Checkpoint | None = None
        if since_note is not None:
            try:
                opened_since = open_checkpoint(since_note, verifiers, origin=origin)
            except LedgerError as exc:
                whose = ("a log key of the trust policy" if trust is not None
                         else "a registered log key")
                raise SinceCheckpointError(f"the --since checkpoint: {exc.message}: not "
                                           f"signed by {whose}") from None
            since = _Checkpoint(opened_since.size, opened_since.root_hash, since_note,
                                "since")
            report.since = since.size
        start = since.size if since is not None else 0
        vouched: dict[str, RegisteredKey] | None = None
        if trust is not None:
            vouched, registry_problems = vouched_keys(session, trust)
            for index, message in registry_problems:
                report.fail(f"registry: {message}", index)
            for cp_size, message in audit_cosignatures(session, trust):
                report.fail(f"witnesses: {message}", cp_size)
        keys = _signing_keys(session, trust, vouched) if signatures else None
        conn = session.connection().connection.driver_connection
        assert conn is not None
        erasures: ErasureState | None = None
        if any(k.kind == "envelope" for k in kinds):
            with conn.cursor() as cur:
                erasures = erasure_state(cur, trusted_signers(session, trust)[0], kek)
        with conn.cursor() as cur:
            cur.execute("SELECT tree_size, root_hash, note FROM checkpoints "
                        "WHERE tree_size >= %s ORDER BY tree_size", (start,))
            db_cps = [_Checkpoint(r[0], bytes(r[1]), bytes(r[2]), "db") for r in cur.fetchall()]
            cur.execute("SELECT size FROM log_state WHERE id = 1")
            sequenced = int(cur.fetchone()[0])
            cur.execute("SELECT size, root_hash FROM log_tree WHERE id = 1")
            tree_row = cur.fetchone()
            present = [k for k in kinds if _table_exists(cur, k.table)]
            has_disputes = _table_exists(cur, "disputes")
        with conn.cursor(binary=True) as bcur:  # 32 MiB of tiles per 1M entries, not hex
            bcur.execute("SELECT level, idx, data FROM tiles")
            stored_tiles = {(r[0], r[1]): bytes(r[2]) for r in bcur.fetchall()}
            stored_nodes: dict[tuple[int, int], bytes] = {}
            if _table_exists(bcur, "tile_nodes"):  # 0014; as much again, of full tiles
                bcur.execute("SELECT level, idx, nodes FROM tile_nodes")
                stored_nodes = {(r[0], r[1]): bytes(r[2]) for r in bcur.fetchall()}
        by_kind = {k.kind: k for k in present}
        absent_kinds = {k.kind for k in LEAF_KINDS} - set(by_kind)
        saved = []
        for name, note in against:
            try:
                cp = open_checkpoint(note, verifiers, origin=origin)
            except LedgerError as exc:
                report.fail(f"saved checkpoint {name}: {exc.message}"
                            + (" (with the trust policy's log keys)" if trust else ""))
                continue
            saved.append(_Checkpoint(cp.size, cp.root_hash, note, name))
        for name, w_size, w_root in witnessed:
            if w_size > 0:  # a witness that has cosigned nothing yet says nothing
                saved.append(_Checkpoint(w_size, w_root, b"", f"witness {name}"))
        report.saved_checkpoints = len(saved)

        verified_cps: list[_Checkpoint] = []
        for stored in db_cps:
            try:
                opened = open_checkpoint(stored.note, verifiers, origin=origin)
            except LedgerError as exc:
                lo = verified_cps[-1].size if verified_cps else 0
                whose = ("a log key of the trust policy" if trust is not None
                         else "a registered log key")
                report.fail(f"checkpoint {stored.size}: {exc.message}: not signed by {whose}, "
                            f"so entries {lo}..{stored.size - 1} are not vouched for", lo)
                continue
            if (opened.size, opened.root_hash) != (stored.size, stored.root):
                report.fail(f"checkpoint {stored.size}: the signed note says size "
                            f"{opened.size}")
                continue
            verified_cps.append(stored)
        report.checkpoints = len(db_cps)
        if trust is not None and trust.witnesses:
            # A checkpoint cosigned by the policy's witnesses is vouched for outside the
            # database: like a saved one, the stored log must agree with it. (Cosignatures
            # that do not verify were reported above and vouch for nothing.)
            need = max(1, trust.quorum)
            for vcp in verified_cps:
                note = append_signature_lines(vcp.note, stored_cosignature_lines(session,
                                                                                 vcp.size))
                try:
                    if len(verified_witnesses(note, trust.witnesses)) >= need:
                        saved.append(_Checkpoint(vcp.size, vcp.root, note, "cosigned"))
                except LedgerError:
                    continue
            report.saved_checkpoints = len(saved)
        # With a trust policy, the witness quorum was checked above (audit_cosignatures).

        # Roots we must recompute: every checkpoint size, stored or saved elsewhere.
        wanted = sorted({c.size for c in db_cps} | {c.size for c in saved if c.size > start})
        roots: dict[int, bytes] = {0: EMPTY_ROOT}
        store = MemoryTileStore()
        if since is not None:
            # The tree before ``start`` is the stored one, once it is the audited one.
            if _check_stored_tree(report, stored_tiles, since):
                store.write_tiles({t: stored_tiles[(t.level, t.index)][: t.width * 32]
                                   for t in tiles_for_size(start)})
                roots[start] = since.root
                for old in saved:
                    if old.size < start:
                        roots[old.size] = root_from_tiles(old.size, store)
            else:  # nothing later can be trusted to agree; say so once
                return report
            _fold_old_trails(conn, start, ctx)
        size = start
        pending: list[bytes] = []
        next_want = iter(wanted)
        target = next(next_want, None)
        expected = start

        def flush_to(limit: int) -> None:
            nonlocal size, pending
            while pending and size < limit:
                take = min(len(pending), limit - size)
                res = integrate(size, pending[:take], store)
                store.write_tiles(res.tiles)
                store.write_nodes(res.nodes)
                size = res.size
                pending = pending[take:]
                roots[size] = res.root

        streams = []
        pool = None
        if workers > 0 and any(spec.values is not None for spec in present):
            pool = stack.enter_context(ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")))
        for spec in present:
            rows = _record_stream(conn, spec, start)
            if spec.kind == "envelope" and erasures is not None:
                rows = erasures.open_rows(rows)  # sealed content opened, erased: tombstones
            elif pool is not None and spec.values is not None:
                rows = _decoded_in(pool, rows)
            streams.append(_Stream(spec, rows))

        def orphans_before(limit: int | None) -> None:
            for s in streams:
                while s.head is not None and (limit is None or s.head[0] < limit):
                    rec = s.pop()
                    at = rec[0]
                    report.fail(f"{s.spec.kind} record {rec[2]} claims "
                                f"log_index {at}, which has no log entry", at)

        for row in _entry_stream(conn, start):
            idx, kind, ref, entry, stored_leaf = row[0], row[1], row[2], bytes(row[3]), \
                bytes(row[4])
            if idx != expected:
                report.fail(f"entries {expected}..{idx - 1} are missing", expected)
                # keep going with the indices we have, so later checks still run
                expected = idx
            orphans_before(idx)
            recomputed: bytes | None = None
            for s in streams:
                if s.head is None or s.head[0] != idx:
                    continue
                rec = s.pop()
                if s.spec.kind != kind:
                    report.fail(f"entry {idx} ({kind} {ref}): a {s.spec.kind} record "
                                f"({rec[2]}) claims this index", idx)
                    continue
                recomputed = _check_record(report, s.spec, idx, entry, rec, keys, ctx)
            if recomputed is None and kind in by_kind:
                report.fail(f"entry {idx} ({kind} {ref}): its {kind} record is missing", idx)
            elif kind not in by_kind and kind not in absent_kinds:
                report.fail(f"entry {idx}: unknown entry kind {kind!r}", idx)
            # kinds whose table does not exist here: the stored entry is used
            leaf = leaf_hash(entry)
            if leaf != stored_leaf:
                report.fail(f"entry {idx}: stored leaf hash does not match the entry", idx)
            # the tree is built from the recomputed entries (the stored one where its kind
            # has no record table here); equal bytes need no second hash
            pending.append(leaf if recomputed is None or recomputed == entry
                           else leaf_hash(recomputed))
            expected += 1
            while target is not None and size + len(pending) >= target:
                flush_to(target)
                target = next(next_want, None)
            if len(pending) >= CHUNK:  # every target <= this size was flushed above
                flush_to(size + len(pending))
            if progress and expected % CHUNK == 0:
                progress(expected, sequenced)
        orphans_before(None)
        flush_to(size + len(pending))
        report.entries = expected - start
        report.tree_size = size
        if erasures is not None:
            extra = erasures.problems + (erasures.unmatched_tombstones() if since is None
                                         else [])
            for index, message in extra:
                report.fail(f"erasure: {message}", index)
            report.erased_records = erasures.erased_records
            report.sealed_records = erasures.sealed_records
        if "envelope" in by_kind and len(kinds) > 1:
            with conn.cursor() as cur:
                _check_subjects(report, cur, ctx)
                if has_disputes and "dispute_event" in by_kind:
                    _check_disputes(report, cur, ctx, only_trails=since is not None)
        if progress:
            progress(expected, sequenced)

    if sequenced != expected:
        report.fail(f"log_state says {sequenced} entries were sequenced, {expected} are stored",
                    min(sequenced, expected))
    if since is not None:
        if not db_cps or db_cps[-1].size < start:
            report.fail(f"the --since checkpoint (size {start}) is beyond the log's latest "
                        f"checkpoint: the log was truncated", report.tree_size)
        for dbcp in db_cps:
            if dbcp.size == start and dbcp.root != since.root:
                report.fail(f"checkpoint {start}: root differs from the --since checkpoint's",
                            0)
        _check_roots(report, [since, *(c for c in db_cps if c.size > start)], roots, store)
        if db_cps and roots.get(db_cps[-1].size) == db_cps[-1].root:
            _check_served_consistency(report, since, db_cps[-1], stored_tiles)
    else:
        _check_roots(report, db_cps, roots, store)
    _check_saved(report, saved, roots)
    if tree_row is not None and db_cps and (tree_row[0], bytes(tree_row[1])) != (
            db_cps[-1].size, db_cps[-1].root):
        report.fail("log_tree does not match the latest checkpoint")
    _check_tiles(report, stored_tiles, store,
                 min(db_cps[-1].size if db_cps else 0, report.tree_size), start)
    _check_tile_nodes(report, stored_nodes, store, start)
    return report


def _envelope_entries(cur: Any, indices: set[int]) -> dict[int, tuple[str, str, str,
                                                                        str | None]]:
    """{index: (entry kind, ref, digest, envelopes.fingerprint_id)} for the given indices.
    The envelope rows themselves are audited against their entries in the pass."""
    out = {}
    cur.execute("SELECT e.idx, e.entry, v.fingerprint_id FROM log_entries e "
                "LEFT JOIN envelopes v ON v.log_index = e.idx WHERE e.idx = ANY(%s)",
                (sorted(indices),))
    for idx, entry, fp in cur.fetchall():
        try:
            kind, ref, digest = parse_log_entry(bytes(entry))
        except LedgerError:
            continue  # reported by the pass (the entry does not match its record)
        out[idx] = (kind, ref, digest, fp)
    return out


def _check_subjects(report: AuditReport, cur: Any, ctx: _Context) -> None:
    """A verdict names the envelope it judged by log index and digest; that entry must be
    that envelope. (A dispute's trail is checked against its row's envelope_index in
    :func:`_check_disputes`.)"""
    named = {s[2] for s in ctx.subjects if s[2] is not None}
    if not named:
        return
    found = _envelope_entries(cur, {i for i in named if isinstance(i, int)})
    for idx, what, env_index, request_id, digest in ctx.subjects:
        if env_index is None:
            continue
        have = found.get(env_index) if isinstance(env_index, int) else None
        if have is None or have[:3] != ("envelope", request_id, digest):
            report.fail(f"entry {idx} ({what}): the signed subject (envelope {request_id} "
                        f"at index {env_index}) is not what the log holds there", idx)


def _check_disputes(report: AuditReport, cur: Any, ctx: _Context,
                    only_trails: bool = False) -> None:
    """Each ``disputes`` row must agree with the state folded from its signed trail
    (``only_trails``: the rows of the trails in ``ctx`` only, for ``--since``)."""
    cur.execute("SELECT id, request_id, envelope_index, fingerprint_id, state, resolution, "
                "resolution_note, resolved_by, verdict_id FROM disputes ORDER BY id")
    rows = cur.fetchall()
    if only_trails:
        rows = [r for r in rows if str(r[0]) in ctx.trails]
    env = _envelope_entries(cur, {r[2] for r in rows})
    trails = dict(ctx.trails)
    for did, request_id, envelope_index, fingerprint_id, *rest in rows:
        did = str(did)
        report.disputes_checked += 1
        trail = trails.pop(did, None)
        if trail is None:
            report.fail(f"dispute {did}: no signed event of it is in the log")
            continue
        # a disputes row is no leaf: its problems name the dispute, not a log index
        at = None
        where = f"dispute {did} (signed trail to entry {trail.last_index}, seq {trail.last_seq})"
        columns = dict(zip(("state", "resolution", "resolution_note", "resolved_by",
                            "verdict_id"), rest, strict=True))
        columns["request_id"] = request_id
        for column, have, want in views.disagreements(columns, trail.fields(),
                                                      views.DISPUTE_FIELDS):
            report.fail(f"{where}: column {column} says {_show(have)}, the signed event "
                        f"trail says {_show(want)}", at)
        envelope = env.get(envelope_index)
        if envelope is None or envelope[:3] != ("envelope", trail.request_id,
                                                trail.envelope_dsse_sha256):
            report.fail(f"{where}: column envelope_index says {envelope_index}, but the log "
                        f"holds no envelope {trail.request_id} with the signed digest there",
                        at)
        elif envelope[3] != fingerprint_id:
            report.fail(f"{where}: column fingerprint_id says {_show(fingerprint_id)}, its "
                        f"envelope says {_show(envelope[3])}", at)
        if trail.verdict_id is not None:
            verdict = ctx.verdicts.get(trail.verdict_id)
            if verdict is None:
                report.fail(f"{where}: its signed verdict event names verdict "
                            f"{trail.verdict_id}, which the log does not hold", at)
            elif verdict[1] != trail.verdict_outcome:
                report.fail(f"{where}: its signed verdict event says {trail.verdict_outcome!r}, "
                            f"verdict {trail.verdict_id} (entry {verdict[0]}) says "
                            f"{verdict[1]!r}", at)
    for did, trail in trails.items():
        report.fail(f"dispute {did}: signed events up to entry {trail.last_index} but no "
                    "dispute row")
def _check_roots(report: AuditReport, cps: list[_Checkpoint], roots: dict[int, bytes],
                 store: MemoryTileStore) -> None:
    previous: _Checkpoint | None = None
    for cp in cps:
        root = roots.get(cp.size)
        if root is None:
            report.fail(f"checkpoint {cp.size} is beyond the {report.tree_size} stored entries",
                        report.tree_size)
            continue
        if root != cp.root:
            lo = previous.size if previous else 0
            report.fail(f"checkpoint {cp.size}: root differs from the tree recomputed from "
                        f"the stored entries (first difference in {lo}..{cp.size - 1})", lo)
        elif previous is not None:
            try:
                proof = consistency_proof_from_tiles(previous.size, cp.size, store)
                verify_consistency(previous.size, cp.size, proof, previous.root, cp.root)
            except LedgerError as exc:
                report.fail(f"checkpoints {previous.size} -> {cp.size} are not consistent: "
                            f"{exc.message}", previous.size)
        previous = cp


def _check_saved(report: AuditReport, saved: list[_Checkpoint], roots: dict[int, bytes]) -> None:
    """Saved checkpoints narrow a rewrite down: between the last one that agrees and the
    first that does not."""
    agreeing = 0
    for cp in sorted(saved, key=lambda c: c.size):
        root = roots.get(cp.size)
        if root is None:
            report.fail(f"saved checkpoint {cp.source} (size {cp.size}) is beyond the stored "
                        f"log of {report.tree_size} entries: the log was truncated",
                        report.tree_size)
            continue
        if root == cp.root:
            agreeing = max(agreeing, cp.size)
            continue
        report.bad_range = (agreeing, cp.size)
        where = (f"entry {agreeing}" if cp.size - agreeing == 1
                 else f"entries {agreeing}..{cp.size - 1}")
        report.fail(f"saved checkpoint {cp.source} (size {cp.size}) disagrees with the log: "
                    f"history was rewritten at {where}", agreeing)
        return


def _check_tiles(report: AuditReport, stored: dict[tuple[int, int], bytes],
                 store: MemoryTileStore, size: int, start: int = 0) -> None:
    """The stored tiles of ``size`` must equal the recomputed ones (with ``start``: those
    that changed after ``start``; :func:`_check_stored_tree` checked the others)."""
    before = set(tiles_for_size(start)) if start else set()
    for tile in tiles_for_size(size):
        if tile in before:
            continue
        want = store.read_tiles([tile])[0]
        have = stored.get((tile.level, tile.index), b"")[: tile.width * 32]
        if have != want:
            first = next((i for i in range(tile.width)
                          if have[i * 32:(i + 1) * 32] != want[i * 32:(i + 1) * 32]), 0)
            index = (tile.index * 256 + first) << (8 * tile.level)
            report.fail(f"stored tile {tile.path} differs from the recomputed tree", index)
            return




def _check_tile_nodes(report: AuditReport, stored: dict[tuple[int, int], bytes],
                      store: MemoryTileStore, start: int = 0) -> None:
    """The stored subtree hashes of full tiles (``tile_nodes``, what proofs are built
    from) must equal those of the recomputed tree. With ``start`` (``--since``) only the
    tiles that became full after it are recomputed; the older rows are left to the full
    audit (and every proof built from them is verified against the signed root before it
    is served). A row for a tile that is not full in the audited tree is reported too."""
    recomputed = store.nodes()
    before = {(t.level, t.index) for t in tiles_for_size(start) if not t.is_partial}
    for key in sorted(stored, key=lambda k: (k[1] << (8 * k[0]), k[0])):
        if key in before:
            continue
        level, idx = key
        lo = (idx * 256) << (8 * level)
        want = recomputed.get(key)
        if want is None:
            report.fail(f"stored subtree hashes of tile/{level}/{idx}: not a full tile of "
                        "the audited tree", lo)
            return
        if stored[key] != want:
            report.fail(f"stored subtree hashes of {Tile(level, idx).path} (tile_nodes) "
                        "differ from the recomputed tree: proofs of entries "
                        f"{lo}..{lo + (256 << (8 * level)) - 1} are refused", lo)
            return


def _check_stored_tree(report: AuditReport, stored: dict[tuple[int, int], bytes],
                       since: _Checkpoint) -> bool:
    """``--since``: is the stored tree at ``since.size`` the one ``since.root`` commits to?

    Every stored full tile must hash (MTH) to its entry in the tile above, and the root
    rebuilt from the stored tiles must be the checkpoint's. Then, unless SHA-256 has a
    collision, every stored hash of the old tree (every leaf hash in the level-0 tiles,
    every subtree hash above) is the audited one: a change to an old entry that reached
    the tree, or to any stored tree hash, is caught here, without reading an old entry.
    What is not read: the old rows of ``log_entries`` and of the record tables. An old
    record or entry edited without its leaf (so that it no longer hashes to it) is left
    to the full audit, and to anyone who checks an inclusion proof for it.
    """
    size = since.size
    for tile in tiles_for_size(size):
        data = stored.get((tile.level, tile.index), b"")
        if len(data) < tile.width * 32:
            report.fail(f"stored tile {tile.path} is missing or short: the stored tree "
                        f"does not reach the --since checkpoint (size {size}); the log was "
                        "truncated or its tiles deleted",
                        (tile.index * 256) << (8 * tile.level))
            return False
        if tile.is_partial:
            continue
        parent = stored.get((tile.level + 1, tile.index >> 8), b"")
        at = (tile.index & 255) * 32
        if _mth_aligned(data[:FULL_TILE_BYTES]) != parent[at:at + 32]:
            lo = (tile.index * 256) << (8 * tile.level)
            report.fail(f"stored tile {tile.path} does not hash to its entry in the tile "
                        f"above: the stored tree was changed at entries "
                        f"{lo}..{lo + (256 << (8 * tile.level)) - 1}", lo)
            return False
    reader = MemoryTileStore()
    reader.write_tiles({t: stored[(t.level, t.index)][: t.width * 32]
                        for t in tiles_for_size(size)})
    if root_from_tiles(size, reader) != since.root:
        report.fail(f"the stored tree at size {size} does not have the --since checkpoint's "
                    f"root: an entry before {size} was changed", 0)
        report.bad_range = (0, size)
        return False
    return True


def _check_served_consistency(report: AuditReport, old: _Checkpoint, new: _Checkpoint,
                              stored: dict[tuple[int, int], bytes]) -> None:
    """The consistency proof the log serves (from its stored tiles, as
    ``/v1/log/consistency`` does) must verify from the --since checkpoint to the latest."""
    if new.size <= old.size:
        return
    reader = MemoryTileStore()
    try:
        reader.write_tiles({t: stored.get((t.level, t.index), b"")[: t.width * 32]
                            for t in tiles_for_size(new.size)})
        proof = consistency_proof_from_tiles(old.size, new.size, reader)
        verify_consistency(old.size, new.size, proof, old.root, new.root)
    except LedgerError as exc:
        report.fail(f"the consistency proof {old.size} -> {new.size} from the stored tiles "
                    f"does not verify: {exc.message}", old.size)


def _fold_old_trails(conn: Any, start: int, ctx: _Context) -> None:
    """``--since``: the signed events before ``start`` of every dispute with an event from
    ``start`` on, folded first, and the old verdicts their trails name, so that the new
    events and those disputes' rows are checked against the whole trail (the old records'
    bytes are not checked against their entries here: that is the full audit's)."""
    with conn.cursor() as cur:
        if not _table_exists(cur, "dispute_events"):
            return
        cur.execute("SELECT log_index, dsse FROM dispute_events WHERE log_index < %s AND "
                    "dispute_id IN (SELECT dispute_id FROM dispute_events "
                    "WHERE log_index >= %s) ORDER BY log_index", (start, start))
        for idx, dsse_bytes in cur.fetchall():
            try:
                signed = _event_view(bytes(dsse_bytes))
            except LedgerError:
                continue  # the full audit reports it
            _trail(ctx, signed, idx).add(signed, idx)
        # the verdicts before ``start`` that those trails name (their outcome is checked)
        named = [t.verdict_id for t in ctx.trails.values() if t.verdict_id is not None]
        if not named or not _table_exists(cur, "verdicts"):
            return
        cur.execute("SELECT log_index, dsse FROM verdicts WHERE log_index < %s AND "
                    "verdict_id = ANY(%s)", (start, named))
        for idx, dsse_bytes in cur.fetchall():
            try:
                verdict = views.verdict_view(bytes(dsse_bytes))
            except LedgerError:
                continue
            ctx.verdicts.setdefault(verdict["verdict_id"], (idx, verdict["outcome"]))
