"""What this node's runtime looks like: the envelope's ``runtime`` object.

Field names are exactly ``ledger.core.fingerprint.FINGERPRINT_FIELDS`` (hashed) plus
informational extras (``hostname``, ``cpu_model``) that are not hashed.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import re
import socket
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

#: Relevant CPU features: they select MKL/oneDNN code paths (and so change numerics).
CPU_NUMERIC_FEATURES = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
    "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_fp16", "amx_tile", "asimd", "sve", "sve2",
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {name!r}") from None


@lru_cache(maxsize=1)
def cpu_info() -> dict[str, Any]:
    """Vendor, model name and numerics-relevant feature flags of this CPU."""
    vendor, model, flags = platform.processor() or None, None, set()
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        fields = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in text.splitlines()[:64])
            if v
        )
        vendor = fields.get("vendor_id", vendor)
        model = fields.get("model name", model)
        flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "vendor": vendor,
        "model": model,
        "features": sorted(f for f in CPU_NUMERIC_FEATURES if f in flags),
    }


def cpu_blas() -> str | None:
    """The BLAS torch was built with (``torch.__config__.show()``), e.g. 'MKL 2024.2'."""
    text = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", text)
    if mkl:
        return f"MKL {mkl.group(1)}"
    blas = re.search(r"BLAS_INFO=(\w+)", text)
    return blas.group(1) if blas else None


def _cublas_version() -> str | None:
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        parts = []
        for prop in range(3):   # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    return None


def _driver_version() -> str | None:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, 96) == 0
        nvml.nvmlShutdown()
        return buf.value.decode() if ok else None
    except (OSError, AttributeError):
        return None


def device_runtime(device: str | torch.device) -> dict[str, Any]:
    """The device part of a runtime description (shared by both engines)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    info: dict[str, Any] = {
        "torch_version": torch.__version__,
        "device": dev.type,
        "cuda_version": torch.version.cuda if cuda else None,
        "cublas_version": _cublas_version() if cuda else None,
        "driver_version": _driver_version() if cuda else None,
        "gpu_name": None,
        "compute_capability": None,
        "device_count": 1,
        "cpu_isa": None,
        "cpu_threads": None,
        "hostname": socket.gethostname(),
        "cpu_model": cpu_info()["model"],
    }
    if cuda:
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        info |= {
            "gpu_name": torch.cuda.get_device_name(index),
            "compute_capability": f"{major}.{minor}",
            "device_count": torch.cuda.device_count(),
        }
    else:
        info |= {
            "cpu_isa": torch.backends.cpu.get_cpu_capability(),
            "cpu_threads": torch.get_num_threads(),
        }
    return info


def reference_runtime(
    device: str | torch.device, dtype: str, batch_invariant: bool
) -> dict[str, Any]:
    """Runtime description of the reference engine on this node (no model needed)."""
    from workers.engine import ENGINE_VERSION, ops, torch_kernels
    from workers.engine.sampling import SAMPLER_VERSION

    torch_dtype(dtype)
    dev = torch.device(device)
    backend = ops.backend_name(dev, batch_invariant)
    flags: dict[str, Any] = {"sampler": SAMPLER_VERSION, "kernels": backend}
    if backend == "torch-bi":
        flags |= {
            "linear_chunk_rows": torch_kernels.LINEAR_CHUNK_ROWS,
            "decode_kv_block": torch_kernels.DECODE_KV_BLOCK,
            "prefill_q_block": torch_kernels.PREFILL_Q_BLOCK,
        }
    if backend == "triton-bi":
        module = ops.cuda_kernels()
        flags["cuda_kernels_version"] = getattr(module, "__version__", None)
    if dev.type == "cuda":
        flags["tf32"] = (not batch_invariant) and bool(torch.backends.cuda.matmul.allow_tf32)
    else:
        cpu = cpu_info()
        flags |= {"cpu_blas": cpu_blas(), "cpu_vendor": cpu["vendor"],
                  "cpu_features": cpu["features"]}
    return {
        "engine": "reference",
        "engine_version": ENGINE_VERSION,
        **device_runtime(dev),
        "tensor_parallel_size": 1,
        "attention_backend": backend,
        "quantization": None,
        "dtype": dtype,
        "batch_invariant": batch_invariant,
        "engine_flags": flags,
    }
