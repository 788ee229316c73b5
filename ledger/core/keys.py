"""Ed25519 keys: generation, serialisation and key IDs.

A key ID is the lowercase hex SHA-256 of the 32-byte raw Ed25519 public key. Producers put
it in each DSSE signature's ``keyid``; the ledger looks keys up by it.

:func:`verify_ed25519` is the one Ed25519 verification of the ledger (DSSE envelopes,
verdicts, dispute events, signed notes and checkpoints, audit, offline bundles): it runs
the strict checks of :mod:`ledger.core.ed25519_strict`, then libsodium's
``crypto_sign_open`` (from the library PyNaCl binds, without an output buffer: see
:func:`_crypto_sign_open`). libsodium, not OpenSSL, because it is a third faster per
signature (43 vs 66 us on a 2 KB message here), and with our checks in front the two
accept exactly the same signatures: tests/core/test_ed25519_vectors.py runs every
Wycheproof, speccheck and edge vector through both. Keys are still made, stored and
used for signing with ``cryptography``.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import hashlib

import nacl._sodium as _sodium_module
import nacl.bindings  # importing it runs sodium_init
import nacl.exceptions
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.core.ed25519_strict import (
    check_public_key,
    check_public_key_on_registration,
    check_signature,
)
from ledger.core.errors import FormatError, SignatureError

#: libsodium's ``crypto_sign_open`` from the library PyNaCl's binding is (already loaded),
#: called through ``ctypes.PyDLL``, which keeps the GIL: a verification is ~50 us, and
#: cffi's release of the GIL around it cost the API a wait to take the GIL back (two
#: context switches, ~20 us each on the VM) whenever other threads were busy. Offline
#: verification runs in processes, where holding it costs nothing.
_sign_open = ctypes.PyDLL(_sodium_module.__file__).crypto_sign_open
_sign_open.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                       ctypes.c_ulonglong, ctypes.c_char_p]
_sign_open.restype = ctypes.c_int


def _crypto_sign_open(signed: bytes, public_key_raw: bytes) -> None:
    """libsodium's ``crypto_sign_open`` of ``signature || message``: the call
    ``nacl.bindings.crypto_sign_open`` makes, in the same compiled library (holding the
    GIL: :data:`_sign_open`), but with no buffer for the opened message (libsodium's
    ``m = NULL``: the same verification, nothing copied out). PyNaCl's wrapper zeroes a
    buffer as long as the message, has the message copied into it and copies it again to
    return it: three passes over a 13 KB payload for each record of a bundle, for bytes
    nobody reads. Raises
    ``nacl.exceptions.BadSignatureError`` as PyNaCl does."""
    if _sign_open(None, None, signed, len(signed), public_key_raw) != 0:
        raise nacl.exceptions.BadSignatureError("Signature was forged or corrupt")


def key_id(public_key_raw: bytes) -> str:
    if len(public_key_raw) != 32:
        raise FormatError("an Ed25519 public key is 32 bytes")
    return hashlib.sha256(public_key_raw).hexdigest()


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def public_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def load_private_pem(data: bytes) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise FormatError(f"not a PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise FormatError("the private key is not Ed25519")
    return key


def parse_public_key(text: str) -> bytes:
    """Raw 32-byte public key from PEM (SubjectPublicKeyInfo) or base64 of the raw bytes.

    Refuses (:class:`ledger.core.errors.KeyError_` subclasses) small-order, mixed-order,
    off-curve and non-canonically encoded keys:
    :func:`ledger.core.ed25519_strict.check_public_key_on_registration`.
    """
    raw = _parse_public_key(text)
    check_public_key_on_registration(raw)
    return raw


def _parse_public_key(text: str) -> bytes:
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(text.encode())
        except ValueError as exc:
            raise FormatError(f"not a PEM public key: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise FormatError("the public key is not Ed25519")
        return public_raw(key)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FormatError("public key must be PEM or base64 of the 32 raw bytes") from exc
    if len(raw) != 32:
        raise FormatError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    return raw


def verify_ed25519(public_key_raw: bytes, message: bytes, signature: bytes, *,
                   signed: bytes | None = None) -> None:
    """Return None when ``signature`` is valid, else raise.

    Raises :class:`SignatureError` (subclasses ``NonCanonicalSignatureError``,
    ``WeakSignatureError``) for a bad signature and :class:`ledger.core.errors.KeyError_`
    (``WeakKeyError``, ``NonCanonicalKeyError``) for a small-order or non-canonical key:
    the strict rules of :mod:`ledger.core.ed25519_strict`, then libsodium's verification
    (which refuses those too; ours come first for their error codes). ``signed``, where
    the caller has made it: ``signature + message``, what libsodium reads, in one buffer
    (``message`` is then not read): :func:`ledger.core.dsse.verify_envelope` makes it with
    the PAE, sparing a copy of a long payload.
    """
    if len(public_key_raw) != 32:
        raise SignatureError(f"unusable public key: {len(public_key_raw)} bytes, not 32")
    check_public_key(public_key_raw)
    check_signature(signature)
    if signed is not None and not signed.startswith(signature):
        # what libsodium checks must be the signature the strict rules just passed
        raise SignatureError("the signed bytes do not start with the signature")
    try:
        _crypto_sign_open(signature + message if signed is None else signed, public_key_raw)
    except nacl.exceptions.BadSignatureError as exc:
        raise SignatureError("Ed25519 signature does not verify") from exc
    except (nacl.exceptions.CryptoError, TypeError, ValueError, ctypes.ArgumentError) as exc:
        raise SignatureError(f"unusable public key or signature: {exc}") from exc
