"""`ledger export` and ``GET /v1/export``: write a bundle (see :mod:`ledger.core.bundle`)
for a selection of envelopes, every proof against one checkpoint, in one repeatable-read
snapshot so the bundle is internally consistent while ingest goes on.

The records are written first to a temporary file (hashing them as they go), because the
header's manifest, signed with the ledger's service key, names their digest; then the
header and the records are yielded. Every admin_event record (the key registry) travels
with the bundle, first, so a verifier with a trust policy can tell which producer and
worker keys the ledger vouched for."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import queue
import stat
import tempfile
import threading
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, BinaryIO

import orjson
from psycopg import sql
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

from ledger.core.bundle import (
    FORMAT,
    dsse_line_digest,
    header_bytes,
    record_prefix,
    record_prefix_format,
)
from ledger.core.keys import public_raw
from ledger.core.logentry import dsse_digest
from ledger.core.note import format_verifier_key
from ledger.core.sealing import MAGIC as SEALED
from ledger.core.sealing import KeyEncryptionKey
from ledger.core.statements import bundle_statement
from ledger.db.models import SigningKey
from ledger.db.session import raw_connection
from ledger.errors import BadRequest, Conflict
from ledger.log.proofs import BundleProofs, NotYetIntegrated
from ledger.log.signer import log_verifiers
from ledger.log.witnessing import export_checkpoint
from ledger.privacy.keys import ErasedContent, Opener, kek_from_settings
from ledger.producer import sign_statement
from ledger.replay.records import Signer, require_signer
from ledger.settings import get_settings


@dataclass(frozen=True)
class Selection:
    recorded_after: datetime | None = None
    recorded_before: datetime | None = None
    model_sha256: str | None = None
    fingerprint_id: str | None = None
    request_ids: Sequence[str] = field(default_factory=tuple)
    limit: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["request_ids"] = list(self.request_ids)
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in d.items()
                if v not in (None, [], ())}


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def key_records(session: Session) -> list[dict[str, Any]]:
    rows = session.scalars(select(SigningKey).order_by(SigningKey.created_at, SigningKey.keyid))
    return [{"keyid": k.keyid, "public_key": _b64(k.public_key), "purpose": k.purpose,
             "name": k.name, "status": k.status, "not_before": k.not_before.isoformat(),
             "not_after": k.not_after.isoformat() if k.not_after else None,
             "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}
            for k in rows]


def bundle_lines(engine: Engine, selection: Selection, signer: Signer | None = None,
                 kek: KeyEncryptionKey | None = None) -> Iterator[bytes]:
    """Yield the bundle line by line (newline-terminated bytes). ``signer`` is the ledger's
    service key (default: LEDGER_SERVICE_KEY_FILE); without one nothing is exported.
    Envelopes encrypted at rest are opened with ``kek`` (default: LEDGER_KEK_FILE); an
    erased one travels as a tombstone line, after the erasure records that state it."""
    with _spooled(engine, selection, signer, kek) as (header, _count, spool):
        yield header
        yield from spool


def bundle_chunks(engine: Engine, selection: Selection, signer: Signer | None = None,
                  kek: KeyEncryptionKey | None = None) -> Iterator[bytes]:
    """:func:`bundle_lines` for streams (HTTP): the header line first, then the records
    in chunks of about a MiB that need not end at a line's end (a line at a time costs
    a write call per record)."""
    with _spooled(engine, selection, signer, kek) as (header, _count, spool):
        yield header
        while chunk := spool.read(_CHUNK):
            yield chunk


def write_bundle(engine: Engine, selection: Selection, out: BinaryIO,
                 signer: Signer | None = None, kek: KeyEncryptionKey | None = None) -> int:
    """:func:`bundle_lines` written to ``out`` (`ledger export`). Into a regular file the
    records are written once, where they belong: they are counted first (the same
    snapshot), which fixes the header's length, so they go after a gap of that length and
    the header into it at the end (a spool and a copy of it took a fifth of a whole-log
    export's time). Anything else with a file descriptor (a pipe) gets the header, then
    the spool inside the kernel (``sendfile``). Returns how many records were written."""
    if not _is_regular_file(out):
        with _spooled(engine, selection, signer, kek) as (header, count, spool):
            out.write(header)
            out.flush()
            spool.flush()
            fd, src, sent = out.fileno(), spool.fileno(), 0
            while n := os.sendfile(fd, src, sent, 1 << 30):   # a pipe has no position
                sent += n
        return count
    with _export(engine, selection, signer, kek) as export:
        expected = export.count()
        start = out.tell()
        gap = len(export.header(expected, "0" * 64))
        out.seek(start + gap)
        count, records_sha256 = export.write_records(out)
        header = export.header(count, records_sha256)
        if count != expected or len(header) != gap:   # one snapshot: cannot happen
            raise AssertionError(f"counted {expected} records, wrote {count}")
        end = out.tell()
        out.seek(start)
        out.write(header)
        out.seek(end)
    return count


def _is_regular_file(out: BinaryIO) -> bool:
    """Whether the records can go straight into ``out``: a regular file, seekable and not
    opened to append (every write of which would land at the end, the header too)."""
    try:
        fd = out.fileno()
        return (out.seekable() and stat.S_ISREG(os.fstat(fd).st_mode)
                and not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)
    except (OSError, ValueError, AttributeError):
        return False


_CHUNK = 1 << 20


@contextmanager
def _spooled(engine: Engine, selection: Selection, signer: Signer | None,
             kek: KeyEncryptionKey | None) -> Iterator[tuple[bytes, int, BinaryIO]]:
    """(the header line, how many records, the spool file of the records at its start),
    for as long as the context lasts."""
    with _export(engine, selection, signer, kek) as export, \
            tempfile.TemporaryFile() as spool:
        count, records_sha256 = export.write_records(spool)
        spool.seek(0)
        yield export.header(count, records_sha256), count, spool


@contextmanager
def _export(engine: Engine, selection: Selection, signer: Signer | None,
            kek: KeyEncryptionKey | None) -> Iterator[_Export]:
    """The export of ``selection`` at the latest exportable checkpoint, in one read-only
    snapshot (REPEATABLE READ) for as long as the context lasts: its record count, its
    records written to a file and its header are all of the same records."""
    if kek is None:
        kek = kek_from_settings(get_settings())
    if signer is None:
        signer = Signer.from_file(get_settings().service_key_file, "ledger", "ledger-service")
    signer = require_signer(signer, "an export (its manifest is signed)")
    if selection.recorded_after and selection.recorded_after.tzinfo is None:
        raise BadRequest("recorded_after needs a UTC offset")
    with Session(engine) as session:
        session.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        conn = raw_connection(session)
        cp = export_checkpoint(session, len(get_settings().witnesses))
        if cp is None:
            raise NotYetIntegrated("the log has no checkpoint yet; nothing to export")
        origin = cp.note.decode().split("\n", 1)[0]
        where = ["log_index < %s"]
        params: list[Any] = [cp.tree_size]
        for condition, value in (("recorded_at >= %s", selection.recorded_after),
                                 ("recorded_at < %s", selection.recorded_before),
                                 ("model_sha256 = %s", selection.model_sha256),
                                 ("fingerprint_id = %s", selection.fingerprint_id)):
            if value:
                where.append(condition)
                params.append(value)
        if selection.request_ids:
            where.append("request_id = ANY(%s)")
            params.append(list(selection.request_ids))
        limit = f" LIMIT {int(selection.limit)}" if selection.limit else ""
        sel = (f"SELECT log_index FROM envelopes WHERE {' AND '.join(where)} "  # noqa: S608
               f"ORDER BY log_index{limit}")
        # The selected envelopes, then the verdicts on them and the events of disputes
        # on them: the whole review trail travels with the records it reviews.
        # Every piece of these queries is ours (column lists, the bound parameters'
        # placeholders); values only ever travel as parameters.
        parts = [
            ("admin_event", "SELECT a.log_index, a.event_id, a.dsse FROM admin_events a "
                            "WHERE a.log_index < %s"),
            ("erasure", "SELECT x.log_index, x.erasure_id, x.dsse FROM erasures x "
                        "WHERE x.log_index < %s"),
            ("envelope", f"SELECT v.log_index, v.request_id, v.dsse, v.dsse_sha256 "  # noqa: S608
                         f"FROM envelopes v JOIN ({sel}) s USING (log_index)"),
            ("verdict", f"SELECT r.log_index, r.verdict_id, r.dsse FROM verdicts r "  # noqa: S608
                        f"JOIN ({sel}) s ON s.log_index = r.envelope_index "
                        f"WHERE r.log_index < %s"),
            ("dispute_event", f"SELECT e.log_index, e.event_id, e.dsse "  # noqa: S608
                              f"FROM dispute_events e "
                              f"JOIN disputes d ON d.id = e.dispute_id "
                              f"JOIN ({sel}) s ON s.log_index = d.envelope_index "
                              f"WHERE e.log_index < %s"),
            # replay matrix reports (0016) travel with every bundle, as admin events do
            ("matrix_run", "SELECT m.log_index, m.run_id, m.dsse FROM matrix_runs m "
                           "WHERE m.log_index < %s"),
        ]
        if len(where) == 1 and not limit:
            # The whole log: the same records, each table read in index order (a join of
            # every envelope with itself would sort the whole log's DSSE bytes first).
            in_log = ("EXISTS (SELECT 1 FROM envelopes v WHERE v.log_index = {col} "
                      "AND v.log_index < %s)")
            verdicts_in = in_log.format(col="r.envelope_index")
            events_in = in_log.format(col="d.envelope_index")
            whole = {
                "envelope": "SELECT v.log_index, v.request_id, v.dsse, v.dsse_sha256 "
                            "FROM envelopes v WHERE v.log_index < %s",
                "verdict": "SELECT r.log_index, r.verdict_id, r.dsse "  # noqa: S608
                           f"FROM verdicts r WHERE {verdicts_in} AND r.log_index < %s",
                "dispute_event": "SELECT e.log_index, e.event_id, e.dsse "  # noqa: S608
                                 "FROM dispute_events e JOIN disputes d "
                                 f"ON d.id = e.dispute_id WHERE {events_in} "
                                 "AND e.log_index < %s",
            }
            parts = [(kind, whole.get(kind, query)) for kind, query in parts]
        yield _Export(session, conn, cp, origin, parts, params, selection, signer, kek)


@dataclass
class _Export:
    """One export's snapshot and queries (see :func:`_export`)."""

    session: Session
    conn: Any
    cp: Any
    origin: str
    parts: list[tuple[str, str]]
    params: list[Any]
    selection: Selection
    signer: Signer
    kek: KeyEncryptionKey | None
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def _args(self, kind: str) -> list[Any]:
        size = self.cp.tree_size
        return {"admin_event": [size], "erasure": [size], "matrix_run": [size],
                "envelope": self.params}.get(kind, [*self.params, size])

    def count(self) -> int:
        """How many records :meth:`write_records` writes (the same snapshot)."""
        with self.conn.cursor() as cur:
            total = 0
            for kind, query in self.parts:
                cur.execute(f"SELECT count(*) FROM ({query}) q", self._args(kind))  # noqa: S608
                total += int(cur.fetchone()[0])
            return total

    def header(self, count: int, records_sha256: str) -> bytes:
        """The header line of ``count`` records with this records digest (its length
        depends on the count alone: the digest is 64 hex digits, the signature 64 bytes,
        ``created_at`` fixed when the export began)."""
        manifest = {
            "format": FORMAT, "origin": self.origin, "checkpoint": self.cp.note.decode(),
            "log_keys": [format_verifier_key(v.name, v.public_key)
                         for v in log_verifiers(self.session, self.origin)],
            "service_keys": [_b64(public_raw(self.signer.key))],
            "keys": key_records(self.session), "selection": self.selection.to_json(),
            "records": count, "created_at": self.created_at,
        }
        statement = bundle_statement(records_sha256=records_sha256, predicate=manifest)
        return header_bytes(count, sign_statement(statement, self.signer.key)) + b"\n"

    def write_records(self, dest: BinaryIO) -> tuple[int, str]:
        """Every record line written to ``dest`` from where it stands: (records, the
        records digest, hex)."""
        conn, cp = self.conn, self.cp
        with _Spooler(dest) as spooler:
            suffix_of = BundleProofs(conn.cursor(), cp).record_suffix
            opener = Opener(conn.cursor(), self.kek)
            for n, (kind, query) in enumerate(self.parts):
                prefix_format = record_prefix_format(kind)  # of a dsse member
                with _Prefetched(conn, f"export_{n}", f"{query} ORDER BY 1",
                                 self._args(kind)) as blocks:
                    for block in blocks:
                        # binary rows: bytea is bytes already, text is str. A line goes
                        # to the spool as its pieces (prefix, signed member, suffix,
                        # newline), joined there: one copy of the DSSE
                        parts: list[bytes] = []
                        digests: list[bytes] = []  # each line's (v3: bundle.line_digest)
                        if kind == "envelope":
                            for log_index, ref, stored, stored_sha256 in block:
                                # sealed at rest: opened, or its tombstone if erased
                                name, member = (_envelope_member(opener, stored,
                                                                 stored_sha256, log_index)
                                                if stored.startswith(SEALED)
                                                else (b"dsse", stored))
                                prefix = (prefix_format % (log_index, orjson.dumps(ref))
                                          if name == b"dsse"
                                          else record_prefix(log_index, kind, ref, name))
                                suffix = suffix_of(log_index)
                                # the stored digest of an envelope's bytes (a wrong one
                                # makes a bundle that ``ledger verify`` refuses, not a
                                # false one)
                                digests.append(
                                    dsse_line_digest(prefix, stored_sha256.hex(), suffix)
                                    if name == b"dsse" else _line_sha256(prefix, member, suffix))
                                parts += (prefix, member, suffix, b"\n")
                        else:
                            for log_index, ref, member in block:
                                prefix = prefix_format % (log_index, orjson.dumps(ref))
                                suffix = suffix_of(log_index)
                                digests.append(dsse_line_digest(prefix, dsse_digest(member),
                                                                suffix))
                                parts += (prefix, member, suffix, b"\n")
                        spooler.add(parts, digests)
            return spooler.finish()


def _line_sha256(*pieces: bytes) -> bytes:
    """SHA-256 of a line given as its pieces (without the newline)."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


class _Prefetched:
    """The rows of ``query`` in blocks, from a cursor declared on the server, each block
    asked for (in pipeline mode) before the one before it is handed out: the database
    finds and sends the next block while this one is formatted, where a plain fetch
    would leave one side idle while the other works (a fetch thread of its own did not
    overlap as well: it waits for the GIL). The connection stays usable for the
    caller's other statements meanwhile (queued after the fetch in flight: the same
    transaction, the same snapshot)."""

    BLOCK = 1000

    def __init__(self, conn: Any, name: str, query: str, params: Sequence[Any]) -> None:
        self._blocks = self._read(conn, name, query, params)

    def _read(self, conn: Any, name: str, query: str, params: Sequence[Any]
              ) -> Generator[list[Any], None, None]:
        with conn.cursor(name=name) as declared:
            declared.execute(query, params)  # DECLARE, nothing fetched
            fetch = sql.SQL("FETCH FORWARD {} FROM {}").format(
                sql.Literal(self.BLOCK), sql.Identifier(name))
            ahead, spare = conn.cursor(binary=True), conn.cursor(binary=True)
            with conn.pipeline():
                ahead.execute(fetch)
                while True:
                    spare.execute(fetch)  # the next block, asked for now
                    block = ahead.fetchall()
                    if not block:
                        break
                    yield block
                    ahead, spare = spare, ahead

    def __iter__(self) -> Iterator[list[Any]]:
        return self._blocks

    def __enter__(self) -> _Prefetched:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._blocks.close()  # also when the caller stopped early or failed


class _Spooler:
    """Records on their way to the spool file, in a thread of its own, their line
    digests folded into the records digest as they go: the file's writes release the
    GIL, so they overlap the formatting of the next records and the database's fetches.
    At most a few batches wait; an error in the thread is raised in the caller's next
    call."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.count = 0
        self._queue: queue.Queue[tuple[list[bytes], list[bytes]] | None] = queue.Queue(
            maxsize=8)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="export-spool", daemon=True)
        self._thread.start()

    def add(self, batch: list[bytes], digests: list[bytes]) -> None:
        """Spool ``batch``, record lines (or their pieces, in order), and their line
        digests, one a record (the caller gives both up: they are written later)."""
        self._raise()
        self.count += len(digests)
        self._queue.put((batch, digests))

    def finish(self) -> tuple[int, str]:
        """Wait for everything to be written: (records, SHA-256 of them, hex)."""
        self._stop()
        self._raise()
        return self.count, self.digest.hexdigest()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    batch, digests = item
                    self.digest.update(b"".join(digests))
                    self.file.write(b"".join(batch))
                except BaseException as exc:  # noqa: BLE001 - raised in the caller
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def __enter__(self) -> _Spooler:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop()  # also when the export failed or its reader stopped early


def _envelope_member(opener: Opener, stored: bytes, digest: bytes,
                     log_index: int) -> tuple[bytes, bytes]:
    """(member name, value): ``dsse`` and the DSSE bytes (opened where encrypted at
    rest), or ``tombstone`` and its JSON for an erased envelope."""
    try:
        return b"dsse", opener.open(stored, digest, log_index)
    except ErasedContent as erased:
        if erased.tombstone is None:
            raise Conflict(f"the envelope at log index {log_index} is unreadable: "
                           f"{erased.reason}; run `ledger audit`",
                           code="unreadable_record") from None
        return b"tombstone", orjson.dumps(erased.tombstone.served())
