"""How listings look on a terminal: tables with headers, coloured statuses, durations and
one time convention (local time, to the second, with how long ago: ``2026-12-02 09:41:07
(3 min ago)``). Piped output keeps the plain, stable lines each command prints (UTC ISO
8601 with milliseconds) and `--json` is untouched, so scripts and tests that parse them see
no change. rich is imported only when stdout is a terminal."""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import click

from ..terminal import safe

STATUS_STYLES = {
    "succeeded": "green", "failed": "bold red", "cancelled": "magenta", "running": "cyan",
    "waiting": "yellow", "paused": "yellow", "queued": "blue",
    # schedules, leaders, questions
    "active": "green", "orphaned": "red", "registered": "blue", "open": "yellow",
    "alive": "green", "gone": "red", "none": "red",
}


def on_terminal() -> bool:
    return sys.stdout.isatty()


def console() -> Any:
    from rich.console import Console

    # highlight off: rich would colour numbers and words in run data by its own guesses.
    return Console(highlight=False, soft_wrap=False)


def cell(text: Any, style: str | None = None) -> Any:
    """A table cell from run data: terminal escapes made visible, rich markup not read."""
    from rich.text import Text

    return Text(safe("-" if text is None or text == "" else str(text)), style=style or "")


def status_cell(status: str | None) -> Any:
    return cell(status, STATUS_STYLES.get(status or "", ""))


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
          empty: str | None = None) -> None:
    """Print a table (cells: `cell(...)` or plain values); `empty` instead when no rows."""
    from rich.table import Column, Table

    out = console()
    # fold, not rich's ellipsis: a run id cut to "customer-acme…" on a narrow terminal
    # cannot be copied into the next command.
    grid = Table(*(Column(c, overflow="fold") for c in columns), title=title,
                 title_justify="left", header_style="bold", box=None, pad_edge=False)
    n = 0
    for row in rows:
        grid.add_row(*(c if not isinstance(c, (str, int, float)) and c is not None
                       else cell(c) for c in row))
        n += 1
    if n == 0 and empty is not None:
        out.print(empty if title is None else f"{title}: {empty}", markup=False)
        return
    out.print(grid)


def none_match(text: str) -> None:
    """An empty listing says so: on stdout on a terminal, on stderr when piped (the piped
    stdout stays empty, as a script expects)."""
    click.echo(text, err=not on_terminal())


# -- times ---------------------------------------------------------------------------------


def ms_of(value: str | int | float | None) -> int | None:
    """Epoch ms of an ISO 8601 text (as --json prints it) or of a number of ms."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return int(value)
    try:
        return int(dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        return None


def ago(ms: int, now_ms: int | None = None) -> str:
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    delta = (now_ms - ms) / 1000
    text = span(abs(delta) * 1000, coarse=True)
    return "just now" if abs(delta) < 1 else f"{text} ago" if delta > 0 else f"in {text}"


def when(value: str | int | float | None, now_ms: int | None = None) -> str:
    """The terminal's time convention: local time to the second, and how long ago."""
    ms = ms_of(value)
    if ms is None:
        return "-"
    local = dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")
    return f"{local} ({ago(ms, now_ms)})"


def span(ms: float | None, *, coarse: bool = False) -> str:
    """A duration for people: 840 ms, 12.3 s, 4 min 05 s, 2 h 10 min, 3 d 4 h."""
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 1 and not coarse:
        return f"{int(ms)} ms"
    if s < 60:
        return f"{int(s)} s" if coarse else f"{s:.1f} s"
    m = int(s // 60)
    if m < 60:
        return f"{m} min" if coarse else f"{m} min {int(s % 60):02d} s"
    h = m // 60
    if h < 48:
        return f"{h} h" if coarse else f"{h} h {m % 60} min"
    return f"{h // 24} d" if coarse else f"{h // 24} d {h % 24} h"


def took(started: str | None, finished: str | None, now_ms: int | None = None) -> str:
    """How long a run ran: start to finish, or start to now while it runs."""
    start = ms_of(started)
    if start is None:
        return "-"
    end = ms_of(finished)
    if end is None:
        end = int(time.time() * 1000) if now_ms is None else now_ms
    return span(max(0, end - start))


def seconds(value: float | None) -> str:
    """A configured length (a timeout, a retention) the way people say it: 10 min, 7 d."""
    if not value:
        return "none"
    s = float(value)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size and s % size == 0:
            return f"{int(s // size)} {unit}"
    return f"{s:g} s"
