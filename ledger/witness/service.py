"""What a witness checks before it cosigns (C2SP tlog-witness ``add-checkpoint``).

In order: the body parses (400); the origin is one the witness is configured for (404); a
log key it trusts for that origin signed the checkpoint (403); ``old`` is not above the
checkpoint's size (400); ``old`` is the size it last cosigned for that origin (409, with
that size); at equal sizes the root hashes agree (409), otherwise the consistency proof
leads from its stored root to the new one (422). Only then does it record the new size and
root durably, and only after that does it sign.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ledger.core.cosignature import WitnessSigner
from ledger.core.errors import (
    CheckpointError,
    ConsistencyProofError,
    LedgerError,
    MalformedCheckpointError,
    MalformedNoteError,
)
from ledger.core.merkle import verify_consistency
from ledger.core.note import NoteVerifier, open_note, parse_checkpoint
from ledger.witness.protocol import MalformedRequest, parse_add_checkpoint
from ledger.witness.state import LogState, WitnessState

log = logging.getLogger("ledger.witness")


class Refused(LedgerError):
    """The witness will not cosign; ``status`` is the HTTP status the spec names."""

    status = 400
    code = "witness_refused"


class BadRequest(Refused):
    status = 400
    code = "bad_request"


class UnknownOrigin(Refused):
    status = 404
    code = "unknown_origin"


class NotSignedByLog(Refused):
    status = 403
    code = "not_signed_by_log"


class SizeConflict(Refused):
    status = 409
    code = "old_size_conflict"

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class InconsistentCheckpoint(Refused):
    status = 422
    code = "inconsistent_checkpoint"


@dataclass(frozen=True)
class WitnessConfig:
    signer: WitnessSigner
    logs: Mapping[str, tuple[NoteVerifier, ...]]
    """Log origin -> the log keys trusted for it (a key's name is the origin)."""
    evidence_dir: Path | None = None
    """Where refused-but-validly-signed requests (possible proof of a fork) are kept."""

    @classmethod
    def from_keys(cls, signer: WitnessSigner, log_keys: Iterable[NoteVerifier],
                  evidence_dir: Path | None = None) -> WitnessConfig:
        logs: dict[str, list[NoteVerifier]] = {}
        for key in log_keys:
            logs.setdefault(key.name, []).append(key)
        return cls(signer, {o: tuple(k) for o, k in logs.items()}, evidence_dir)


@dataclass
class Witness:
    config: WitnessConfig
    state: WitnessState
    clock: Callable[[], float] = field(default=time.time)

    def _now(self) -> int:
        return int(self.clock())

    def add_checkpoint(self, body: bytes) -> list[str]:
        """Check one ``add-checkpoint`` body; return the cosignature lines or raise
        :class:`Refused`."""
        try:
            req = parse_add_checkpoint(body)
        except MalformedRequest as exc:
            raise BadRequest(exc.message) from exc
        origin = req.note.split(b"\n", 1)[0].decode("utf-8", "replace")
        verifiers = self.config.logs.get(origin)
        if verifiers is None:
            raise UnknownOrigin(f"this witness does not know the log {origin[:100]!r}")
        try:
            opened = open_note(req.note, verifiers)
            checkpoint = parse_checkpoint(opened.text, origin=origin)
        except (MalformedNoteError, MalformedCheckpointError) as exc:
            raise BadRequest(exc.message) from exc
        except CheckpointError as exc:
            raise NotSignedByLog(f"no trusted key of {origin} signed the checkpoint: "
                                 f"{exc.message}") from exc
        if req.old_size > checkpoint.size:
            raise BadRequest(f"old size {req.old_size} is above the checkpoint size "
                             f"{checkpoint.size}")
        if req.old_size == 0 and req.proof:
            raise BadRequest("the consistency proof from size 0 is empty")
        with self.state.transaction() as txn:
            current = txn.get(origin)
            if req.old_size != current.size:
                raise SizeConflict(f"the latest cosigned size is {current.size}", current.size)
            if checkpoint.size == current.size:
                if checkpoint.root_hash != current.root_hash:
                    self._keep_evidence(origin, body, "same size, different root")
                    raise SizeConflict(f"a different root hash at size {current.size}",
                                       current.size)
            elif current.size > 0:
                try:
                    verify_consistency(current.size, checkpoint.size, req.proof,
                                       current.root_hash, checkpoint.root_hash)
                except ConsistencyProofError as exc:
                    self._keep_evidence(origin, body, exc.message)
                    raise InconsistentCheckpoint(
                        f"not consistent with the cosigned size {current.size}: "
                        f"{exc.message}") from exc
            txn.set(origin, LogState(checkpoint.size, checkpoint.root_hash))
        # the with block has written the state (fsynced) before we sign and answer
        return [self.config.signer.cosign(opened.text, self._now())]

    def _keep_evidence(self, origin: str, body: bytes, why: str) -> None:
        log.warning("refused a validly signed checkpoint of %s: %s", origin, why)
        if self.config.evidence_dir is None:
            return
        try:
            self.config.evidence_dir.mkdir(parents=True, exist_ok=True)
            path = self.config.evidence_dir / f"refused-{time.time_ns()}.txt"
            path.write_bytes(f"# {origin}: {why}\n".encode() + body)
        except OSError as exc:
            log.warning("could not keep the evidence: %s", exc)
