"""The dashboard's charts, drawn on the server as inline SVG: no build step, no script. Each
function is pure (series in, SVG text out), so a test can count its bars; every chart is an
image with a title and a description for a screen reader, every bar and point a <title> (a
tooltip), and colours come from the stylesheet's classes (light and dark). The name and the
description are the <title> and <desc> children (SVG's own), not aria-labelledby, so a form
control's label search never finds a chart whose title says "status" or "workflow"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

WIDTH, HEIGHT = 640, 180
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 10, 22


@dataclass(frozen=True)
class Bar:
    label: str                       # what the bar covers ("14:05")
    values: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Line:
    name: str
    points: Sequence[float | None]   # one per x label; None: nothing known there
    css: str = ""                    # a class of the stylesheet (its colour)
    dashed: bool = False


def _nice_max(top: float) -> float:
    """A round axis maximum at or above `top` (1, 2, 5 x a power of ten)."""
    if top <= 0:
        return 1.0
    scale = 1.0
    while scale * 10 <= top:
        scale *= 10
    while scale > top:
        scale /= 10
    for step in (1, 2, 5, 10):
        if step * scale >= top:
            return step * scale
    return 10 * scale


def _frame(chart_id: str, title: str, desc: str, body: list[str], top_label: str,
           x_labels: Sequence[str]) -> str:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'role="img" '
             f'preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">',
             f'<title id="{escape(chart_id)}-t">{escape(title)}</title>',
             f'<desc id="{escape(chart_id)}-d">{escape(desc)}</desc>',
             f'<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" '
             f'y2="{TOP + plot_h}"/>',
             f'<line class="grid" x1="{LEFT}" y1="{TOP}" x2="{LEFT + plot_w}" y2="{TOP}"/>',
             f'<text class="tick" x="{LEFT - 4}" y="{TOP + 4}" text-anchor="end">'
             f'{escape(top_label)}</text>',
             f'<text class="tick" x="{LEFT - 4}" y="{TOP + plot_h}" text-anchor="end">0</text>']
    n = len(x_labels)
    if n:
        for i in sorted({0, n // 2, n - 1}):
            x = LEFT + (i + 0.5) * plot_w / n
            anchor = "start" if i == 0 else "end" if i == n - 1 else "middle"
            parts.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT - 6}" '
                         f'text-anchor="{anchor}">{escape(x_labels[i])}</text>')
    return "".join(parts + body + ["</svg>"])


def stacked_bars(chart_id: str, title: str, bars: Sequence[Bar],
                 stack: Sequence[tuple[str, str]]) -> str:
    """One bar per entry of `bars`, its `values` stacked in the order of `stack` ((key, the
    stylesheet class of its colour)), bottom up. Every bar is a <g class="bar"> (also when
    empty), each segment a <rect> with a tooltip."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = _nice_max(max((sum(b.values.get(k, 0) for k, _ in stack) for b in bars),
                        default=0))
    slot = plot_w / max(1, len(bars))
    gap = min(2.0, slot * 0.2)
    body: list[str] = []
    totals = {k: 0 for k, _ in stack}
    for i, bar in enumerate(bars):
        x = LEFT + i * slot + gap / 2
        y = float(TOP + plot_h)
        what = ", ".join(f"{bar.values.get(k, 0)} {k}" for k, _ in stack)
        segs = [f'<g class="bar"><title>{escape(bar.label)}: {escape(what)}</title>']
        for key, css in stack:
            value = bar.values.get(key, 0)
            totals[key] += value
            if value <= 0:
                continue
            h = value / top * plot_h
            y -= h
            segs.append(f'<rect class="{escape(css)}" x="{x:.1f}" y="{y:.1f}" '
                        f'width="{max(0.5, slot - gap):.1f}" height="{h:.1f}"/>')
        body.append("".join(segs) + "</g>")
    desc = (f"{len(bars)} bars" + (f" from {bars[0].label} to {bars[-1].label}" if bars else "")
            + "; in all " + ", ".join(f"{n} {k}" for k, n in totals.items()))
    return _frame(chart_id, title, desc, body, f"{top:g}", [b.label for b in bars])


def lines(chart_id: str, title: str, x_labels: Sequence[str], series: Sequence[Line],
          fmt: Callable[[float], str] = lambda v: f"{v:g}") -> str:
    """A polyline per series over the x labels (a gap where a point is None), a dot with a
    tooltip per known point."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    known = [p for s in series for p in s.points if p is not None]
    top = _nice_max(max(known, default=0))
    n = max(1, len(x_labels))
    body: list[str] = []
    for s in series:
        runs: list[list[tuple[float, float]]] = [[]]
        dots: list[str] = []
        for i, value in enumerate(s.points):
            if value is None:
                runs.append([])
                continue
            x = LEFT + (i + 0.5) * plot_w / n
            y = TOP + plot_h - value / top * plot_h
            runs[-1].append((x, y))
            label = x_labels[i] if i < len(x_labels) else ""
            dots.append(f'<circle class="{escape(s.css)}" cx="{x:.1f}" cy="{y:.1f}" r="2">'
                        f'<title>{escape(label)}: {escape(s.name)} {escape(fmt(value))}'
                        f'</title></circle>')
        paths = [" ".join(f"{x:.1f},{y:.1f}" for x, y in run) for run in runs if len(run) > 1]
        dash = ' stroke-dasharray="4 3"' if s.dashed else ""
        body.append(f'<g class="series" data-name="{escape(s.name)}">'
                    + "".join(f'<polyline class="{escape(s.css)}" points="{p}"{dash}/>'
                              for p in paths)
                    + "".join(dots) + "</g>")
    latest = []
    for s in series:
        last = next((p for p in reversed(s.points) if p is not None), None)
        latest.append(f"{s.name} {'no data' if last is None else fmt(last)}")
    desc = (f"{len(series)} series over {len(x_labels)} points; latest: "
            + ("; ".join(latest) if latest else "none"))
    return _frame(chart_id, title, desc, body, fmt(top), x_labels)


def seconds(ms: float) -> str:
    """A duration in ms as the axis and tooltips show it."""
    s = ms / 1000
    if s < 1:
        return f"{ms:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
