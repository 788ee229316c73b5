"""A vLLM general plugin that pins the top-k/top-p filter to one code path.

vLLM 0.25's ``apply_top_k_top_p`` (``vllm/v1/sample/ops/topk_topp_sampler.py``) sends a
batch of 8 or more rows to a Triton kernel and a smaller one to a PyTorch full sort;
``VLLM_BATCH_INVARIANT=1`` does not touch that choice, and the two paths do not agree
with each other (measured on an H200: 8 of 22 seeded requests with ``top_k > 0`` got
different tokens). So the tokens a request samples with ``top_k``/``top_p`` depend on how
many other requests were in its batch. :func:`register` replaces the function, in every
module that imported it by name, with one that always takes the same path; recording and
replay must then use the same path, which the fingerprint records (:func:`pin_flags`).

Loaded by ``vllm serve`` through the ``vllm.general_plugins`` entry point
``inference_ledger_pin`` (pyproject.toml; vLLM loads general plugins in every process, the
engine core's included), and called directly by :class:`~workers.engine.vllm_adapter.
VLLMEngine` before it builds ``vllm.LLM``. Idempotent. No vLLM file is edited.

Path: ``INFERENCE_LEDGER_VLLM_TOPK_PATH`` = ``pytorch`` (default: a full sort, pure torch
ops) or ``triton``. Only vLLM versions in :data:`SUPPORTED_VLLM` are patched: on any other
version nothing is changed and :func:`pin_flags` says so (the adapter then refuses to call
the runtime batch invariant).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

# under "vllm.": vLLM's own handler prints it at INFO in every process that loads the pin
log = logging.getLogger("vllm.inference_ledger_pin")

PLUGIN_NAME = "inference_ledger_pin"
PLUGIN_VERSION = "1"
TOPK_PATH_ENV = "INFERENCE_LEDGER_VLLM_TOPK_PATH"
TOPK_PATHS = ("pytorch", "triton")
#: vLLM versions whose sampler this plugin knows (the module layout and the branch above).
SUPPORTED_VLLM = ("0.25.",)
#: The module that defines ``apply_top_k_top_p`` and the ones that import it by name.
SAMPLER_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
IMPORTERS = (
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.worker.gpu.sample.states",
    "vllm.v1.worker.gpu.sample.sampler",
)

_state: dict[str, Any] = {"path": None, "patched": ()}


def topk_path() -> str:
    path = os.environ.get(TOPK_PATH_ENV, "pytorch")
    if path not in TOPK_PATHS:
        raise ValueError(f"{TOPK_PATH_ENV} must be one of {', '.join(TOPK_PATHS)}, not {path!r}")
    return path


def version_supported(version: str) -> bool:
    return any(version.startswith(prefix) for prefix in SUPPORTED_VLLM)


def make_pinned(module: Any, path: str) -> Any:
    """``apply_top_k_top_p`` that takes ``path`` for every batch size."""
    impl = module.apply_top_k_top_p_triton if path == "triton" \
        else module.apply_top_k_top_p_pytorch

    def apply_top_k_top_p(logits: Any, k: Any, p: Any) -> Any:
        if p is None and k is None:
            return logits
        return impl(logits, k, p)

    apply_top_k_top_p.inference_ledger_pin = path  # type: ignore[attr-defined]
    return apply_top_k_top_p


def register() -> None:
    """The ``vllm.general_plugins`` entry point: pin the top-k/top-p path (idempotent)."""
    import vllm

    if not version_supported(vllm.__version__):
        log.warning("inference-ledger: vLLM %s is not one this plugin knows (%s); the "
                    "top-k/top-p path is NOT pinned", vllm.__version__, SUPPORTED_VLLM)
        return
    path = topk_path()
    sampler: Any = importlib.import_module(SAMPLER_MODULE)
    if path == "triton" and not getattr(sampler, "HAS_TRITON", False):
        raise RuntimeError("INFERENCE_LEDGER_VLLM_TOPK_PATH=triton but vLLM has no Triton")
    current = sampler.apply_top_k_top_p
    if getattr(current, "inference_ledger_pin", None) == path:
        return
    original = getattr(current, "inference_ledger_original", current)
    pinned = make_pinned(sampler, path)
    pinned.inference_ledger_original = original
    patched = [SAMPLER_MODULE]
    sampler.apply_top_k_top_p = pinned
    for name in IMPORTERS:
        try:
            module: Any = importlib.import_module(name)
        except ImportError:      # an optional runner: nothing imported the function there
            continue
        if hasattr(module, "apply_top_k_top_p"):
            module.apply_top_k_top_p = pinned
            patched.append(name)
    _state.update(path=path, patched=tuple(patched))
    log.info("inference-ledger: top-k/top-p pinned to the %s path in %s", path,
             ", ".join(patched))


def active_path() -> str | None:
    """The pinned path if every module that holds the function holds the pinned one."""
    path = _state["path"]
    if path is None:
        return None
    for name in _state["patched"]:
        module = importlib.import_module(name)
        if getattr(module.apply_top_k_top_p, "inference_ledger_pin", None) != path:
            return None
    return str(path)


def pin_flags() -> dict[str, Any]:
    """What the fingerprint records about the plugin (``engine_flags``)."""
    return {"plugin": f"{PLUGIN_NAME}/{PLUGIN_VERSION}" if active_path() else None,
            "topk_topp_path": active_path() or "vllm-default (<8 rows: pytorch, else triton)"}


def entry_point_installed() -> bool:
    """Whether this package's ``vllm.general_plugins`` entry point is installed (so that
    ``vllm serve`` loads the pin in every process)."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME and ep.value.startswith(__name__ + ":")
               for ep in entry_points(group="vllm.general_plugins"))


def expected_flags(vllm_version: str) -> dict[str, Any]:
    """What :func:`pin_flags` will say inside a ``vllm serve`` of this environment (for
    ``ledger fingerprint --engine vllm``, which builds no engine)."""
    allowed = os.environ.get("VLLM_PLUGINS")
    loads = allowed is None or PLUGIN_NAME in allowed.split(",")
    if version_supported(vllm_version) and entry_point_installed() and loads:
        return {"plugin": f"{PLUGIN_NAME}/{PLUGIN_VERSION}", "topk_topp_path": topk_path()}
    return {"plugin": None, "topk_topp_path": "vllm-default (<8 rows: pytorch, else triton)"}
