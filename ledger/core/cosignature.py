"""C2SP tlog-cosignature (cosignature/v1): witness cosignatures on checkpoints.

Reference: https://c2sp.org/tlog-cosignature (the Ed25519 type). A cosignature is one
more signed-note signature line on a checkpoint::

    — <witness name> base64(key ID || timestamp || Ed25519 signature)

- key ID: ``SHA-256(name || 0x0A || 0x04 || 32-byte public key)[:4]``
  (:func:`ledger.core.trust.witness_key_id`), 4 bytes big-endian;
- timestamp: POSIX seconds, 8 bytes big-endian, at most 2**63 - 1;
- signature: Ed25519 over ``cosignature/v1\\ntime <timestamp>\\n<checkpoint text>``, the
  checkpoint text being the whole note body with its final newline and no signature
  lines (:func:`cosignature_message`, the one function that makes those bytes).

Because a cosignature is just another signature line, a cosigned checkpoint stays a valid
signed note for readers that know only the log key (Go's ``note.Open`` ignores lines by
unknown keys), and a checkpoint signed by the log alone plus the lines a witness returns
from ``add-checkpoint`` is the cosigned checkpoint.

Nothing here does I/O. Witness signing keys are written like Go ``note`` signer keys but
with type 0x04: ``PRIVATE+KEY+<name>+<hex key ID>+base64(0x04 || 32-byte seed)``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.errors import CheckpointError, LedgerError, MalformedNoteError, SignatureError
from ledger.core.keys import verify_ed25519
from ledger.core.note import (
    MAX_SIGNATURES,
    SIGNATURE_PREFIX,
    _b64decode_canonical,
    decode_note,
    parse_checkpoint,
    signature_line_parts,
)
from ledger.core.trust import (
    SIGNATURE_TYPE_COSIGNATURE,
    TrustPolicy,
    WitnessKey,
    witness_key_id,
)

COSIGNATURE_HEADER = "cosignature/v1"
MAX_TIMESTAMP = 2**63 - 1
COSIGNATURE_SIZE = 4 + 8 + 64
"""Bytes after base64 decoding: key ID, timestamp, Ed25519 signature."""


class CosignatureError(CheckpointError):
    """A cosignature line that does not parse or does not verify."""

    code = "bad_cosignature"


class QuorumError(CosignatureError):
    """Fewer distinct trusted witnesses cosigned a checkpoint than the policy's quorum."""

    code = "witness_quorum"


def _raw_public(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                 serialization.PublicFormat.Raw)


def _check_timestamp(timestamp: int) -> None:
    if isinstance(timestamp, bool) or not isinstance(timestamp, int) or not \
            0 <= timestamp <= MAX_TIMESTAMP:
        raise CosignatureError("a cosignature timestamp is an integer in [0, 2**63)")


def cosignature_message(checkpoint_text: str, timestamp: int) -> bytes:
    """The bytes a witness signs (the one function that makes them)."""
    _check_timestamp(timestamp)
    if not isinstance(checkpoint_text, str) or not checkpoint_text.endswith("\n"):
        raise CosignatureError("the cosigned checkpoint text ends with a newline")
    return f"{COSIGNATURE_HEADER}\ntime {timestamp}\n{checkpoint_text}".encode()


@dataclass(frozen=True, slots=True)
class Cosignature:
    """One cosignature/v1 signature line, parsed (not yet verified)."""

    name: str
    key_id: int
    timestamp: int
    signature: bytes

    @property
    def line(self) -> str:
        """The signature line, without its trailing newline."""
        raw = (self.key_id.to_bytes(4, "big") + self.timestamp.to_bytes(8, "big")
               + self.signature)
        return f"{SIGNATURE_PREFIX}{self.name} {base64.b64encode(raw).decode()}"

    def verify(self, checkpoint_text: str, key: WitnessKey) -> None:
        """Return or raise :class:`CosignatureError`."""
        if (self.name, self.key_id) != (key.name, key.key_id):
            raise CosignatureError(f"the cosignature by {self.name}+{self.key_id:08x} is not "
                                   f"by the key {key.name}+{key.key_id:08x}")
        message = cosignature_message(checkpoint_text, self.timestamp)
        try:
            verify_ed25519(key.public_key, message, self.signature)
        except SignatureError as exc:
            raise CosignatureError(f"invalid cosignature by witness {key.name}+"
                                   f"{key.key_id:08x}") from exc


def sign_cosignature(checkpoint_text: str, name: str, private_key: Ed25519PrivateKey,
                     timestamp: int) -> str:
    """One cosignature line (``— name base64(...)``, without the trailing newline)."""
    key_id = witness_key_id(name, _raw_public(private_key))
    signature = private_key.sign(cosignature_message(checkpoint_text, timestamp))
    return Cosignature(name, key_id, timestamp, signature).line


def parse_cosignature_line(line: str) -> Cosignature:
    """Parse one signature line as a cosignature/v1 line (no trailing newline).

    Raises :class:`CosignatureError` when it is not one (wrong shape or length: a plain
    Ed25519 note signature is 68 bytes, a cosignature 76)."""
    try:
        name, raw = signature_line_parts(line.removesuffix("\n"), "cosignature")
    except ValueError as exc:
        raise CosignatureError(str(exc)) from exc
    if len(raw) != COSIGNATURE_SIZE:
        raise CosignatureError(f"a cosignature/v1 signature is {COSIGNATURE_SIZE} bytes, "
                               f"not {len(raw)}")
    timestamp = int.from_bytes(raw[4:12], "big")
    _check_timestamp(timestamp)
    return Cosignature(name, int.from_bytes(raw[:4], "big"), timestamp, raw[12:])


