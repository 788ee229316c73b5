"""Replay engines: the batch-invariant PyTorch reference engine and the vLLM adapter.

Importing this package does not import torch; ``load_engine`` and ``ReferenceEngine``
load it on first use, so the interface types in ``workers.engine.api`` stay light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

#: Version of the reference engine's numerics (part of every fingerprint). Bump it when a
#: change can alter any output bit: kernels, chunk sizes, sampler, model code.
ENGINE_VERSION = "0.2.0"

if TYPE_CHECKING:
    from workers.engine.reference import ReferenceEngine

__all__ = ["DEFAULT_CPU_THREADS", "ENGINE_VERSION", "ReferenceEngine", "load_engine",
           "node_runtime", "set_cpu_threads"]


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

    set_cpu_threads(device, threads)
    return ReferenceEngine.from_dir(model, device=device, dtype=dtype,
                                    batch_invariant=batch_invariant)


def set_cpu_threads(device: str, threads: int | None) -> None:
    """torch's intra-op threads for this process on CPU (part of the fingerprint): what
    ``load_engine``, ``ledger worker`` and ``ledger fingerprint`` all call, so they agree."""
    if threads is not None and str(device).startswith("cpu"):
        import torch

        torch.set_num_threads(threads)


def node_runtime(engine: str = "reference", *, device: str = "cpu", dtype: str = "float32",
                 batch_invariant: bool = True, threads: int | None = DEFAULT_CPU_THREADS,
                 tensor_parallel_size: int = 1, max_num_seqs: int | None = None) -> dict[str, Any]:
    """The runtime (fingerprint input) a worker with these options has, without a model:
    ``ledger fingerprint`` prints its hash, ``ledger check worker`` compares it."""
    if engine == "reference":
        from workers.engine.runtime import reference_runtime

        set_cpu_threads(device, threads)
        return reference_runtime(device, dtype, batch_invariant)
    if engine == "vllm":
        from workers.engine.vllm_adapter import MAX_SERVE_SEQS, vllm_runtime

        return vllm_runtime(dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                            device=device, max_num_seqs=max_num_seqs or MAX_SERVE_SEQS)
    raise ValueError(f"unknown engine {engine!r} (reference | vllm)")


def __getattr__(name: str) -> Any:
    if name == "ReferenceEngine":
        from workers.engine.reference import ReferenceEngine

        return ReferenceEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
