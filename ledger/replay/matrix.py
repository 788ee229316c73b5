"""The replay matrix report: pure functions over recorded and replayed outputs (no torch).

A matrix run replays a sample of stored records under several serving configurations
(*cells*: co-tenant batch, arrival offsets, prefill chunk size, prefix cache warm, CUDA
graphs off, default kernels) and compares each replay with the record. This module holds
the comparison, the per-cell summary, the JSON report and its rendering (a text table and
an HTML page with an SVG plot); ``workers.engine.matrix`` runs the engine.

Per cell: the share of records whose token ids are identical (and bitwise: logprobs and
logits digests too), a histogram of first-divergence positions, for each divergence the
recorded and replayed top-K at k-1 and k, the largest absolute and relative logprob
differences over the positions both agree on, throughput, p95 request latency and peak
memory.
"""

from __future__ import annotations

import html
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REPORT_TYPE = "https://inference-ledger.dev/matrix-report/v1"

#: The cells ``ledger matrix run`` replays by default (``workers.engine.matrix`` says what
#: each axis does).
DEFAULT_CELLS = ("alone", "batch:8", "arrivals:2", "chunk:1", "chunk:16", "prefix:warm",
                 "graphs:off", "kernels:default", "kernels:default+chunk:16")
AXES = ("batch", "arrivals", "chunk", "prefix", "graphs", "kernels")
_CHOICES = {"prefix": ("warm", "cold"), "graphs": ("on", "off"),
            "kernels": ("default", "invariant")}


def parse_cell(spec: str) -> dict[str, Any]:
    """``batch:8+chunk:16`` -> {"batch": 8, "chunk": 16}; ``alone`` -> {}. Raises
    ValueError naming the bad part (the API and the CLI check cells before any work)."""
    axes: dict[str, Any] = {}
    if spec == "alone":
        return axes
    for part in spec.split("+"):
        name, sep, value = part.partition(":")
        if not sep or name not in AXES or name in axes:
            raise ValueError(f"cell {spec!r}: {part!r} is not axis:value with an axis in "
                             f"{', '.join(AXES)} (each once), or the cell 'alone'")
        if name in ("batch", "arrivals", "chunk"):
            if not value.isdigit() or len(value) > 4 or (int(value) < 1 and name != "arrivals"):
                raise ValueError(f"cell {spec!r}: {name} needs a positive integer below 10000")
            axes[name] = int(value)
        elif value in _CHOICES.get(name, ()):
            axes[name] = value
        else:
            raise ValueError(f"cell {spec!r}: bad value {value!r} for {name}")
    return axes


