"""Checkpoint sinks: a copy of every checkpoint outside the database.

A sink is written once per checkpoint and never overwritten: if a file for a tree size
exists with other content, the log has shown two different trees of the same size (a
split view) and the sink refuses loudly. The directory sink is the one shipped; object
storage or witnesses implement the same two methods.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

log = logging.getLogger("ledger.sink")


class SplitViewError(RuntimeError):
    pass


class CheckpointSink(Protocol):
    def publish(self, tree_size: int, note: bytes) -> None: ...

    def latest_size(self) -> int | None: ...


class DirectorySink:
    """``<dir>/checkpoint.<tree size>`` per checkpoint plus ``<dir>/checkpoint`` (latest)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path_for(self, tree_size: int) -> Path:
        return self.dir / f"checkpoint.{tree_size:020d}"

    def publish(self, tree_size: int, note: bytes) -> None:
        path = self.path_for(tree_size)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if path.read_bytes() != note:
                raise SplitViewError(f"{path} holds a different checkpoint of size "
                                     f"{tree_size}: two views of the log") from None
            return
        with os.fdopen(fd, "wb") as fh:
            fh.write(note)
            fh.flush()
            os.fsync(fh.fileno())
        latest = self.latest_size()
        if latest is None or tree_size >= latest:
            tmp = self.dir / ".checkpoint.tmp"
            tmp.write_bytes(note)
            os.replace(tmp, self.dir / "checkpoint")

    def latest_size(self) -> int | None:
        sizes = [int(p.name.split(".")[1]) for p in self.dir.glob("checkpoint.*")
                 if p.name.split(".")[1].isdigit()]
        return max(sizes) if sizes else None

    def all_sizes(self) -> list[int]:
        return sorted(int(p.name.split(".")[1]) for p in self.dir.glob("checkpoint.*")
                      if p.name.split(".")[1].isdigit())

    def read(self, tree_size: int) -> bytes:
        return self.path_for(tree_size).read_bytes()


def sink_from_settings(directory: Path | None) -> DirectorySink | None:
    return DirectorySink(directory) if directory else None
