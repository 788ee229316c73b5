"""Signing the ledger's own records and appending them to the log in one step."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.orm import Session

from ledger.core.keys import key_id, load_private_pem, public_raw
from ledger.db.models import SigningKey
from ledger.db.session import raw_cursor
from ledger.errors import Unavailable
from ledger.producer import sign_statement
from ledger.services import sequencer
from ledger.services.keys import register_key


@dataclass(frozen=True)
class Signer:
    """A private key and the purpose it is registered for (``ledger`` or ``worker``)."""

    key: Ed25519PrivateKey
    purpose: str
    name: str

    @classmethod
    def from_file(cls, path: Path | None, purpose: str, name: str) -> Signer | None:
        if path is None:
            return None
        return cls(load_private_pem(Path(path).read_bytes()), purpose, name)

    @property
    def keyid(self) -> str:
        return key_id(public_raw(self.key))

    def ensure_registered(self, session: Session, registrar: Signer | None = None) -> None:
        """Register this key if it is not. The service key's registration is a registry
        leaf signed by itself; another key's is one when ``registrar`` (the service key)
        is given."""
        if session.get(SigningKey, self.keyid) is None:
            signer = self if self.purpose == "ledger" else registrar
            register_key(session, public_key=public_raw(self.key), purpose=self.purpose,
                         name=self.name, signer=signer)


def require_signer(signer: Signer | None, what: str) -> Signer:
    if signer is None:
        raise Unavailable(f"{what} needs a signing key: set LEDGER_SERVICE_KEY_FILE",
                          retry_after=60)
    return signer


@dataclass(frozen=True)
class Appended:
    log_index: int
    dsse: bytes
    dsse_sha256: str


def append_signed(session: Session, kind: str, ref: str, statement: Mapping[str, Any],
                  signer: Signer) -> Appended:
    """Sign ``statement``, sequence it as a ``kind`` leaf named ``ref``. The caller inserts
    its record row (with the returned log index) in the same transaction."""
    dsse_bytes = sign_statement(statement, signer.key).canonical_bytes()
    digest = hashlib.sha256(dsse_bytes).hexdigest()
    with raw_cursor(session) as cur:
        index = sequencer.append_one(cur, kind, ref, digest)
    return Appended(index, dsse_bytes, digest)