@dataclass(frozen=True)
class Replayed:
    """One replay's output (the engine result's fields)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None
    logits_sha256: Sequence[str]


@dataclass
class Comparison:
    request_id: str
    tokens_identical: bool
    bitwise: bool
    first_divergence: int | None
    expected_token: int | None
    replayed_token: int | None
    max_abs_logprob_diff: float
    max_rel_logprob_diff: float
    digests_identical: bool
    top_before: dict[str, Any] | None = None      # {"recorded": [[id, lp]...], "replayed": ...}
    top_at: dict[str, Any] | None = None
    logprobs_compared: bool = False   # both sides had per-step logprobs (a tolerance needs them)


def first_divergence(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """First position where two token sequences differ (a length difference counts)."""
    for k, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return k
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _top(steps: Sequence[Sequence[Any]] | None, k: int) -> list[list[Any]] | None:
    if steps is None or not 0 <= k < len(steps):
        return None
    return [[int(t), float(lp)] for t, lp in steps[k]]


def compare(request_id: str, recorded: Mapping[str, Any], replayed: Replayed) -> Comparison:
    """The record's ``output`` object against one replay."""
    exp_tokens = list(recorded.get("token_ids") or [])
    exp_lps = recorded.get("logprobs")
    exp_top = recorded.get("top_logprobs")
    exp_digests = recorded.get("logits_sha256")
    k = first_divergence(exp_tokens, replayed.token_ids)
    agree = len(exp_tokens) if k is None else k
    max_abs = max_rel = 0.0
    lps_equal = exp_lps is not None
    if exp_lps is not None:
        for a, b in zip(exp_lps[:agree], replayed.logprobs[:agree], strict=False):
            diff = abs(float(a) - float(b))
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / max(abs(float(a)), 1e-30) if diff else 0.0)
            lps_equal = lps_equal and float(a).hex() == float(b).hex()
    digests = exp_digests is not None and list(exp_digests) == list(replayed.logits_sha256)
    comp = Comparison(
        request_id=request_id, tokens_identical=k is None,
        bitwise=k is None and lps_equal and (exp_digests is None or digests),
        first_divergence=k,
        expected_token=exp_tokens[k] if k is not None and k < len(exp_tokens) else None,
        replayed_token=replayed.token_ids[k] if k is not None and k < len(replayed.token_ids)
        else None,
        max_abs_logprob_diff=max_abs, max_rel_logprob_diff=max_rel,
        digests_identical=digests,
        logprobs_compared=exp_lps is not None and replayed.logprobs is not None)
    if k is not None:
        comp.top_before = {"recorded": _top(exp_top, k - 1),
                           "replayed": _top(replayed.top_logprobs, k - 1)}
        comp.top_at = {"recorded": _top(exp_top, k), "replayed": _top(replayed.top_logprobs, k)}
    return comp


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class CellResult:
    name: str
    axes: dict[str, Any]
    comparisons: list[Comparison]
    seconds: float
    new_tokens: int
    latencies_s: list[float]
    peak_memory_bytes: int | None
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, tolerance: float | None = None) -> dict[str, Any]:
        n = len(self.comparisons)
        within = {} if tolerance is None else {"within_tolerance": sum(
            within_tolerance(c, tolerance) for c in self.comparisons)}
        firsts = [c.first_divergence for c in self.comparisons if c.first_divergence is not None]
        return {
            "cell": self.name, "axes": self.axes, "records": n,
            "token_identical": sum(c.tokens_identical for c in self.comparisons),
            "token_identical_share": (sum(c.tokens_identical for c in self.comparisons) / n)
            if n else None,
            "bitwise": sum(c.bitwise for c in self.comparisons),
            "first_divergence_histogram": {str(k): v for k, v in
                                           sorted(Counter(firsts).items())},
            "max_abs_logprob_diff": max((c.max_abs_logprob_diff for c in self.comparisons),
                                        default=0.0),
            "max_rel_logprob_diff": max((c.max_rel_logprob_diff for c in self.comparisons),
                                        default=0.0),
            "digests_identical": sum(c.digests_identical for c in self.comparisons),
            "new_tokens_per_s": self.new_tokens / self.seconds if self.seconds > 0 else None,
            "p95_latency_s": percentile(self.latencies_s, 95),
            "peak_memory_bytes": self.peak_memory_bytes,
            "note": self.note,
            **within,
            **self.extra,
        }


def within_tolerance(c: Comparison, tolerance: float) -> bool:
    """The fingerprint gate's test for one replay (``ledger.core.compare`` at the tolerance
    tier): the same tokens, or every logprob before the divergence within ``tolerance``."""
    return c.tokens_identical or (c.logprobs_compared and c.max_abs_logprob_diff <= tolerance)


def report(cells: Sequence[CellResult], *, runtime: Mapping[str, Any],
           records: Sequence[str], source: str,
           unverified: Sequence[Mapping[str, Any]] = (),
           verification: str | None = None,
           tolerance: float | None = None) -> dict[str, Any]:
    """The JSON report of a matrix run. ``records``: the request IDs replayed (each
    checked first); ``unverified``: those that failed a check (``request_id``,
    ``log_index``, ``reason``), not replayed; ``verification``: what the checks believed;
    ``tolerance`` (a fingerprint gate's): each cell also counts the replays within it."""
    return {
        **({} if tolerance is None else {"tolerance": tolerance}),
        "_type": REPORT_TYPE,
        "source": source,
        "verification": verification,
        "records": list(records),
        "unverified": [dict(u) for u in unverified],
        "runtime": dict(runtime),
        "cells": [cell.summary(tolerance) for cell in cells],
        "divergences": {
            cell.name: [vars(c) for c in cell.comparisons if not c.tokens_identical]
            for cell in cells
        },
    }


