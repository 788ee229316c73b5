"""DSSE (Dead Simple Signing Envelope) v1 with Ed25519.

Signatures cover ``PAE(payloadType, payload)`` where ``payload`` is the base64-decoded byte
string exactly as received: the ledger never re-serialises a payload before verifying it.

The stored form of an envelope is :func:`canonical_envelope_bytes`: the JSON wrapper with
sorted keys and no whitespace, holding the payload's base64 text exactly as received. Since
every value in the wrapper is restricted to ASCII characters that JSON never escapes
(base64 text, hex key IDs, the fixed payload type), that form *is* RFC 8785 canonical JSON.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pybase64 import b64decode as _fast_b64decode

from ledger.core import jsonstrict
from ledger.core.errors import FormatError, SignatureError, ValidationFailed
from ledger.core.keys import key_id, public_raw, verify_ed25519

PAYLOAD_TYPE_INTOTO = "application/vnd.in-toto+json"
MAX_SIGNATURES = 8
_KEYID_RE = re.compile(r"^[0-9a-f]{64}$")
_PAYLOAD_TYPE_RE = re.compile(r"^[\x21-\x7e]{1,128}$")
_FIELDS = frozenset({"payload", "payloadType", "signatures"})
_SIGNATURE_FIELDS = frozenset({"keyid", "sig"})


def pae(payload_type: str, payload: bytes, prefix: bytes = b"") -> bytes:
    """DSSE v1 Pre-Authentication Encoding: the exact bytes that get signed, after
    ``prefix`` (a signature: Ed25519 verification takes ``signature || message`` in one
    buffer, which this makes in one copy of the payload, not two)."""
    type_bytes = payload_type.encode("utf-8")
    return b"%sDSSEv1 %d %s %d %s" % (prefix, len(type_bytes), type_bytes, len(payload),
                                      payload)


@dataclass(frozen=True, slots=True)
class Signature:
    keyid: str
    sig: bytes
    sig_b64: str


@dataclass(frozen=True, slots=True)
class Envelope:
    payload_type: str
    payload_b64: str
    payload: bytes
    signatures: tuple[Signature, ...]

    def pae(self) -> bytes:
        return pae(self.payload_type, self.payload)

    def canonical_bytes(self) -> bytes:
        return canonical_envelope_bytes(self)


def canonical_envelope_bytes(env: Envelope) -> bytes:
    """The one function that makes an envelope's stored (and hashed) bytes."""
    if len(env.signatures) == 1:  # (the common case, without a join)
        s = env.signatures[0]
        sigs = f'{{"keyid":"{s.keyid}","sig":"{s.sig_b64}"}}'
    else:
        sigs = ",".join([f'{{"keyid":"{s.keyid}","sig":"{s.sig_b64}"}}'
                         for s in env.signatures])
    return (
        f'{{"payload":"{env.payload_b64}","payloadType":"{env.payload_type}",'
        f'"signatures":[{sigs}]}}'
    ).encode("ascii")


