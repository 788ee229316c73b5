"""The durable on-disk spool: signed envelopes wait here until the ledger has them.

Why SQLite in WAL mode with ``synchronous=FULL``: every commit is fsync'd to the
write-ahead log before it returns, so an envelope that is in the spool survives a crash
of the gateway process and a power loss; each state change (spooled -> delivered, or
-> quarantined) is one atomic transaction, so an envelope is never half-moved; the file
is locked for concurrent threads and processes; and SQLite is in the standard library.
A directory of fsync'd files would need the same care (fsync of file *and* directory,
atomic renames) and a directory scan per batch.

Exactly once: the spool keeps the *signed bytes*, so every retry sends the same envelope;
the ledger is idempotent on ``request_id`` (201 created, 200 the same bytes again), so a
retry after a lost answer is harmless and the row is deleted only after the ledger said
201 or 200. A 409 (other bytes under the same request_id) or another 4xx moves the row to
the ``quarantine`` table with the ledger's problem document, for a human to look at.

Quota: ``max_bytes`` bounds the envelope bytes held (pending plus quarantined). What
happens when it is full is the recorder's ``when_full`` policy (see
:class:`ledger.capture.recorder.Recorder`). SQLite reuses freed pages; the file itself
does not shrink.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPOOL_FILE = "spool.sqlite3"
SHIP_LOCK_FILE = "ship.lock"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL,
    body BLOB NOT NULL,                 -- the signed DSSE envelope, JSON bytes
    size INTEGER NOT NULL,
    spooled_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL DEFAULT 0,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS pending_due ON pending (next_attempt_at, seq);
CREATE TABLE IF NOT EXISTS quarantine (
    seq INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL,
    body BLOB NOT NULL,
    size INTEGER NOT NULL,
    spooled_at REAL NOT NULL,
    quarantined_at REAL NOT NULL,
    status INTEGER,                     -- the ledger's HTTP status, NULL: refused locally
    problem TEXT NOT NULL               -- the problem document (JSON)
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class SpoolFull(RuntimeError):
    """The spool holds ``max_bytes`` of envelopes: nothing more can be recorded now."""


@dataclass(frozen=True)
class SpooledEnvelope:
    seq: int
    request_id: str
    body: bytes
    attempts: int


@dataclass(frozen=True)
class QuarantinedEnvelope:
    seq: int
    request_id: str
    body: bytes
    status: int | None
    problem: dict[str, Any]
    quarantined_at: float


class Spool:
    """Pending and quarantined envelopes in one SQLite file; safe to share between threads
    (each thread gets its own connection)."""

    def __init__(self, directory: str | Path, *, max_bytes: int = 1 << 30) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / SPOOL_FILE
        self.max_bytes = max_bytes
        self._local = threading.local()
        self._lock = threading.Lock()
        self._db().executescript(_SCHEMA)       # idempotent; executescript commits itself
        self._bytes = self._count_bytes()

    # ------------------------------------------------------------------ connections
    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            self._local.db = db
        return db

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close_thread_connection(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def _count_bytes(self) -> int:
        row = self._db().execute(
            "SELECT (SELECT COALESCE(SUM(size), 0) FROM pending) + "
            "(SELECT COALESCE(SUM(size), 0) FROM quarantine)").fetchone()
        return int(row[0])

    @staticmethod
    def _bump(db: sqlite3.Connection, name: str, by: int) -> None:
        db.execute("INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) "
                   "DO UPDATE SET value = value + excluded.value", (name, by))

    # ------------------------------------------------------------------ quota
    @property
    def used_bytes(self) -> int:
        return self._bytes

    def has_room(self, extra: int = 0) -> bool:
        return self._bytes + extra <= self.max_bytes

    def _add_bytes(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    # ------------------------------------------------------------------ writing
    def append(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Spool signed envelopes ``(request_id, body)`` in one durable transaction."""
        if not items:
            return
        now = time.time()
        with self._tx() as db:
            db.executemany(
                "INSERT INTO pending (request_id, body, size, spooled_at) VALUES (?, ?, ?, ?)",
                [(rid, body, len(body), now) for rid, body in items])
            self._bump(db, "spooled", len(items))
        self._add_bytes(sum(len(body) for _, body in items))

    def quarantine_new(self, request_id: str, body: bytes, problem: dict[str, Any]) -> None:
        """Keep an envelope that was refused before it was ever spooled (e.g. invalid)."""
        now = time.time()
        with self._tx() as db:   # take the seq from pending's sequence: seqs stay unique
            seq = db.execute("INSERT INTO pending (request_id, body, size, spooled_at) "
                             "VALUES (?, ?, ?, ?)", (request_id, body, len(body), now)).lastrowid
            db.execute("INSERT INTO quarantine (seq, request_id, body, size, spooled_at, "
                       "quarantined_at, status, problem) SELECT seq, request_id, body, size, "
                       "spooled_at, ?, NULL, ? FROM pending WHERE seq = ?",
                       (now, json.dumps(problem), seq))
            db.execute("DELETE FROM pending WHERE seq = ?", (seq,))
            self._bump(db, "quarantined", 1)
        self._add_bytes(len(body))

    # ------------------------------------------------------------------ shipping
    def due(self, limit: int, max_bytes: int, now: float | None = None) -> list[SpooledEnvelope]:
        """The oldest pending envelopes whose next attempt is due (at least one if any)."""
        rows = self._db().execute(
            "SELECT seq, request_id, body, attempts FROM pending WHERE next_attempt_at <= ? "
            "ORDER BY seq LIMIT ?", (time.time() if now is None else now, limit)).fetchall()
        out: list[SpooledEnvelope] = []
        total = 0
        for seq, rid, body, attempts in rows:
            if out and total + len(body) > max_bytes:
                break
            out.append(SpooledEnvelope(seq, rid, bytes(body), attempts))
            total += len(body)
        return out

    def next_due_at(self) -> float | None:
        row = self._db().execute("SELECT MIN(next_attempt_at) FROM pending").fetchone()
        return None if row[0] is None else float(row[0])

    def delivered(self, seqs: Sequence[int], *, existing: int = 0) -> None:
        """Delete delivered envelopes (``existing`` of them were already stored: 200).

        Lists of sequence numbers travel as one JSON array parameter (``json_each``), so no
        SQL text is ever built from values.
        """
        if not seqs:
            return
        ids = json.dumps(list(seqs))
        with self._tx() as db:
            size = db.execute("SELECT COALESCE(SUM(size), 0) FROM pending WHERE seq IN "
                              "(SELECT value FROM json_each(?))", (ids,)).fetchone()[0]
            db.execute("DELETE FROM pending WHERE seq IN (SELECT value FROM json_each(?))", (ids,))
            self._bump(db, "delivered", len(seqs))
            if existing:
                self._bump(db, "delivered_existing", existing)
        self._add_bytes(-int(size))

    def quarantine(self, seq: int, status: int | None, problem: dict[str, Any]) -> None:
        """Move a pending envelope the ledger refused for good into quarantine."""
        with self._tx() as db:
            moved = db.execute(
                "INSERT INTO quarantine (seq, request_id, body, size, spooled_at, "
                "quarantined_at, status, problem) SELECT seq, request_id, body, size, "
                "spooled_at, ?, ?, ? FROM pending WHERE seq = ?",
                (time.time(), status, json.dumps(problem), seq)).rowcount
            db.execute("DELETE FROM pending WHERE seq = ?", (seq,))
            if moved:
                self._bump(db, "quarantined", 1)

    def retry_later(self, seqs: Sequence[int], at: float, error: str) -> None:
        if not seqs:
            return
        with self._tx() as db:
            db.execute("UPDATE pending SET attempts = attempts + 1, next_attempt_at = ?, "
                       "last_error = ? WHERE seq IN (SELECT value FROM json_each(?))",
                       (at, error, json.dumps(list(seqs))))

    # ------------------------------------------------------------------ inspection
    def pending_count(self) -> int:
        return int(self._db().execute("SELECT COUNT(*) FROM pending").fetchone()[0])

    def stats(self) -> dict[str, Any]:
        db = self._db()
        pending, pending_bytes = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM pending").fetchone()
        quarantined = db.execute("SELECT COUNT(*) FROM quarantine").fetchone()[0]
        counters = dict(db.execute("SELECT name, value FROM counters").fetchall())
        return {"pending": pending, "pending_bytes": pending_bytes,
                "quarantined": quarantined, "used_bytes": self._bytes,
                "max_bytes": self.max_bytes, "totals": counters}

    def quarantined(self, limit: int = 100) -> list[QuarantinedEnvelope]:
        rows = self._db().execute(
            "SELECT seq, request_id, body, status, problem, quarantined_at FROM quarantine "
            "ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [QuarantinedEnvelope(seq, rid, bytes(body), status, json.loads(problem), at)
                for seq, rid, body, status, problem, at in rows]

    def requeue(self, seqs: Sequence[int]) -> int:
        """Move quarantined envelopes back to pending (after fixing what refused them)."""
        if not seqs:
            return 0
        ids = json.dumps(list(seqs))
        with self._tx() as db:
            moved = db.execute(
                "INSERT INTO pending (seq, request_id, body, size, spooled_at) SELECT seq, "
                "request_id, body, size, spooled_at FROM quarantine WHERE seq IN "
                "(SELECT value FROM json_each(?)) AND status IS NOT NULL", (ids,)).rowcount
            db.execute("DELETE FROM quarantine WHERE seq IN (SELECT value FROM json_each(?)) "
                       "AND status IS NOT NULL", (ids,))
        return int(moved)


@contextlib.contextmanager
def shipping_lock(directory: str | Path) -> Iterator[bool]:
    """Hold the spool's ship lock if no other process does: yields whether we hold it.

    One shipper per spool keeps delivery in order and avoids sending rows twice at once
    (which would be harmless, the ledger being idempotent, but wasteful).
    """
    fd = os.open(Path(directory) / SHIP_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