GATE_CELL = "alone"


def gate_decision(rep: Mapping[str, Any], *, tolerance: float, expected_records: int
                  ) -> tuple[bool, str]:
    """A fingerprint gate's pass/fail from its (signed, checked) matrix report: the report
    states the gate's tolerance, every golden record passed its checks and was replayed in
    the ``alone`` cell, and each replay was within the tolerance. (passed, why)."""
    if rep.get("tolerance") != tolerance:
        return False, f"the report states tolerance {rep.get('tolerance')}, not {tolerance}"
    if rep.get("unverified"):
        return False, f"{len(rep['unverified'])} golden records failed their checks"
    cell = next((c for c in rep.get("cells", []) if c.get("cell") == GATE_CELL), None)
    if cell is None:
        return False, f"the report has no {GATE_CELL!r} cell"
    if cell.get("records") != expected_records:
        return False, f"{cell.get('records')} of {expected_records} golden records replayed"
    within = int(cell.get("within_tolerance") or 0)
    if within != expected_records:
        return False, (f"{expected_records - within} of {expected_records} golden records "
                       f"diverged beyond |dlogprob| {tolerance}")
    return True, (f"all {expected_records} golden records within |dlogprob| {tolerance} "
                  f"({cell.get('token_identical')} token-identical)")


