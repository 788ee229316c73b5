"""Runtime fingerprints: which runtime fields must match for a bitwise replay.

A runtime description is a flat JSON object (the envelope's ``predicate.runtime``). The
fields named in :data:`FINGERPRINT_FIELDS` change numerics and are hashed; everything else
(host name, notes, anything under ``informational``) is kept but not hashed.

``fingerprint_id = "fp-" + first 16 hex digits of SHA-256(JCS(hashed subset))`` where the
hashed subset holds each name in :data:`FINGERPRINT_FIELDS` whose value is present and not
empty (``null``, ``{}`` and ``[]`` count as absent, so "not stated" has one spelling). The
replay queue of a fingerprint is ``replay.<fingerprint_id>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ledger.core.canonical import canonical_json, sha256_hex

#: Fields that change the numbers an engine produces. Order is irrelevant (JCS sorts keys).
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "engine",               # "reference" | "vllm" | "sglang" | ...
    "engine_version",
    "torch_version",
    "cuda_version",          # null on CPU
    "cublas_version",
    "driver_version",
    "gpu_name",
    "compute_capability",    # "9.0"
    "device",                # "cpu" | "cuda"
    "device_count",
    "tensor_parallel_size",
    "attention_backend",
    "quantization",          # null when none
    "dtype",                 # "float32" | "bfloat16" | "float16"
    "batch_invariant",       # bool
    "cpu_isa",               # torch.backends.cpu.get_cpu_capability() on CPU, e.g. "AVX512"
    "cpu_threads",           # intra-op threads: changes reduction order on CPU
    "engine_flags",          # object: engine options that change numerics
)

FINGERPRINT_PREFIX = "fp-"
FINGERPRINT_HEX_DIGITS = 16


def fingerprint_material(runtime: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of ``runtime`` that is hashed; absent, null and empty values are left out."""
    return {
        name: runtime[name]
        for name in FINGERPRINT_FIELDS
        if runtime.get(name) is not None and runtime.get(name) not in ({}, [])
    }


def fingerprint_id(runtime: Mapping[str, Any]) -> str:
    digest = sha256_hex(canonical_json(fingerprint_material(runtime)))
    return FINGERPRINT_PREFIX + digest[:FINGERPRINT_HEX_DIGITS]


def replay_queue(fp_id: str) -> str:
    return f"replay.{fp_id}"
