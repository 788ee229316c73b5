"""Replay engines: the batch-invariant PyTorch reference engine and the vLLM adapter.

Importing this package does not import torch; ``load_engine`` and ``ReferenceEngine``
load it on first use, so the interface types in ``workers.engine.api`` stay light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

#: Version of the reference engine's numerics (part of every fingerprint). Bump it when a
#: change can alter any output bit: kernels, chunk sizes, sampler, model code.
ENGINE_VERSION = "0.1.0"

if TYPE_CHECKING:
    from workers.engine.reference import ReferenceEngine

__all__ = ["ENGINE_VERSION", "ReferenceEngine", "load_engine"]


def load_engine(
    model: str | Path, *, device: str = "cpu", dtype: str = "float32",
    batch_invariant: bool = True,
) -> ReferenceEngine:
    """The reference engine for a Hugging Face model directory or the name ``tiny-demo``."""
    from workers.engine.reference import ReferenceEngine

    return ReferenceEngine.from_dir(model, device=device, dtype=dtype,
                                    batch_invariant=batch_invariant)


def __getattr__(name: str) -> Any:
    if name == "ReferenceEngine":
        from workers.engine.reference import ReferenceEngine

        return ReferenceEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
