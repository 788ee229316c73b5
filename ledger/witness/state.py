"""The witness's durable state: for each log origin, the size and root hash of the latest
checkpoint it cosigned. One JSON file, replaced atomically (write a temporary file, fsync
it, rename it over the old one, fsync the directory), so a crash leaves either the old
state or the new one, never a torn file and never a state the witness did not reach.

The file belongs to the witness alone: it is never the log's database, which is what the
witness exists to check.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ledger.core.errors import LedgerError
from ledger.core.merkle import EMPTY_ROOT

STATE_VERSION = 1


class StateError(LedgerError):
    code = "witness_state"


@dataclass(frozen=True, slots=True)
class LogState:
    size: int
    root_hash: bytes


EMPTY = LogState(0, EMPTY_ROOT)


class WitnessState:
    """The state file, with a lock that serialises check-and-update across threads (a
    ``threading.Lock``) and across processes sharing the file (``flock`` on a lock file)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._read()  # fail at start-up, not at the first request

    def _read(self) -> dict[str, LogState]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot read the witness state {self.path}: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION or \
                not isinstance(doc.get("logs"), dict):
            raise StateError(f"{self.path} is not a witness state file (version 1)")
        out = {}
        for origin, entry in doc["logs"].items():
            try:
                out[origin] = LogState(int(entry["size"]), base64.b64decode(entry["root_hash"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise StateError(f"{self.path}: bad entry for {origin!r}") from exc
        return out

    def _write(self, logs: dict[str, LogState]) -> None:
        doc = {"version": STATE_VERSION, "logs": {
            origin: {"size": s.size, "root_hash": base64.b64encode(s.root_hash).decode()}
            for origin, s in sorted(logs.items())}}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, (json.dumps(doc, indent=1) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def get(self, origin: str) -> LogState:
        return self._read().get(origin, EMPTY)

    def all(self) -> dict[str, LogState]:
        return self._read()

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Hold the lock, read the state, and write it back (durably) if it was changed:
        the check of ``old`` and the update are one atomic step, as the spec requires."""
        with self._lock, self._lock_path.open("a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                txn = Transaction(self._read())
                yield txn
                if txn.changed:
                    self._write(txn.logs)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)


class Transaction:
    def __init__(self, logs: dict[str, LogState]) -> None:
        self.logs = logs
        self.changed = False

    def get(self, origin: str) -> LogState:
        return self.logs.get(origin, EMPTY)

    def set(self, origin: str, state: LogState) -> None:
        if self.logs.get(origin) != state:
            self.logs[origin] = state
            self.changed = True