def _b64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise FormatError(f"DSSE {field} must be a base64 string", code="malformed_dsse")
    if len(value) % 4:
        raise FormatError(f"DSSE {field} is not standard padded base64", code="bad_base64")
    try:
        # pybase64 (SIMD) decodes a 13 KB payload in ~1 us, against ~20 us for binascii:
        # offline verification decodes every payload. Where it accepts, it gives what
        # binascii's strict mode gives; it refuses a few spellings binascii takes (padding
        # after a full group, "qZjj===="), so a refusal is decided by binascii below, and
        # what is accepted stays exactly what it was (tests/core/test_proven_nodes.py).
        return _fast_b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        # binascii's strict mode refuses exactly what ``b64decode(validate=True)`` does
        # for padded input (characters outside the alphabet, padding anywhere but the
        # end).
        return binascii.a2b_base64(value.encode("ascii"), strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise FormatError(f"DSSE {field} is not valid base64: {exc}", code="bad_base64") from exc


def envelope_from_obj(obj: Any, *, expected_payload_type: str = PAYLOAD_TYPE_INTOTO) -> Envelope:
    """Check the DSSE wrapper's shape and decode it. Raises FormatError/ValidationFailed."""
    if not isinstance(obj, dict):
        raise FormatError("a DSSE envelope must be a JSON object", code="malformed_dsse")
    if obj.keys() != _FIELDS:  # (the common case in one comparison)
        unknown = set(obj) - _FIELDS
        if unknown:
            raise FormatError(f"unknown DSSE fields: {sorted(unknown)}",
                              code="malformed_dsse")
        for name in ("payload", "payloadType", "signatures"):
            if name not in obj:
                raise FormatError(f"DSSE envelope lacks {name!r}", code="malformed_dsse")
    payload_type = obj["payloadType"]
    if not isinstance(payload_type, str) or not _PAYLOAD_TYPE_RE.match(payload_type):
        raise FormatError("DSSE payloadType must be a short ASCII string", code="malformed_dsse")
    if payload_type != expected_payload_type:
        raise ValidationFailed(
            f"payloadType must be {expected_payload_type!r}, got {payload_type!r}",
            code="wrong_payload_type",
        )
    payload = _b64(obj["payload"], "payload")
    raw_sigs = obj["signatures"]
    if not isinstance(raw_sigs, list) or not raw_sigs:
        raise FormatError("DSSE signatures must be a non-empty list", code="malformed_dsse")
    if len(raw_sigs) > MAX_SIGNATURES:
        raise FormatError(f"at most {MAX_SIGNATURES} signatures", code="malformed_dsse")
    sigs: list[Signature] = []
    for i, raw in enumerate(raw_sigs):
        if not isinstance(raw, dict) or (raw.keys() != _SIGNATURE_FIELDS and (
                set(raw) - _SIGNATURE_FIELDS or "sig" not in raw)):
            raise FormatError(f"signature {i} must be an object with keyid and sig",
                              code="malformed_dsse")
        kid = raw.get("keyid")
        if not isinstance(kid, str) or not _KEYID_RE.match(kid):
            raise FormatError(
                f"signature {i} keyid must be the 64-hex SHA-256 of the raw public key",
                code="malformed_dsse",
            )
        sig = _b64(raw["sig"], f"signatures[{i}].sig")
        if len(sig) != 64:
            raise SignatureError(f"signature {i} is not a 64-byte Ed25519 signature")
        sigs.append(Signature(kid, sig, raw["sig"]))
    if len(sigs) > 1 and len({s.keyid for s in sigs}) != len(sigs):
        raise FormatError("two signatures carry the same keyid", code="malformed_dsse")
    return Envelope(payload_type, obj["payload"], payload, tuple(sigs))


def envelope_from_json(data: bytes, *, max_bytes: int | None = None,
                       expected_payload_type: str = PAYLOAD_TYPE_INTOTO) -> Envelope:
    if max_bytes is not None and len(data) > max_bytes:
        raise ValidationFailed(f"envelope is {len(data)} bytes; the limit is {max_bytes}",
                               code="too_large")
    return envelope_from_obj(jsonstrict.loads(data, what="DSSE envelope", max_depth=4),
                             expected_payload_type=expected_payload_type)


_KEYID_MARK = b'"keyid":"'
_KEYID_HEX = re.compile(rb"[0-9a-f]{64}")


def keyids_named(data: bytes) -> list[str]:
    """The key IDs the JSON text ``data`` appears to name, found by a byte search for
    ``"keyid":"<64 hex>"`` as a compact encoder writes it (the first
    :data:`MAX_SIGNATURES` such marks only, so any body costs at most that many searches,
    in C): nothing is parsed, decoded or checked. A hint only, for
    reading the keys an envelope will need in the same round trip as its API key
    (``ledger.api.routes.envelopes``): what is verified always comes from
    :func:`envelope_from_json`, and a key ID this search missed or made up only costs
    another read."""
    found: list[str] = []
    # the signatures member once, searched from the end: it follows the payload in a
    # key-sorted wrapper (base64 holds no '"', so the payload cannot hold the mark)
    at = max(data.rfind(b'"signatures":['), 0)
    for _ in range(MAX_SIGNATURES):  # the first marks only: bounded work for any body
        at = data.find(_KEYID_MARK, at)
        if at < 0:
            break
        at += len(_KEYID_MARK)
        if _KEYID_HEX.fullmatch(data, at, at + 64) and data[at + 64 : at + 65] == b'"':
            found.append(data[at : at + 64].decode("ascii"))
    return found


def verify_envelope(env: Envelope, public_key_for: Callable[[str], bytes]) -> list[str]:
    """Verify every signature; return the key IDs. ``public_key_for`` raises for unknown keys.

    Every signature present must verify (a bad one is never ignored), and there is at
    least one by construction.
    """
    sigs = env.signatures
    if len(sigs) == 1:  # the common case
        s = sigs[0]
        verify_signature(env.payload_type, env.payload, s.sig, public_key_for(s.keyid))
        return [s.keyid]
    message = env.pae()
    for s in sigs:
        verify_ed25519(public_key_for(s.keyid), message, s.sig)
    return [s.keyid for s in sigs]


def verify_signature(payload_type: str, payload: bytes, sig: bytes, public_key: bytes
                     ) -> None:
    """One DSSE signature over ``PAE(payload_type, payload)`` (what
    :func:`verify_envelope` checks of each): ``signature || PAE`` made in one buffer,
    what libsodium reads, in one copy of the payload."""
    verify_ed25519(public_key, b"", sig, signed=pae(payload_type, payload, sig))


def sign_envelope(payload: bytes, keys: Iterable[Ed25519PrivateKey],
                  payload_type: str = PAYLOAD_TYPE_INTOTO) -> Envelope:
    message = pae(payload_type, payload)
    sigs = []
    for key in keys:
        sig = key.sign(message)
        sigs.append(Signature(key_id(public_raw(key)), sig, base64.b64encode(sig).decode()))
    return Envelope(payload_type, base64.b64encode(payload).decode(), payload, tuple(sigs))
