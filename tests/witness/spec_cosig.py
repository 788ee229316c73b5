"""A second, independent reading of C2SP tlog-cosignature (Ed25519, cosignature/v1),
written from the spec for the tests; it deliberately imports nothing from ``ledger``.

Spec points used:
- key ID = SHA-256(<name> || "\\n" || 0x04 || 32-byte public key)[:4];
- vkey = <name>+<hex key ID>+base64(0x04 || public key);
- signature line = "— <name> " base64(key ID || u64 big-endian timestamp || 64-byte sig);
- signed message = "cosignature/v1\\n" "time <timestamp>\\n" <note body incl. final newline>.
"""

from __future__ import annotations

import base64
import hashlib
import struct

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

EM_DASH = "\u2014"


def key_id(name: str, public_key: bytes) -> bytes:
    return hashlib.sha256(name.encode("utf-8") + b"\x0a" + b"\x04" + public_key).digest()[:4]


def vkey(name: str, public_key: bytes) -> str:
    return "+".join([name, key_id(name, public_key).hex(),
                     base64.b64encode(b"\x04" + public_key).decode()])


def parse_vkey(text: str) -> tuple[str, bytes]:
    name, hex_id, b64 = text.split("+", 2)  # base64 may itself contain "+"
    raw = base64.b64decode(b64)
    assert raw[0] == 4 and len(raw) == 33, "not an Ed25519 cosignature key"
    assert bytes.fromhex(hex_id) == key_id(name, raw[1:]), "key ID mismatch"
    return name, raw[1:]


def signed_message(body: str, timestamp: int) -> bytes:
    return b"cosignature/v1\n" + b"time " + str(timestamp).encode() + b"\n" + body.encode()


def note_parts(note: bytes) -> tuple[str, list[str]]:
    """Note body (through its final newline) and its signature lines."""
    text = note.decode("utf-8")
    cut = text.rindex("\n\n")
    return text[:cut + 1], text[cut + 2:].rstrip("\n").split("\n")


def verify(note: bytes, name: str, public_key: bytes) -> int:
    """The timestamp of a valid cosignature by (name, public_key) on ``note``; raises
    AssertionError (or InvalidSignature) when there is none or it is bad."""
    body, lines = note_parts(note)
    want = key_id(name, public_key)
    for line in lines:
        prefix = EM_DASH + " " + name + " "
        if not line.startswith(prefix):
            continue
        blob = base64.b64decode(line[len(prefix):])
        if len(blob) != 4 + 8 + 64 or blob[:4] != want:
            continue
        (timestamp,) = struct.unpack(">Q", blob[4:12])
        assert timestamp < 2**63
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            blob[12:], signed_message(body, timestamp))
        return int(timestamp)
    raise AssertionError(f"no cosignature by {name} in the note")
