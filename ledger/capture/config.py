"""What a gateway states about every inference it records: artifacts, runtime, key.

- ``artifacts``: the JSON ``ledger artifact hash MODEL_DIR`` prints
  (``model_sha256``, ``tokenizer_sha256``, ``chat_template_sha256``, ``model_name``).
- ``runtime``: the JSON ``ledger fingerprint`` prints on the GPU node
  (``{"fingerprint_id": ..., "runtime": {...}}``); the ``fingerprint_id`` is checked
  against the runtime so a hand-edited file cannot route replays to the wrong queue.
- the producer key: a PEM private key (``ledger keys generate --out FILE``), registered
  with the ledger as a producer key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.capture.exchange import SamplingDefaults
from ledger.core.envelope import Artifacts, Runtime
from ledger.core.fingerprint import fingerprint_id
from ledger.core.keys import load_private_pem


class CaptureConfigError(ValueError):
    """A capture configuration file is missing, malformed or inconsistent."""


def _read_json(path: str | Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text("utf-8"))
    except OSError as exc:
        raise CaptureConfigError(f"cannot read the {what} file {path}: {exc}") from None
    except ValueError as exc:
        raise CaptureConfigError(f"the {what} file {path} is not JSON: {exc}") from None


def check_artifacts(data: Any) -> dict[str, Any]:
    try:
        return Artifacts.model_validate(data).model_dump()
    except ValueError as exc:
        raise CaptureConfigError(f"invalid artifacts: {exc}") from None


def check_fingerprint(data: Any) -> dict[str, Any]:
    """The runtime of a ``ledger fingerprint`` document (or of a bare runtime object)."""
    if not isinstance(data, dict):
        raise CaptureConfigError("a fingerprint document must be a JSON object")
    runtime = data.get("runtime", data)
    try:
        Runtime.model_validate(runtime)
    except ValueError as exc:
        raise CaptureConfigError(f"invalid runtime: {exc}") from None
    stated = data.get("fingerprint_id")
    actual = fingerprint_id(runtime)
    if stated is not None and stated != actual:
        raise CaptureConfigError(f"fingerprint_id {stated} does not match its runtime "
                                 f"(which hashes to {actual})")
    return dict(runtime)


def load_key(path: str | Path) -> Ed25519PrivateKey:
    try:
        return load_private_pem(Path(path).read_bytes())
    except OSError as exc:
        raise CaptureConfigError(f"cannot read the key file {path}: {exc}") from None
    except ValueError as exc:
        raise CaptureConfigError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class CaptureConfig:
    """The static part of every envelope a gateway records."""

    artifacts: dict[str, Any]
    runtime: dict[str, Any]
    channel: str | None = None       # None: "deterministic" iff runtime.batch_invariant
    tier: str | None = None          # None: "bitwise" (deterministic) or "token"
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        object.__setattr__(self, "artifacts", check_artifacts(self.artifacts))
        object.__setattr__(self, "runtime", check_fingerprint(self.runtime))
        if self.channel not in (None, "deterministic", "performance"):
            raise CaptureConfigError("channel must be deterministic or performance")
        if self.tier not in (None, "bitwise", "token"):
            raise CaptureConfigError("tier must be bitwise or token")

    @classmethod
    def from_files(cls, *, artifacts: str | Path, fingerprint: str | Path,
                   sampling_defaults: str | Path | None = None, **kw: Any) -> CaptureConfig:
        defaults = SamplingDefaults()
        if sampling_defaults is not None:
            try:
                defaults = SamplingDefaults.from_mapping(
                    _read_json(sampling_defaults, "sampling defaults"))
            except (TypeError, ValueError) as exc:
                raise CaptureConfigError(f"{sampling_defaults}: {exc}") from None
        return cls(artifacts=_read_json(artifacts, "artifacts"),
                   runtime=_read_json(fingerprint, "fingerprint"),
                   sampling_defaults=defaults, **kw)

    @property
    def fingerprint_id(self) -> str:
        return fingerprint_id(self.runtime)

    @property
    def effective_channel(self) -> str:
        if self.channel is not None:
            return self.channel
        return "deterministic" if self.runtime.get("batch_invariant") is True else "performance"

    @property
    def effective_tier(self) -> str:
        if self.tier is not None:
            return self.tier
        return "bitwise" if self.effective_channel == "deterministic" else "token"
