"""The trust policy: the keys every check believes, read from a file outside the database.

An insider with the database can insert rows into ``signing_keys``; so nothing that
decides whether the log, a witness or the ledger's own records are genuine may rest on a
row alone. ``ledger audit --trust``, ``ledger verify --trust`` and the replay worker read
the policy (``LEDGER_TRUST_POLICY_FILE``) and trust only what it names:

- ``log_keys``: C2SP signed-note verifier keys of the log (``<name>+<hex id>+<base64>``,
  type 0x01, Go ``note`` format). A checkpoint counts only when one of them signed it.
- ``service_keys``: base64 of the raw 32-byte Ed25519 public keys of the ledger's service
  key(s). They sign dispute events and the registry leaves (key registrations,
  revocations, API-key changes) through which every other key (producers, workers) is
  trusted.
- ``[witness]``: ``keys``, C2SP cosignature verifier keys (type 0x04,
  ``<name>+<hex id>+<base64(0x04 || key)>``), and ``quorum``, how many distinct
  witnesses must have cosigned a checkpoint for it to count (0: witnesses not required).

The file is TOML::

    origin = "inference-ledger.example/log"
    log_keys = ["inference-ledger.example/log+1a2b3c4d+AV..."]
    service_keys = ["q83vEjRWeJq8..."]

    [witness]
    quorum = 1
    keys = ["witness.example+89abcdef+BD..."]

:func:`format_trust_policy` is the one function that writes it, :func:`parse_trust_policy`
the one that reads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ledger.core.errors import LedgerError
from ledger.core.note import NoteVerifier, _is_valid_key_name, parse_verifier_key

SIGNATURE_TYPE_COSIGNATURE = 0x04
"""C2SP tlog-cosignature/v1 (timestamped Ed25519 cosignature) key type."""


class TrustPolicyError(LedgerError):
    """A trust policy file that does not parse, or names no usable key."""

    code = "bad_trust_policy"


def witness_key_id(name: str, public_key: bytes) -> int:
    """Key ID of a cosignature/v1 key: SHA-256(name || 0x0A || 0x04 || key)[:4]."""
    if not _is_valid_key_name(name):
        raise TrustPolicyError(f"invalid witness key name {name!r}")
    if len(public_key) != 32:
        raise TrustPolicyError("a witness public key is 32 bytes")
    digest = hashlib.sha256(name.encode() + b"\n" + bytes([SIGNATURE_TYPE_COSIGNATURE])
                            + public_key).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass(frozen=True, slots=True)
class WitnessKey:
    """A witness the policy trusts: its name, cosignature key ID and raw public key."""

    name: str
    key_id: int
    public_key: bytes

    @classmethod
    def from_public_key(cls, name: str, public_key: bytes) -> WitnessKey:
        return cls(name, witness_key_id(name, public_key), public_key)

    @property
    def verifier_key(self) -> str:
        key = base64.b64encode(bytes([SIGNATURE_TYPE_COSIGNATURE]) + self.public_key).decode()
        return f"{self.name}+{self.key_id:08x}+{key}"


def parse_witness_key(vkey: str) -> WitnessKey:
    """Parse ``<name>+<8 hex>+<base64(0x04 || 32-byte key)>``; checks the key ID."""
    name, _, rest = vkey.partition("+")
    hex_id, _, b64 = rest.partition("+")
    if len(hex_id) != 8 or not all(c in "0123456789abcdef" for c in hex_id.lower()):
        raise TrustPolicyError(f"witness key {vkey!r}: the key ID is not 8 hex digits")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TrustPolicyError(f"witness key {vkey!r}: bad base64") from exc
    if len(raw) != 33 or raw[0] != SIGNATURE_TYPE_COSIGNATURE:
        raise TrustPolicyError(f"witness key {vkey!r}: not a cosignature/v1 (type 0x04) key")
    key = WitnessKey.from_public_key(name, raw[1:])
    if key.key_id != int(hex_id, 16):
        raise TrustPolicyError(f"witness key {vkey!r}: the key ID does not match the key")
    return key


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    origin: str
    log_keys: tuple[NoteVerifier, ...]
    service_keys: tuple[bytes, ...]
    witnesses: tuple[WitnessKey, ...] = ()
    quorum: int = 0

    def log_verifiers(self) -> list[NoteVerifier]:
        return list(self.log_keys)

    def is_service_key(self, public_key: bytes) -> bool:
        return bytes(public_key) in self.service_keys


def _strings(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TrustPolicyError(f"{what} must be a list of strings")
    return list(value)


def parse_trust_policy(text: str) -> TrustPolicy:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TrustPolicyError(f"the trust policy is not TOML: {exc}") from exc
    unknown = set(doc) - {"origin", "log_keys", "service_keys", "witness"}
    if unknown:
        raise TrustPolicyError(f"unknown trust policy field(s): {', '.join(sorted(unknown))}")
    origin = doc.get("origin")
    if not isinstance(origin, str) or not origin:
        raise TrustPolicyError("the trust policy needs origin, the log's name")
    try:
        log_keys = tuple(parse_verifier_key(k) for k in _strings(doc.get("log_keys"),
                                                                    "log_keys"))
    except LedgerError as exc:
        raise TrustPolicyError(f"log_keys: {exc.message}") from exc
    if not log_keys:
        raise TrustPolicyError("the trust policy names no log key")
    if any(k.name != origin for k in log_keys):
        raise TrustPolicyError("every log key must be named like the origin")
    service: list[bytes] = []
    for s in _strings(doc.get("service_keys", []), "service_keys"):
        try:
            raw = base64.b64decode(s, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TrustPolicyError("service_keys: not base64") from exc
        if len(raw) != 32:
            raise TrustPolicyError("service_keys: an Ed25519 public key is 32 bytes")
        service.append(raw)
    witness = doc.get("witness", {})
    if not isinstance(witness, dict) or set(witness) - {"quorum", "keys"}:
        raise TrustPolicyError("[witness] holds only quorum and keys")
    witnesses = tuple(parse_witness_key(k) for k in _strings(witness.get("keys", []),
                                                              "witness.keys"))
    if len({w.name for w in witnesses}) != len(witnesses):
        raise TrustPolicyError("witness.keys names a witness twice")
    quorum = witness.get("quorum", 0)
    if not isinstance(quorum, int) or isinstance(quorum, bool) or not \
            0 <= quorum <= len(witnesses):
        raise TrustPolicyError(f"witness.quorum must be 0..{len(witnesses)} (the number of "
                               "witness keys)")
    return TrustPolicy(origin, log_keys, tuple(service), witnesses, quorum)


def load_trust_policy(path: str | Path) -> TrustPolicy:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TrustPolicyError(f"cannot read the trust policy {path}: {exc.strerror}") from exc
    return parse_trust_policy(text)


def format_trust_policy(origin: str, log_public_keys: Sequence[bytes],
                        service_public_keys: Sequence[bytes] = (),
                        witnesses: Sequence[WitnessKey] = (), quorum: int = 0) -> str:
    """The TOML text of a policy (what ``ledger trust init`` and the demo write)."""
    def strs(items: Sequence[str]) -> str:
        return "[" + ", ".join(f'"{i}"' for i in items) + "]"

    log_keys = [NoteVerifier.from_public_key(origin, k).verifier_key for k in log_public_keys]
    service = [base64.b64encode(k).decode() for k in service_public_keys]
    text = (f'origin = "{origin}"\nlog_keys = {strs(log_keys)}\n'
            f"service_keys = {strs(service)}\n\n[witness]\nquorum = {quorum}\n"
            f"keys = {strs([w.verifier_key for w in witnesses])}\n")
    parse_trust_policy(text)  # what we write must read back
    return text
