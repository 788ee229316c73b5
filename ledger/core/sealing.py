"""Encryption at rest: envelope content sealed under per-subject data keys (AES-256-GCM).

Pure: no database, no files. The ledger stores an envelope's DSSE bytes either as
received (no data key: encryption off, or a record from before it) or *sealed*:

    MAGIC (5 bytes, 0x93 "ILS1": never the first byte of JSON) || key_id (16 bytes, the
    data key's UUID) || nonce (12 bytes) || AES-256-GCM(data key, nonce, DSSE bytes,
    aad = MAGIC || key_id || SHA-256(DSSE bytes))

The log leaf still commits to SHA-256 of the DSSE bytes (the plaintext), which the
``envelopes.dsse_sha256`` column holds and the associated data binds: a sealed blob moved
to another record does not open. Data keys are stored only wrapped by the key-encryption
key (KEK), which lives outside the database (:class:`LocalKek`: a file; anything with
``kek_id``/``wrap``/``unwrap`` will do, e.g. a KMS client). Destroying a data key (deleting
its wrapped row) makes every blob sealed under it unreadable for good: crypto-shredding.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ledger.core.errors import VerificationError

MAGIC = b"\x93ILS1"
KEY_ID_SIZE = 16
NONCE_SIZE = 12
HEADER_SIZE = len(MAGIC) + KEY_ID_SIZE + NONCE_SIZE
DATA_KEY_SIZE = 32
_WRAP_AAD = b"inference-ledger data key v1\x00"


class SealError(VerificationError):
    """A sealed blob or wrapped key that does not open (wrong key, changed bytes)."""

    code = "sealed_content"


def is_sealed(stored: bytes) -> bool:
    return stored[:len(MAGIC)] == MAGIC


def sealed_key_id(stored: bytes) -> uuid.UUID:
    """The data key a sealed blob names (raises :class:`SealError` for a short blob)."""
    if not is_sealed(stored) or len(stored) < HEADER_SIZE + 16:
        raise SealError("not a sealed blob")
    return uuid.UUID(bytes=stored[len(MAGIC):len(MAGIC) + KEY_ID_SIZE])


def new_data_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


def _aad(key_id: uuid.UUID, dsse_sha256: bytes) -> bytes:
    return MAGIC + key_id.bytes + dsse_sha256


def seal(cipher: AESGCM, key_id: uuid.UUID, dsse_bytes: bytes, dsse_sha256: bytes) -> bytes:
    """The one function that makes sealed bytes (``cipher`` = ``AESGCM(data key)``)."""
    nonce = os.urandom(NONCE_SIZE)
    return (MAGIC + key_id.bytes + nonce
            + cipher.encrypt(nonce, dsse_bytes, _aad(key_id, dsse_sha256)))


def open_sealed(cipher: AESGCM, stored: bytes, dsse_sha256: bytes) -> bytes:
    """The DSSE bytes of a sealed blob; they must hash to ``dsse_sha256`` (the digest the
    log leaf commits to), else :class:`SealError`."""
    key_id = sealed_key_id(stored)
    nonce = stored[len(MAGIC) + KEY_ID_SIZE:HEADER_SIZE]
    try:
        plain = cipher.decrypt(nonce, stored[HEADER_SIZE:], _aad(key_id, dsse_sha256))
    except InvalidTag:
        raise SealError("the sealed content does not open under its data key (changed "
                        "bytes, another record's blob, or another key)") from None
    if hashlib.sha256(plain).digest() != dsse_sha256:  # pragma: no cover - aad binds it
        raise SealError("the sealed content does not hash to the record's digest")
    return plain


class KeyEncryptionKey(Protocol):
    """Wraps and unwraps data keys; held outside the database."""

    @property
    def kek_id(self) -> str: ...

    def wrap(self, key_id: uuid.UUID, data_key: bytes) -> bytes: ...

    def unwrap(self, key_id: uuid.UUID, wrapped: bytes) -> bytes: ...


class LocalKek:
    """A 256-bit KEK held in this process (read from ``LEDGER_KEK_FILE``): AES-256-GCM
    key wrapping, the data key's ID as associated data (a wrapped key copied to another
    row does not unwrap)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != DATA_KEY_SIZE:
            raise ValueError("a KEK is 32 bytes")
        self._cipher = AESGCM(key)
        self._id = hashlib.sha256(b"inference-ledger kek id\x00" + key).hexdigest()[:16]

    @classmethod
    def from_file_bytes(cls, data: bytes) -> LocalKek:
        """32 raw bytes, or 64 hex characters (a trailing newline allowed)."""
        text = data.strip()
        if len(data) == DATA_KEY_SIZE:
            return cls(data)
        try:
            raw = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raw = b""
        if len(raw) != DATA_KEY_SIZE:
            raise ValueError("the KEK file must hold 32 raw bytes or 64 hex characters "
                             "(`ledger keys generate-kek` writes one)")
        return cls(raw)

    @property
    def kek_id(self) -> str:
        return self._id

    def wrap(self, key_id: uuid.UUID, data_key: bytes) -> bytes:
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._cipher.encrypt(nonce, data_key, _WRAP_AAD + key_id.bytes)

    def unwrap(self, key_id: uuid.UUID, wrapped: bytes) -> bytes:
        try:
            return self._cipher.decrypt(wrapped[:NONCE_SIZE], wrapped[NONCE_SIZE:],
                                        _WRAP_AAD + key_id.bytes)
        except InvalidTag:
            raise SealError(f"data key {key_id} does not unwrap under this KEK") from None
