"""Line plots as PNG files drawn with Pillow, so the project needs no plotting library.

Enough for a loss curve or an accuracy-against-tokens plot: several named series of (x, y)
points, linear axes with tick labels, a legend, optional log-scaled y.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

_COLOURS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
]


@dataclass
class Series:
    """One line of a plot."""

    name: str
    xs: list[float]
    ys: list[float]
    markers: bool = False
    """Draw a dot at every point (for few points); lines only otherwise."""
    labels: list[str] = field(default_factory=list)
    """Optional text drawn next to each point (same length as xs)."""


def _ticks(lo: float, hi: float, num: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / num
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), default=10 * mag)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-2):
        return f"{v:.0e}"
    return f"{v:.10g}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}"


def line_plot(
    path: str | Path,
    series: list[Series],
    title: str,
    xlabel: str,
    ylabel: str,
    size_px: tuple[int, int] = (800, 500),
    log_y: bool = False,
    y_range: tuple[float, float] | None = None,
) -> Path:
    """Draw `series` into a PNG at `path`; returns the path."""
    from PIL import Image, ImageDraw

    width, height = size_px
    left, right, top, bottom = 70, 20, 40, 55
    img = Image.new("RGB", size_px, "white")
    draw = ImageDraw.Draw(img)

    def ty(y: float) -> float:
        return math.log10(max(y, 1e-12)) if log_y else y

    xs = [x for s in series for x in s.xs]
    ys = [ty(y) for s in series for y in s.ys]
    if not xs:
        raise ValueError("nothing to plot: every series is empty")
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = (ty(y_range[0]), ty(y_range[1])) if y_range else (min(ys), max(ys))
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 1, y_hi + 1
    pw, ph = width - left - right, height - top - bottom

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * pw, top + ph - (ty(y) - y_lo) / (y_hi - y_lo) * ph)

    draw.rectangle([left, top, left + pw, top + ph], outline="black")
    for t in _ticks(x_lo, x_hi):
        x = left + (t - x_lo) / (x_hi - x_lo) * pw
        draw.line([x, top + ph, x, top + ph + 4], fill="black")
        draw.text((x - 10, top + ph + 6), _fmt(t), fill="black")
    if log_y:
        values = [m * 10.0**e for e in range(math.floor(y_lo), math.ceil(y_hi) + 1) for m in (1, 2, 5)]
        values = [v for v in values if y_lo <= math.log10(v) <= y_hi]
        if len(values) < 3:  # less than a decade: plain ticks, placed on the log scale
            values = [v for v in _ticks(10**y_lo, 10**y_hi) if v > 0]
        y_ticks = [math.log10(v) for v in values]
        y_labels = [_fmt(v) for v in values]
    else:
        y_ticks = _ticks(y_lo, y_hi)
        y_labels = [_fmt(t) for t in y_ticks]
    for t, label in zip(y_ticks, y_labels):
        y = top + ph - (t - y_lo) / (y_hi - y_lo) * ph
        draw.line([left - 4, y, left + pw, y], fill=(225, 225, 225))
        draw.line([left - 4, y, left, y], fill="black")
        draw.text((5, y - 6), label, fill="black")
    draw.text((left, 12), title, fill="black")
    draw.text((left + pw // 2 - 3 * len(xlabel), height - 20), xlabel, fill="black")
    draw.text((5, top - 18), ylabel, fill="black")
    for i, s in enumerate(series):
        colour = _COLOURS[i % len(_COLOURS)]
        points = [px(x, y) for x, y in zip(s.xs, s.ys)]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        if s.markers or len(points) == 1:
            for x, y in points:
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour)
        for (x, y), label in zip(points, s.labels):
            draw.text((x + 6, y - 14), label, fill=colour)
        ly = top + 8 + 14 * i
        draw.line([left + pw - 150, ly + 6, left + pw - 130, ly + 6], fill=colour, width=3)
        draw.text((left + pw - 125, ly), s.name, fill="black")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)
    return out
