"""``--set NAME=INT,...`` for the engine benchmarks: not-numerics constants of
``workers.engine.cuda_kernels`` (``_FEW_ROWS=128``, ``_SPLIT_ROWS=0``: bits stay, speed may
not) or ``static_decode.NAME`` (``static_decode.PREFILL_GRAPHS=0``: prompt forwards
eagerly), set before the engine runs, so one device call can compare policies."""

from __future__ import annotations

HELP = ("workers.engine.cuda_kernels constants for the run (not numerics ones, e.g. "
        "_FEW_ROWS=128 or _SPLIT_ROWS=0: bits stay, speed may not), or "
        "static_decode.PREFILL_GRAPHS=0 (prompt forwards eagerly)")


def apply(spec: str) -> None:
    """Set each ``NAME=INT`` of the comma-separated ``spec`` (empty: nothing)."""
    if not spec:
        return
    from workers.engine import cuda_kernels, static_decode

    for item in spec.split(","):
        name, value = item.split("=")
        module = static_decode if name.startswith("static_decode.") else cuda_kernels
        name = name.removeprefix("static_decode.")
        if not hasattr(module, name):
            raise SystemExit(f"--set: no {module.__name__}.{name}")
        setattr(module, name, int(value))
