"""One tree of errors for the whole core.

Verification never returns a bool a caller could ignore: it returns ``None`` or raises one
of these. The API maps each to a problem+json response in one place
(:mod:`ledger.problems`), using ``code`` as the stable machine-readable reason.
"""

from __future__ import annotations

from typing import Any


class LedgerError(Exception):
    """Base of every error the core raises."""

    code: str = "ledger_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class FormatError(LedgerError):
    """Bytes that do not parse as the format they claim to be."""

    code = "malformed"


class ValidationFailed(LedgerError):
    """A well-formed record whose content breaks the contract (types, ranges, limits)."""

    code = "invalid"

    def __init__(self, message: str, *, code: str | None = None,
                 errors: list[dict[str, object]] | None = None) -> None:
        super().__init__(message, code=code)
        self.errors = errors or []


def validation_failed(exc: Any, what: str, code: str) -> ValidationFailed:
    """The :class:`ValidationFailed` for a pydantic ``ValidationError`` ``exc``: the first
    error in the message (``<what> is invalid at <loc>: <msg>``), up to 20 in ``errors``."""
    errors: list[dict[str, object]] = [
        {"loc": ".".join(str(p) for p in e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in exc.errors(include_url=False, include_input=False)[:20]]
    first = errors[0] if errors else {"loc": "", "msg": "invalid"}
    return ValidationFailed(f"{what} is invalid at {first['loc'] or '(root)'}: {first['msg']}",
                            code=code, errors=errors)


class VerificationError(LedgerError):
    """A cryptographic or structural check failed: signature, proof, checkpoint."""

    code = "verification_failed"


class SignatureError(VerificationError):
    code = "bad_signature"


class KeyError_(VerificationError):
    """Unknown, revoked, expired or not-yet-valid key, or a key of the wrong purpose."""

    code = "bad_key"


class ProofError(VerificationError):
    """An inclusion or consistency proof does not verify."""

    code = "bad_proof"


class InclusionProofError(ProofError):
    code = "bad_inclusion_proof"


class ConsistencyProofError(ProofError):
    code = "bad_consistency_proof"


class CheckpointError(VerificationError):
    code = "bad_checkpoint"


# --- transparency log (ledger.core.merkle, ledger.core.tiles, ledger.core.note) ---


class TreeRangeError(ValidationFailed):
    """A proof or tile was asked for outside the tree: index >= size, old size > new size."""

    code = "bad_tree_range"


class TileFormatError(FormatError):
    """A malformed tile path, tile data of the wrong length or a malformed entry bundle."""

    code = "malformed_tile"


class TileNotFoundError(LedgerError):
    """A :class:`ledger.core.tiles.TileReader` does not have a tile the tree needs."""

    code = "tile_not_found"


class MalformedNoteError(CheckpointError):
    """Bytes that are not a C2SP signed note, or a key string that does not parse."""

    code = "malformed_note"


class NoteSignatureError(CheckpointError):
    """A signature by a known key (name and key ID match) does not verify."""

    code = "bad_note_signature"


class UnverifiedNoteError(CheckpointError):
    """A well-formed note that no known key has signed."""

    code = "unverified_note"


class MalformedCheckpointError(CheckpointError):
    """A note text that is not a C2SP tlog-checkpoint body."""

    code = "malformed_checkpoint"


class CheckpointOriginError(CheckpointError):
    """A checkpoint from another log: its origin line is not the configured log name."""

    code = "wrong_checkpoint_origin"


# --- strict Ed25519 (ledger.core.ed25519_strict) ---


class WeakKeyError(KeyError_):
    """A public key of small order (anyone can "sign" for it) or with a small-order
    component."""

    code = "weak_public_key"


class NonCanonicalKeyError(KeyError_):
    """A public key that is not the one canonical encoding of its point (y >= p, or x = 0
    with the sign bit set), or not 32 bytes."""

    code = "non_canonical_public_key"


class OffCurveKeyError(KeyError_):
    """32 bytes that encode no point of Ed25519 (refused at registration)."""

    code = "public_key_not_on_curve"


class NonCanonicalSignatureError(SignatureError):
    """A signature with S >= L or with an R that is not canonically encoded: another
    spelling of a signature, refused so each signature has exactly one valid encoding."""

    code = "non_canonical_signature"


class WeakSignatureError(SignatureError):
    """A signature whose R is a small-order point."""

    code = "weak_signature"
