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


#: CPU intra-op threads by default. The thread count changes CPU reduction order, so it is
#: part of the fingerprint; one thread makes a fingerprint portable across machines with
#: different core counts, and avoids OpenMP oversubscription (measured here: 2 threads
#: beside a busy API and PostgreSQL on 2 cores ran the invariant path ~400x slower).
DEFAULT_CPU_THREADS = 1


def load_engine(
    model: str | Path, *, device: str = "cpu", dtype: str = "float32",
    batch_invariant: bool = True, threads: int | None = DEFAULT_CPU_THREADS,
) -> ReferenceEngine:
    """The reference engine for a Hugging Face model directory or the name ``tiny-demo``.

    ``threads`` sets torch's intra-op threads for the process on CPU (None: leave as is).
    """
    from workers.engine.reference import ReferenceEngine

    if threads is not None and str(device).startswith("cpu"):
        import torch

        torch.set_num_threads(threads)

    return ReferenceEngine.from_dir(model, device=device, dtype=dtype,
                                    batch_invariant=batch_invariant)


def __getattr__(name: str) -> Any:
    if name == "ReferenceEngine":
        from workers.engine.reference import ReferenceEngine

        return ReferenceEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