def split_note(note: bytes) -> tuple[str, list[str]]:
    """A signed note's text (ending in its newline) and its signature lines (without
    newlines). Checks the note's shape only; verifies nothing."""
    decoded = decode_note(note)
    split = decoded.rfind("\n\n")
    if split < 0 or not decoded.endswith("\n"):
        raise MalformedNoteError("a note is text, a blank line and signature lines")
    lines = decoded[split + 2:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise MalformedNoteError(f"a note has at most {MAX_SIGNATURES} signatures")
    if not all(line.startswith(SIGNATURE_PREFIX) for line in lines):
        raise MalformedNoteError("a signature line starts with an em dash and a space")
    return decoded[:split + 1], lines


def cosignatures(note: bytes) -> tuple[str, list[Cosignature]]:
    """The checkpoint text of ``note`` and every signature line in it that has the shape
    of a cosignature/v1 line (other lines, such as the log's own signature, are skipped)."""
    text, lines = split_note(note)
    found = []
    for line in lines:
        try:
            found.append(parse_cosignature_line(line))
        except CosignatureError:
            continue
    return text, found


def append_signature_lines(note: bytes, lines: Sequence[str]) -> bytes:
    """``note`` with more signature lines (e.g. cosignatures) after its own."""
    split_note(note)
    extra = "".join(line.removesuffix("\n") + "\n" for line in lines)
    out = bytes(note) + extra.encode()
    split_note(out)  # what we hand out must still be one signed note
    return out


def verified_witnesses(note: bytes, witnesses: Sequence[WitnessKey]) -> list[str]:
    """Names of the trusted witnesses whose cosignature on ``note`` verifies.

    Lines by keys not in ``witnesses`` are ignored, as the spec asks; a line whose name
    and key ID match a trusted witness but whose signature does not verify raises
    :class:`CosignatureError` (someone forged or altered it). The note's text must be a
    checkpoint. Each witness counts once, however many lines it has.
    """
    text, found = cosignatures(note)
    parse_checkpoint(text)
    trusted = {(w.name, w.key_id): w for w in witnesses}
    names: list[str] = []
    for cosig in found:
        key = trusted.get((cosig.name, cosig.key_id))
        if key is None:
            continue
        cosig.verify(text, key)
        if key.name not in names:
            names.append(key.name)
    return names


def check_quorum(note: bytes, policy: TrustPolicy) -> list[str]:
    """The witnesses that cosigned ``note``; raises :class:`QuorumError` below quorum."""
    if policy.quorum == 0:
        return []
    names = verified_witnesses(note, policy.witnesses)
    if len(names) < policy.quorum:
        raise QuorumError(f"{len(names)} of the {policy.quorum} witness cosignatures the "
                          "trust policy requires")
    return names


# --- witness signing keys ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WitnessSigner:
    """A witness's cosigning key and name."""

    name: str
    private_key: Ed25519PrivateKey

    @property
    def key(self) -> WitnessKey:
        return WitnessKey.from_public_key(self.name, _raw_public(self.private_key))

    def cosign(self, checkpoint_text: str, timestamp: int) -> str:
        return sign_cosignature(checkpoint_text, self.name, self.private_key, timestamp)


def format_witness_signer_key(name: str, private_key: Ed25519PrivateKey) -> str:
    """``PRIVATE+KEY+<name>+<hex key ID>+base64(0x04 || 32-byte seed)``."""
    seed = private_key.private_bytes(serialization.Encoding.Raw,
                                     serialization.PrivateFormat.Raw,
                                     serialization.NoEncryption())
    key_id = witness_key_id(name, _raw_public(private_key))
    b64 = base64.b64encode(bytes([SIGNATURE_TYPE_COSIGNATURE]) + seed).decode()
    return f"PRIVATE+KEY+{name}+{key_id:08x}+{b64}"


def parse_witness_signer_key(skey: str) -> WitnessSigner:
    """Parse :func:`format_witness_signer_key` output; checks the key ID."""
    parts = skey.strip().split("+", 4)
    if len(parts) != 5 or parts[:2] != ["PRIVATE", "KEY"]:
        raise CosignatureError("not a witness signer key (PRIVATE+KEY+name+id+key)")
    _, _, name, hex_id, b64 = parts
    try:
        raw = _b64decode_canonical(b64)
        key_id = int(hex_id, 16)
    except (binascii.Error, ValueError) as exc:
        raise CosignatureError("malformed witness signer key") from exc
    if len(hex_id) != 8 or len(raw) != 33 or raw[0] != SIGNATURE_TYPE_COSIGNATURE:
        raise CosignatureError("not a cosignature/v1 (type 0x04) signer key")
    private_key = Ed25519PrivateKey.from_private_bytes(raw[1:])
    try:
        expected = witness_key_id(name, _raw_public(private_key))
    except LedgerError as exc:
        raise CosignatureError(f"witness signer key: {exc.message}") from exc
    if expected != key_id:
        raise CosignatureError("witness signer key: the key ID does not match the key")
    return WitnessSigner(name, private_key)


def generate_witness_key(name: str) -> tuple[str, str]:
    """A new witness key pair as (signer key, verifier key) strings."""
    private_key = Ed25519PrivateKey.generate()
    signer = WitnessSigner(name, private_key)
    return format_witness_signer_key(name, private_key), signer.key.verifier_key
