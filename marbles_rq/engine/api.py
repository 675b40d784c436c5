"""The waiting words as module functions, for code that does not hold the context:
``mr.sleep(60)``, ``mr.ask.approval("Ship?")``, ``mr.start_child(...)``, ``mr.parallel(...)``.
Each acts on the run executing in this thread (see engine/flow.py)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from .execute import current
from .flow import ChildRun


def sleep(seconds: float) -> None:
    """Park the run for `seconds`; the controller wakes it (durable, server clock)."""
    current("mr.sleep").sleep(seconds)


def sleep_until(when: dt.datetime) -> None:
    """Park the run until `when` (timezone-aware)."""
    current("mr.sleep_until").sleep_until(when)


def start_child(workflow: str, input: Any = None, key: str | None = None) -> ChildRun:
    """Start a child run under a stable id; `.result()` waits for it."""
    return current("mr.start_child").start_child(workflow, input, key)


def gather(*children: ChildRun) -> list[Any]:
    """The results of `children`, parking until every one has settled."""
    return current("mr.gather").gather(*children)


def parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run zero-argument callables together; their results, in order."""
    return current("mr.parallel").parallel(*calls)


class _Ask:
    def approval(self, title: str, body: str | None = None, key: str | None = None,
                 **options: Any) -> dict[str, Any]:
        return current("mr.ask.approval").ask.approval(title, body, key, **options)

    def question(self, title: str, body: str | None = None, choices: list[str] | None = None,
                 key: str | None = None, **options: Any) -> str:
        return current("mr.ask.question").ask.question(title, body, choices, key, **options)


class _Report:
    def milestone(self, entry: Any, key: str | None = None) -> None:
        current("mr.report.milestone").report.milestone(entry, key)

    def result(self, entry: Any, key: str | None = None) -> None:
        current("mr.report.result").report.result(entry, key)


ask = _Ask()
report = _Report()
