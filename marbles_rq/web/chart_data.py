"""What the dashboard's charts show, read from the controllers' per-minute rollups
(store/rollups.py) and binned for the span asked: runs finished by status, the duration
percentiles of the busiest workflows, and the queue and waiting samples."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup

from ..deployment import Settings
from ..store.replies import server_ms
from ..store.rollups import MINUTE_MS, MinuteRollup, read_minutes
from . import charts

# span -> (bins, minutes per bin)
SPANS = {"1h": (60, 1), "6h": (72, 5), "24h": (48, 30)}
DEFAULT_SPAN = "1h"
TOP_WORKFLOWS = 4
STACK = (("succeeded", "s-ok"), ("failed", "s-bad"), ("cancelled", "s-idle"))
PALETTE = ("c1", "c2", "c3", "c4")


@dataclass(frozen=True)
class Charts:
    span: str
    spans: list[str]
    runs: Markup
    durations: Markup
    queues: Markup
    empty: bool
    legend_workflows: list[tuple[str, str]]


def span_of(value: str | None) -> str:
    return value if value in SPANS else DEFAULT_SPAN


def charts_context(settings: Settings, span: str | None) -> Charts:
    span = span_of(span)
    client = settings.reader().client
    now_minute = server_ms(client) // MINUTE_MS
    return build(read_minutes(client, settings.keys, now_minute - _minutes(span) + 1,
                              now_minute), now_minute, span)


def _minutes(span: str) -> int:
    bins, per = SPANS[span]
    return bins * per


def _label(minute: int, per: int) -> str:
    t = time.gmtime(minute * 60)
    return time.strftime("%H:%M", t) if per < 1440 else time.strftime("%m-%d", t)


def build(minutes: dict[int, MinuteRollup], now_minute: int, span: str) -> Charts:
    """The three charts of `span` ending at `now_minute` (UTC labels), from `minutes`."""
    bins, per = SPANS[span]
    first = now_minute - bins * per + 1
    groups = [[minutes[m] for m in range(first + i * per, first + (i + 1) * per)
               if m in minutes] for i in range(bins)]
    labels = [_label(first + i * per, per) for i in range(bins)]
    bars = [charts.Bar(label, {k: sum(getattr(r, k) for r in group) for k, _ in STACK})
            for label, group in zip(labels, groups, strict=True)]
    counts: dict[str, int] = {}
    for group in groups:
        for r in group:
            for name, d in r.durations.items():
                counts[name] = counts.get(name, 0) + d.n
    busiest = sorted(counts, key=lambda n: (-counts[n], n))[:TOP_WORKFLOWS]
    series: list[charts.Line] = []
    legend: list[tuple[str, str]] = []
    for name, css in zip(busiest, PALETTE, strict=False):
        p50: list[float | None] = []
        p95: list[float | None] = []
        for group in groups:
            ds = [r.durations[name] for r in group if name in r.durations]
            n = sum(d.n for d in ds)
            # Percentiles of minutes do not combine exactly: the bin shows the n-weighted
            # median of the minutes' medians and the worst minute's p95.
            p50.append(sum(d.p50_ms * d.n for d in ds) / n if n else None)
            p95.append(max(d.p95_ms for d in ds) if ds else None)
        series += [charts.Line(f"{name} p50", p50, css),
                   charts.Line(f"{name} p95", p95, css, dashed=True)]
        legend.append((name, css))
    queued = [_last(group, "queued") for group in groups]
    questions = [_last(group, "questions") for group in groups]
    waiting = [_last(group, "waiting") for group in groups]
    title = f"last {span}, UTC"
    return Charts(
        span=span, spans=list(SPANS),
        runs=Markup(charts.stacked_bars("chart-runs", f"Runs finished per {_per(per)}, by "
                                        f"status ({title})", bars, STACK)),
        durations=Markup(charts.lines("chart-durations", f"Run duration p50 and p95 per "
                                      f"workflow ({title})", labels, series, charts.seconds)),
        queues=Markup(charts.lines("chart-queues", f"Deliveries queued, open questions and "
                                   f"timed waits ({title})", labels,
                                   [charts.Line("queued", queued, "c1"),
                                    charts.Line("open questions", questions, "c3"),
                                    charts.Line("timed waits", waiting, "c4")],
                                   lambda v: f"{v:.0f}")),
        empty=not minutes, legend_workflows=legend)


def _per(per: int) -> str:
    return "minute" if per == 1 else f"{per} minutes"


def _last(group: list[Any], field: str) -> float | None:
    for r in reversed(group):
        value = getattr(r, field)
        if value >= 0:
            return float(value)
    return None
