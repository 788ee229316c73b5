"""The log's checkpoint signer: the Ed25519 key from ``LEDGER_LOG_KEY_FILE`` and the name
(the log's origin) that C2SP signed notes carry."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from ledger.core.keys import load_private_pem, public_raw
from ledger.core.note import Checkpoint, NoteVerifier, sign_checkpoint
from ledger.core.trust import TrustPolicy
from ledger.db.models import SigningKey
from ledger.services.keys import register_key
from ledger.settings import Settings

if TYPE_CHECKING:
    from ledger.replay.records import Signer


@dataclass(frozen=True)
class LogSigner:
    origin: str
    key: Ed25519PrivateKey

    @classmethod
    def from_settings(cls, settings: Settings) -> LogSigner | None:
        if settings.log_key_file is None:
            return None
        return cls(settings.log_name, load_private_pem(Path(settings.log_key_file).read_bytes()))

    def sign(self, size: int, root: bytes) -> bytes:
        return sign_checkpoint(Checkpoint(self.origin, size, root), self.origin, self.key)

    @property
    def public_key(self) -> bytes:
        return public_raw(self.key)

    def verifier(self) -> NoteVerifier:
        return NoteVerifier.from_public_key(self.origin, self.public_key)

    def ensure_registered(self, session: Session, registrar: Signer | None = None) -> None:
        """Register the public key (purpose ``log``) so readers can find it; a registry
        leaf when ``registrar`` (the ledger's service key) is given. Checks trust the log
        key from the trust policy, never from this row."""
        from ledger.core.keys import key_id

        if session.get(SigningKey, key_id(self.public_key)) is None:
            register_key(session, public_key=self.public_key, purpose="log", name=self.origin,
                         signer=registrar)


def log_verifiers(db: Session | Connection, origin: str) -> list[NoteVerifier]:
    """Every log key the ledger has registered (revoked ones too: old checkpoints stay
    verifiable), as note verifiers for ``origin``.

    Read from the database being checked, so an insider can add one: for display and
    ``--insecure-dev`` only. Every check that must hold against an insider takes the log
    keys from the trust policy (:func:`trusted_log_verifiers`)."""
    from ledger.db.session import raw_cursor

    with raw_cursor(db) as cur:  # one raw statement: the checkpoint route's hot path
        cur.execute("SELECT public_key FROM signing_keys WHERE purpose = 'log'")
        rows = cur.fetchall()
    return [NoteVerifier.from_public_key(origin, bytes(pk)) for (pk,) in rows]


def trusted_log_verifiers(trust: TrustPolicy, origin: str) -> list[NoteVerifier]:
    """The trust policy's log keys, for a log named ``origin`` (which must be the policy's)."""
    from ledger.core.errors import CheckpointError

    if origin != trust.origin:
        raise CheckpointError(f"the log is named {origin!r}, the trust policy trusts "
                              f"{trust.origin!r}")
    return trust.log_verifiers()
