"""C2SP tlog-cosignature (cosignature/v1): witness cosignatures on checkpoints.

PLACEHOLDER: the interface other modules call; the witness work fills it in
(https://c2sp.org/tlog-cosignature). A cosignature is a signed-note signature line
``— <witness name> base64(key ID || 8-byte big-endian timestamp || Ed25519 signature)``
over ``cosignature/v1\\ntime <timestamp>\\n<checkpoint text>``.
"""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.errors import CheckpointError
from ledger.core.trust import TrustPolicy, WitnessKey


class CosignatureError(CheckpointError):
    """A cosignature line that does not parse or does not verify."""

    code = "bad_cosignature"


class QuorumError(CosignatureError):
    """Fewer distinct trusted witnesses cosigned a checkpoint than the policy's quorum."""

    code = "witness_quorum"


def cosignature_message(checkpoint_text: str, timestamp: int) -> bytes:
    """The bytes a witness signs (the one function that makes them)."""
    raise NotImplementedError


def sign_cosignature(checkpoint_text: str, name: str, private_key: Ed25519PrivateKey,
                     timestamp: int) -> str:
    """One cosignature line (``— name base64(...)``, without the trailing newline)."""
    raise NotImplementedError


def verified_witnesses(note: bytes, witnesses: Sequence[WitnessKey]) -> list[str]:
    """Names of the trusted witnesses whose cosignature on ``note`` verifies."""
    raise NotImplementedError


def check_quorum(note: bytes, policy: TrustPolicy) -> list[str]:
    """The witnesses that cosigned ``note``; raises :class:`QuorumError` below quorum."""
    if policy.quorum == 0:
        return []
    names = verified_witnesses(note, policy.witnesses)
    if len(names) < policy.quorum:
        raise QuorumError(f"{len(names)} of the {policy.quorum} witness cosignatures the "
                          "trust policy requires")
    return names
