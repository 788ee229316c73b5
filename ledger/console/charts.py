"""Small charts as inline SVG geometry, computed on the server (no JavaScript, no CDN).

Pure functions: numbers in, coordinates out. The templates draw them (Jinja escapes every
label), so a token's text can never become markup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    label: str
    value: str
    css: str = ""


@dataclass
class Chart:
    width: int
    height: int
    bars: list[Bar] = field(default_factory=list)
    points: str = ""                      # a polyline's "x,y x,y ..."
    dots: list[Bar] = field(default_factory=list)
    axis: list[tuple[float, float, str]] = field(default_factory=list)  # (x, y, text)
    zero_y: float | None = None
    title: str = ""


def topk_bars(entries: list[tuple[str, float, bool]], *, width: int = 300,
              row: int = 18, title: str = "") -> Chart:
    """Horizontal bars of probabilities for top-k entries (label, logprob, is_chosen);
    longer is likelier. The bar length is exp(logprob), so -0.1 and -5 look different."""
    import math

    chart = Chart(width, max(1, len(entries)) * row + 4, title=title)
    label_w = 110
    for i, (label, logprob, chosen) in enumerate(entries):
        p = math.exp(max(logprob, -50.0))
        w = max(1.0, (width - label_w - 60) * p)
        chart.bars.append(Bar(label_w, 2 + i * row, w, row - 4, label, f"{logprob:.4f}",
                              "chosen" if chosen else ""))
    return chart


def step_diffs(diffs: list[float | None], *, highlight: int | None = None, what: str = "",
               width: int = 640, height: int = 140) -> Chart:
    """A bar per step of |replayed - recorded| logprob; ``highlight`` marks step k."""
    known = [abs(d) for d in diffs if d is not None]
    title = "per-step |logprob difference|" + what + (
        ": all 0, identical bit for bit" if known and max(known) == 0 else "")
    chart = Chart(width, height, title=title)
    n = max(1, len(diffs))
    top = max(known) if known and max(known) > 0 else 1.0
    left, bottom, plot_h = 50, height - 20, height - 34
    step_w = (width - left - 10) / n
    for i, d in enumerate(diffs):
        if d is None:
            continue
        h = plot_h * abs(d) / top
        chart.bars.append(Bar(left + i * step_w, bottom - h, max(1.0, step_w * 0.8), h,
                              f"step {i}", f"{d:+.3g}", "k" if i == highlight else ""))
    chart.axis = [(4, bottom - plot_h + 4, f"{top:.2g}"), (4, bottom, "0"),
                  (left, height - 4, "step 0"), (width - 60, height - 4, f"step {n - 1}")]
    return chart


def drift_over_time(points: list[tuple[datetime, float]], *, width: int = 640,
                    height: int = 180) -> Chart:
    """Drift rate (0..1) of each run against its time, oldest on the left."""
    chart = Chart(width, height, title="drift rate per run")
    left, bottom, plot_h = 44, height - 22, height - 36
    chart.axis = [(4, bottom - plot_h + 4, "100%"), (4, bottom, "0%")]
    if not points:
        return chart
    points = sorted(points)
    t0, t1 = points[0][0].timestamp(), points[-1][0].timestamp()
    span = (t1 - t0) or 1.0
    coords = []
    for t, rate in points:
        x = left + (width - left - 12) * ((t.timestamp() - t0) / span if t1 > t0 else 0.5)
        y = bottom - plot_h * rate
        coords.append(f"{x:.1f},{y:.1f}")
        chart.dots.append(Bar(x, y, 3, 3, t.strftime("%Y-%m-%d %H:%M"), f"{rate:.1%}",
                              "bad" if rate > 0 else ""))
    chart.points = " ".join(coords)
    chart.axis += [(left, height - 4, points[0][0].strftime("%m-%d %H:%M")),
                   (width - 90, height - 4, points[-1][0].strftime("%m-%d %H:%M"))]
    return chart


def share_bars(cells: list[dict[str, object]], *, width: int = 640, row: int = 20) -> Chart:
    """A matrix report's token-identical share per cell (horizontal bars, 0..100%)."""
    chart = Chart(width, max(1, len(cells)) * row + 4,
                  title="token-identical share per cell")
    label_w = 190
    for i, c in enumerate(cells):
        share = c.get("token_identical_share")
        value = float(share) if isinstance(share, (int, float)) else 0.0
        chart.bars.append(Bar(label_w, 2 + i * row, max(1.0, (width - label_w - 90) * value),
                              row - 4, str(c.get("cell")),
                              f"{c.get('token_identical')}/{c.get('records')} "
                              f"({value:.0%})", "" if value == 1 else "k"))
    return chart


def divergence_histogram(histogram: dict[str, int], *, what: str = "", width: int = 640,
                         height: int = 140) -> Chart:
    """A bar per output position: how many records first diverged there."""
    positions = {int(k): int(v) for k, v in histogram.items()}
    n = max(positions, default=0) + 1
    chart = Chart(width, height, title=f"first-divergence positions{what}"
                  + ("" if positions else ": none"))
    top = max(positions.values(), default=1)
    left, bottom, plot_h = 50, height - 20, height - 34
    step_w = (width - left - 10) / n
    for k, count in sorted(positions.items()):
        h = plot_h * count / top
        chart.bars.append(Bar(left + k * step_w, bottom - h, max(1.0, step_w * 0.8), h,
                              f"position {k}", str(count), "k"))
    chart.axis = [(4, bottom - plot_h + 4, str(top)), (4, bottom, "0"),
                  (left, height - 4, "pos 0"), (width - 60, height - 4, f"pos {n - 1}")]
    return chart
