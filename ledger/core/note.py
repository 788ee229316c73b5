"""C2SP signed notes (Ed25519) and tlog-checkpoint bodies.

References: https://c2sp.org/signed-note, https://c2sp.org/tlog-checkpoint and Go's
``golang.org/x/mod/sumdb/note`` (whose key strings we read and write unchanged, so Go
tooling can verify our checkpoints with ``note.NewVerifier`` + ``note.Open``).

A signed note is UTF-8 text ending in a newline, a blank line, then one or more lines
``— <key name> <base64(4-byte key ID || signature)>``. The Ed25519 key ID is
``SHA-256(key name || 0x0A || 0x01 || public key)[:4]``. Key strings:

- verifier key ``<name>+<8 hex digits key ID>+<base64(0x01 || 32-byte public key)>``
- signer key   ``PRIVATE+KEY+<name>+<8 hex digits key ID>+<base64(0x01 || 32-byte seed)>``

A checkpoint is a note whose text is ``<origin>\\n<size>\\n<base64 root>\\n`` followed by
optional non-empty extension lines. :func:`format_checkpoint` is the one function that
makes the bytes a log signs; :func:`open_checkpoint` is the one way to read them back.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.core.errors import (
    CheckpointError,
    CheckpointOriginError,
    KeyError_,
    MalformedCheckpointError,
    MalformedNoteError,
    NonCanonicalSignatureError,
    NoteSignatureError,
    UnverifiedNoteError,
    VerificationError,
    WeakSignatureError,
)
from ledger.core.keys import verify_ed25519
from ledger.core.merkle import HASH_SIZE, MAX_TREE_SIZE

SIGNATURE_TYPE_ED25519 = 0x01
SIGNATURE_PREFIX = "\u2014 "  # em dash, space
MAX_NOTE_SIZE = 1_000_000
"""Largest note we parse, in bytes (Go's tlog caps a tree note's text at 1e6 bytes too)."""
MAX_SIGNATURES = 100
"""Most signature lines we parse (the spec asks for at least 16; Go's note allows 100)."""

# Unicode White_Space (PropList.txt), the set Go's unicode.IsSpace uses: key names must
# not contain any of these, nor "+".
_WHITE_SPACE = frozenset(
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_SIZE_RE = re.compile(r"0|[1-9][0-9]*")


def _b64decode_canonical(text: str) -> bytes:
    """Standard base64 with padding, in its one canonical spelling (no non-zero unused
    bits), so a note or key has exactly one valid encoding. Raises ``ValueError``."""
    raw = base64.b64decode(text, validate=True)
    if base64.b64encode(raw).decode() != text:
        raise ValueError("non-canonical base64")
    return raw


def _is_valid_key_name(name: str) -> bool:
    return (
        isinstance(name, str)
        and name != ""
        and "+" not in name
        and not any(c in _WHITE_SPACE for c in name)
        and not any(ord(c) < 0x20 for c in name)
    )


def _raw_public(key: Ed25519PublicKey | bytes) -> bytes:
    if isinstance(key, Ed25519PublicKey):
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if not isinstance(key, bytes) or len(key) != 32:
        raise MalformedNoteError("an Ed25519 public key is 32 bytes")
    return key


def note_key_id(name: str, public_key: Ed25519PublicKey | bytes) -> int:
    """The signed-note key ID of an Ed25519 key: first 4 bytes (big-endian) of
    SHA-256(name || 0x0A || 0x01 || public key)."""
    if not _is_valid_key_name(name):
        raise MalformedNoteError(f"invalid note key name {name!r}")
    digest = hashlib.sha256(
        name.encode() + b"\n" + bytes([SIGNATURE_TYPE_ED25519]) + _raw_public(public_key)
    ).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass(frozen=True, slots=True)
class NoteVerifier:
    """A trusted Ed25519 note key: name, key ID and 32-byte raw public key."""

    name: str
    key_id: int
    public_key: bytes

    @classmethod
    def from_public_key(cls, name: str, public_key: Ed25519PublicKey | bytes) -> NoteVerifier:
        raw = _raw_public(public_key)
        return cls(name, note_key_id(name, raw), raw)

    @property
    def verifier_key(self) -> str:
        """The Go ``note`` verifier key string for this key."""
        return format_verifier_key(self.name, self.public_key)

    def verify(self, message: bytes, signature: bytes) -> None:
        """Check one Ed25519 signature over ``message`` with the ledger's strict rules
        (:func:`ledger.core.keys.verify_ed25519`); raises :class:`NoteSignatureError`,
        whose ``code`` names a weak key or non-canonical signature when that is why."""
        try:
            verify_ed25519(self.public_key, message, signature)
        except VerificationError as exc:
            strict = isinstance(exc, KeyError_ | NonCanonicalSignatureError | WeakSignatureError)
            raise NoteSignatureError(
                f"invalid signature for key {self.name}+{self.key_id:08x}"
                + (f": {exc.message}" if strict else ""),
                code=exc.code if strict else None,
            ) from exc


@dataclass(frozen=True, slots=True)
class NoteSigner:
    """An Ed25519 note signing key (parsed from a Go ``note`` signer key string)."""

    name: str
    key_id: int
    private_key: Ed25519PrivateKey

    @property
    def verifier(self) -> NoteVerifier:
        return NoteVerifier.from_public_key(self.name, self.private_key.public_key())


def format_verifier_key(name: str, public_key: Ed25519PublicKey | bytes) -> str:
    """``<name>+<hex key ID>+<base64(0x01 || public key)>`` (Go ``note.NewEd25519VerifierKey``)."""
    raw = _raw_public(public_key)
    key = base64.b64encode(bytes([SIGNATURE_TYPE_ED25519]) + raw).decode()
    return f"{name}+{note_key_id(name, raw):08x}+{key}"


def format_signer_key(name: str, private_key: Ed25519PrivateKey) -> str:
    """``PRIVATE+KEY+<name>+<hex key ID>+<base64(0x01 || seed)>`` (Go ``note.GenerateKey``)."""
    seed = private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    key = base64.b64encode(bytes([SIGNATURE_TYPE_ED25519]) + seed).decode()
    return f"PRIVATE+KEY+{name}+{note_key_id(name, private_key.public_key()):08x}+{key}"


def generate_signer_key(name: str) -> tuple[str, str]:
    """A new Ed25519 key pair as (signer key, verifier key) strings."""
    private_key = Ed25519PrivateKey.generate()
    return format_signer_key(name, private_key), format_verifier_key(
        name, private_key.public_key()
    )


def _parse_key_parts(name: str, hex_id: str, b64: str) -> tuple[int, bytes]:
    """Shared checks of both key strings; returns (key ID, 32 key bytes after the type)."""
    if not _is_valid_key_name(name):
        raise MalformedNoteError("malformed note key: bad name")
    if len(hex_id) != 8 or not all(c in "0123456789abcdefABCDEF" for c in hex_id):
        raise MalformedNoteError("malformed note key: the key ID is not 8 hex digits")
    try:
        key = _b64decode_canonical(b64)
    except (binascii.Error, ValueError) as exc:
        raise MalformedNoteError("malformed note key: bad base64") from exc
    if len(key) != 33 or key[0] != SIGNATURE_TYPE_ED25519:
        raise MalformedNoteError("malformed note key: not an Ed25519 (type 0x01) key")
    return int(hex_id, 16), key[1:]


def parse_verifier_key(vkey: str) -> NoteVerifier:
    """Parse a Go ``note`` verifier key string; checks the key ID against the key."""
    name, _, rest = vkey.partition("+")
    hex_id, _, b64 = rest.partition("+")
    key_id, raw = _parse_key_parts(name, hex_id, b64)
    if key_id != note_key_id(name, raw):
        raise MalformedNoteError("malformed note key: the key ID does not match the key")
    return NoteVerifier(name, key_id, raw)


def parse_signer_key(skey: str) -> NoteSigner:
    """Parse a Go ``note`` signer key string; checks the key ID against the derived key."""
    parts = skey.split("+", 4)
    if len(parts) != 5 or parts[0] != "PRIVATE" or parts[1] != "KEY":
        raise MalformedNoteError("malformed note signer key")
    _, _, name, hex_id, b64 = parts
    key_id, seed = _parse_key_parts(name, hex_id, b64)
    private_key = Ed25519PrivateKey.from_private_bytes(seed)
    if key_id != note_key_id(name, private_key.public_key()):
        raise MalformedNoteError("malformed note signer key: the key ID does not match")
    return NoteSigner(name, key_id, private_key)


@dataclass(frozen=True, slots=True)
class NoteSignature:
    """One signature line of a note: key name, key ID and the raw signature bytes."""

    name: str
    key_id: int
    signature: bytes

    @property
    def line(self) -> str:
        sig = base64.b64encode(self.key_id.to_bytes(4, "big") + self.signature).decode()
        return f"{SIGNATURE_PREFIX}{self.name} {sig}\n"


def signature_line_parts(line: str, what: str = "signature") -> tuple[str, bytes]:
    """(key name, decoded bytes) of one signature line ``— <name> <base64>``, without its
    newline; the shape checks that note signatures and cosignatures share. Raises
    ``ValueError`` saying what is wrong (callers raise their own error with it)."""
    if not line.startswith(SIGNATURE_PREFIX):
        raise ValueError("a signature line starts with an em dash and a space")
    name, _, b64 = line[len(SIGNATURE_PREFIX) :].partition(" ")
    if not _is_valid_key_name(name) or not b64:
        raise ValueError(f"malformed {what} line")
    try:
        return name, _b64decode_canonical(b64)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"a {what} is not canonical base64") from exc


@dataclass(frozen=True, slots=True)
class OpenedNote:
    """A note whose signatures by known keys all verified (at least one)."""

    text: str
    signatures: tuple[NoteSignature, ...]
    """Verified signatures, one per known key, in note order."""
    unverified: tuple[NoteSignature, ...]
    """Signatures by keys the caller did not pass (e.g. witnesses): not checked."""


def _check_note_text(text: str) -> None:
    if not isinstance(text, str) or not text.endswith("\n"):
        raise MalformedNoteError("note text must be a string ending in a newline")
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        raise MalformedNoteError("note text must not contain control characters")


def sign_note(text: str, name: str, private_key: Ed25519PrivateKey) -> bytes:
    """The signed note: ``text``, a blank line and one Ed25519 signature line by ``name``."""
    _check_note_text(text)
    message = text.encode()
    sig = NoteSignature(
        name, note_key_id(name, private_key.public_key()), private_key.sign(message)
    )
    note = message + b"\n" + sig.line.encode()
    if len(note) > MAX_NOTE_SIZE:
        raise MalformedNoteError(f"a note is at most {MAX_NOTE_SIZE} bytes")
    return note


def decode_note(note: bytes) -> str:
    """A note's text, checked for shape only: bytes of at most :data:`MAX_NOTE_SIZE`,
    UTF-8, no control characters but newlines. Raises :class:`MalformedNoteError`."""
    if not isinstance(note, bytes | bytearray) or len(note) > MAX_NOTE_SIZE:
        raise MalformedNoteError(f"a note is bytes of at most {MAX_NOTE_SIZE} bytes")
    try:
        decoded = bytes(note).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedNoteError("a note must be valid UTF-8") from exc
    if any(ord(c) < 0x20 and c != "\n" for c in decoded):
        raise MalformedNoteError("a note must not contain control characters")
    return decoded


def open_note(note: bytes, verifiers: Iterable[NoteVerifier]) -> OpenedNote:
    """Parse a signed note and verify it against the trusted ``verifiers``.

    Every signature whose (name, key ID) matches a trusted key must verify (else
    :class:`NoteSignatureError`, stricter than Go, which checks only the first of repeated
    ones); signatures by other keys are returned unverified; with no verified signature
    it raises :class:`UnverifiedNoteError`; malformed input raises
    :class:`MalformedNoteError`. Base64 must be canonical (unlike Go), so a signed note
    has exactly one valid spelling.
    """
    known: dict[tuple[str, int], NoteVerifier] = {}
    for v in verifiers:
        if (v.name, v.key_id) in known and known[(v.name, v.key_id)] != v:
            raise CheckpointError(f"ambiguous verifier keys for {v.name}+{v.key_id:08x}")
        known[(v.name, v.key_id)] = v

    decoded = decode_note(note)
    split = decoded.rfind("\n\n")
    if split < 0:
        raise MalformedNoteError("a note needs a blank line before its signatures")
    text, sig_block = decoded[: split + 1], decoded[split + 2 :]
    if not sig_block.endswith("\n"):
        raise MalformedNoteError("a note must end with a signature line")
    lines = sig_block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise MalformedNoteError(f"a note has at most {MAX_SIGNATURES} signatures")

    message = text.encode()
    verified: dict[tuple[str, int], NoteSignature] = {}
    unverified: dict[str, NoteSignature] = {}
    for line in lines:
        try:
            name, raw = signature_line_parts(line)
        except ValueError as exc:
            raise MalformedNoteError(str(exc)) from exc
        if len(raw) < 5:
            raise MalformedNoteError("a signature is a 4-byte key ID and at least one byte")
        sig = NoteSignature(name, int.from_bytes(raw[:4], "big"), raw[4:])
        verifier = known.get((sig.name, sig.key_id))
        if verifier is None:
            unverified.setdefault(line, sig)
            continue
        verifier.verify(message, sig.signature)
        verified.setdefault((sig.name, sig.key_id), sig)
    if not verified:
        raise UnverifiedNoteError("the note has no signature by a known key")
    return OpenedNote(text, tuple(verified.values()), tuple(unverified.values()))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A C2SP tlog-checkpoint body: origin, tree size, root hash, extension lines."""

    origin: str
    size: int
    root_hash: bytes
    extensions: tuple[str, ...] = ()


def format_checkpoint(checkpoint: Checkpoint) -> str:
    """The checkpoint note text: the one place the bytes a log signs are made."""
    cp = checkpoint
    if not cp.origin or any(ord(c) < 0x20 for c in cp.origin):
        raise MalformedCheckpointError("the origin must be a non-empty line")
    if isinstance(cp.size, bool) or not isinstance(cp.size, int) or not (
        0 <= cp.size <= MAX_TREE_SIZE
    ):
        raise MalformedCheckpointError("the tree size must be an integer in [0, 2**63)")
    if not isinstance(cp.root_hash, bytes) or len(cp.root_hash) != HASH_SIZE:
        raise MalformedCheckpointError("the root hash must be 32 bytes")
    for ext in cp.extensions:
        if not ext or any(ord(c) < 0x20 for c in ext):
            raise MalformedCheckpointError("extension lines must be non-empty lines")
    lines = [cp.origin, str(cp.size), base64.b64encode(cp.root_hash).decode(), *cp.extensions]
    return "".join(line + "\n" for line in lines)


def parse_checkpoint(text: str, *, origin: str | None = None) -> Checkpoint:
    """Parse checkpoint note text strictly; with ``origin``, require that origin line.

    Rejects: text not ending in a newline, fewer than three lines, any empty line, a size
    with a sign, leading zeros or above 2**63 - 1, a root that is not the canonical
    base64 of 32 bytes, control characters, text over :data:`MAX_NOTE_SIZE`.
    """
    if not isinstance(text, str) or len(text.encode()) > MAX_NOTE_SIZE:
        raise MalformedCheckpointError("a checkpoint is a string of limited size")
    if not text.endswith("\n"):
        raise MalformedCheckpointError("checkpoint text must end with a newline")
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        raise MalformedCheckpointError("checkpoint text must not contain control characters")
    lines = text[:-1].split("\n")
    if len(lines) < 3:
        raise MalformedCheckpointError("a checkpoint has an origin, a size and a root hash")
    if any(line == "" for line in lines):
        raise MalformedCheckpointError("checkpoint lines must be non-empty")
    cp_origin, size_line, root_line, *extensions = lines
    if not _SIZE_RE.fullmatch(size_line) or int(size_line) > MAX_TREE_SIZE:
        raise MalformedCheckpointError("the tree size must be decimal without leading zeros")
    try:
        root = _b64decode_canonical(root_line)
    except (binascii.Error, ValueError) as exc:
        raise MalformedCheckpointError("the root hash is not canonical base64") from exc
    if len(root) != HASH_SIZE:
        raise MalformedCheckpointError("the root hash must be the base64 of 32 bytes")
    if origin is not None and cp_origin != origin:
        raise CheckpointOriginError(f"checkpoint origin {cp_origin!r} is not {origin!r}")
    return Checkpoint(cp_origin, int(size_line), root, tuple(extensions))


def sign_checkpoint(checkpoint: Checkpoint, name: str, private_key: Ed25519PrivateKey) -> bytes:
    """The signed checkpoint note (``name`` should be the origin, per the spec)."""
    return sign_note(format_checkpoint(checkpoint), name, private_key)


def open_checkpoint(
    note: bytes, verifiers: Iterable[NoteVerifier], *, origin: str
) -> Checkpoint:
    """Verify a signed checkpoint from the log named ``origin`` and parse its body."""
    return parse_checkpoint(open_note(note, verifiers).text, origin=origin)