def fingerprint_rows(parts: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Header plus one row per (fingerprint, cell) over a run's parts (``fingerprint_id``
    and a checked ``report`` each, or ``report`` None while that part runs): the
    fingerprint axis of a matrix run, each part signed by the worker that ran it."""
    rows = [["fingerprint", "runtime", "cell", "token-identical", "bitwise",
             "first divergence (pos: n)", "max |dlogprob|"]]
    for part in parts:
        rep = part.get("report")
        if rep is None:
            rows.append([str(part["fingerprint_id"]), "-", "-", f"({part.get('state')})",
                         "-", "-", "-"])
            continue
        for c in rep["cells"]:
            hist = ", ".join(f"{k}: {v}" for k, v in c["first_divergence_histogram"].items())
            rows.append([str(part["fingerprint_id"]), _runtime_plain(rep["runtime"]),
                         c["cell"], f"{c['token_identical']}/{c['records']}",
                         f"{c['bitwise']}/{c['records']}", hist or "-",
                         f"{c['max_abs_logprob_diff']:.3g}"])
    return rows


def _runtime_plain(runtime: Mapping[str, Any]) -> str:
    """The fingerprint axes a worker states (engine and version, dtype, attention
    backend, TP size where it has them, batch invariance)."""
    parts = [f"{runtime.get('engine')} {runtime.get('engine_version')}",
             str(runtime.get("dtype"))]
    if runtime.get("attention_backend"):
        parts.append(f"attn {runtime['attention_backend']}")
    if runtime.get("tensor_parallel_size") not in (None, 1):
        parts.append(f"TP {runtime['tensor_parallel_size']}")
    if runtime.get("batch_invariant") is False:
        parts.append("not batch-invariant")
    return ", ".join(parts)


def table_rows(rep: Mapping[str, Any]) -> list[list[str]]:
    """Header plus one row per cell, as text (the CLI prints it with rich)."""
    rows = [["cell", "token-identical", "bitwise", "first divergence (pos: n)",
             "max |dlogprob|", "max rel", "tok/s", "p95 s", "peak MB"]]
    for c in rep["cells"]:
        hist = ", ".join(f"{k}: {v}" for k, v in c["first_divergence_histogram"].items())
        mem = c["peak_memory_bytes"]
        rows.append([
            c["cell"], f"{c['token_identical']}/{c['records']}",
            f"{c['bitwise']}/{c['records']}", hist or "-",
            f"{c['max_abs_logprob_diff']:.3g}", f"{c['max_rel_logprob_diff']:.3g}",
            f"{c['new_tokens_per_s']:.0f}" if c["new_tokens_per_s"] else "-",
            f"{c['p95_latency_s']:.3f}" if c["p95_latency_s"] is not None else "-",
            f"{mem / 2**20:.0f}" if mem else "-",
        ])
    return rows


def svg_plot(rep: Mapping[str, Any], *, width: int = 640) -> str:
    """Bars: token-identical share per cell; dots: first-divergence positions."""
    cells = rep["cells"]
    row_h, left, plot_w = 26, 150, width - 170
    height = 40 + row_h * max(1, len(cells))
    longest = max([int(k) for c in cells for k in c["first_divergence_histogram"]] + [1])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<text x="{left}" y="14">token-identical share (bar) and first divergence '
             f'positions 0..{longest} (dots)</text>']
    for i, c in enumerate(cells):
        y = 24 + i * row_h
        share = c["token_identical_share"] or 0.0
        parts.append(f'<text x="4" y="{y + 15}">{html.escape(c["cell"])}</text>')
        parts.append(f'<rect x="{left}" y="{y + 3}" width="{plot_w}" height="16" '
                     f'fill="#eee"/>')
        parts.append(f'<rect x="{left}" y="{y + 3}" width="{plot_w * share:.1f}" height="16" '
                     f'fill="{"#3a7" if share == 1 else "#c84"}"/>')
        for k, n in c["first_divergence_histogram"].items():
            cx = left + plot_w * int(k) / longest
            parts.append(f'<circle cx="{cx:.1f}" cy="{y + 11}" r="{min(8, 2 + n)}" '
                         f'fill="#22c" fill-opacity="0.6"><title>position {k}: {n}</title>'
                         f'</circle>')
    parts.append("</svg>")
    return "".join(parts)


def _runtime_text(runtime: Mapping[str, Any]) -> str:
    return html.escape(f"{runtime.get('engine')} {runtime.get('engine_version')} on "
                       f"{runtime.get('device')} ({runtime.get('dtype')})")


def render_html(rep: Mapping[str, Any]) -> str:
    """A self-contained page: the table, the SVG plot, the divergences."""
    rows = table_rows(rep)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>"
                   for r in rows[1:])
    div = []
    for cell, items in rep["divergences"].items():
        for d in items:
            div.append(f"<li>{html.escape(cell)}: {html.escape(d['request_id'])} at "
                       f"{d['first_divergence']}: expected {d['expected_token']}, replayed "
                       f"{d['replayed_token']}; top at k-1 {html.escape(str(d['top_before']))}"
                       f"; top at k {html.escape(str(d['top_at']))}</li>")
    return (
        "<!doctype html><meta charset='utf-8'><title>Replay matrix</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}</style>"
        f"<h1>Replay matrix</h1><p>{len(rep['records'])} records from "
        f"{html.escape(str(rep['source']))}; engine {_runtime_text(rep['runtime'])}</p>"
        f"<table><tr>{head}</tr>{body}</table>{svg_plot(rep)}"
        f"<h2>Divergences</h2><ul>{''.join(div) or '<li>none</li>'}</ul>"
        f"<h2>Not replayed (failed their checks)</h2><ul>{_unverified_html(rep)}</ul>"
    )


def _unverified_html(rep: Mapping[str, Any]) -> str:
    items = [f"<li>{html.escape(str(u.get('request_id')))} (entry {u.get('log_index')}): "
             f"{html.escape(str(u.get('reason')))}</li>" for u in rep.get("unverified", [])]
    return "".join(items) or "<li>none</li>"
