"""The waiting words as module functions, for code that does not hold the context:
``mr.sleep(60)``, ``mr.ask.approval("Ship?")``, ``mr.start_child(...)``, ``mr.parallel(...)``.
Each acts on the run executing in this thread (see engine/waiting.py, engine/fanout.py). In
an async body (engine/async_run.py) the words that may wait are awaited:
``await mr.sleep(60)``; each does its work when called, so its ledger position is that of
the call."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from . import event_waits, fanout, published, signal_waits, waiting
from .context import async_body, awaitable_here, current
from .fanout import ChildRun


def sleep(seconds: float) -> Any:
    """Park the run for `seconds`; the controller wakes it (durable, server clock)."""
    waiting.sleep(current("mr.sleep"), seconds)
    return awaitable_here(None)


def sleep_until(when: dt.datetime) -> Any:
    """Park the run until `when` (timezone-aware)."""
    waiting.sleep_until(current("mr.sleep_until"), when)
    return awaitable_here(None)


def wait_for_signal(name: str, timeout_s: float | None = None) -> Any:
    """The payload of the next signal `name` sent to the run, parking it until one arrives
    (SignalTimeoutError after `timeout_s` without one)."""
    return awaitable_here(signal_waits.wait_for_signal(current("mr.wait_for_signal"), name,
                                                       timeout_s))


def signals(name: str) -> list[Any]:
    """The payloads of the signals `name` buffered now, oldest first; never parks."""
    return signal_waits.drain_signals(current("mr.signals"), name)


def start_child(workflow: str, input: Any = None, key: str | None = None) -> ChildRun:
    """Start a child run under a stable id; `.result()` waits for it."""
    return fanout.start_child(current("mr.start_child"), workflow, input, key)


def gather(*children: ChildRun) -> Any:
    """The results of `children`, parking until every one has settled."""
    return awaitable_here(fanout.gather(current("mr.gather"), list(children)))


def parallel(*calls: Callable[[], Any]) -> Any:
    """Run zero-argument callables together; their results, in order."""
    run = current("mr.parallel")
    if async_body.get():
        from .async_run import must_await
        from .async_run import parallel as parallel_async

        return must_await("mr.parallel(...)",
                          parallel_async(run, list(calls)))  # type: ignore[arg-type]
    return fanout.parallel(run, list(calls))


def now() -> dt.datetime:
    """The time (UTC) on the run's clock, recorded: every replay of the run returns the
    instant its first execution read (see engine/run_clock.py)."""
    from .run_clock import read_clock

    return read_clock(current("mr.now"))


def compensate(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Register `fn(*args, **kwargs)` as an undo of the run executing (see
    engine/compensation.py): it runs, the last registered first, if the run fails."""
    from .compensation import compensate as register

    register(current("mr.compensate"), fn, args, kwargs)


def publish(key: str, value: Any) -> None:
    """Publish `value` under `key` for the run executing (see engine/published.py)."""
    published.publish(current("mr.publish"), key, value)


def wait_for_event(source: str, type: str | None = None, match: dict[str, Any] | None = None,
                   timeout_s: float | None = None,
                   lookback_s: float | None = None) -> Any:
    """Park until a matching inbound event arrives; returns it (see engine/event_waits.py)."""
    return awaitable_here(event_waits.wait_for_event(current("mr.wait_for_event"), source,
                                                     type, match, timeout_s, lookback_s))


class _Ask:
    def approval(self, title: str, body: str | None = None, key: str | None = None,
                 **options: Any) -> Any:
        return awaitable_here(waiting.Ask(current("mr.ask.approval")).approval(
            title, body, key, **options))

    def question(self, title: str, body: str | None = None, choices: list[str] | None = None,
                 key: str | None = None, **options: Any) -> Any:
        return awaitable_here(waiting.Ask(current("mr.ask.question")).question(
            title, body, choices, key, **options))


class _Report:
    def milestone(self, entry: Any, key: str | None = None) -> None:
        waiting.Reporter(current("mr.report.milestone")).milestone(entry, key)

    def result(self, entry: Any, key: str | None = None) -> None:
        waiting.Reporter(current("mr.report.result")).result(entry, key)


ask = _Ask()
report = _Report()
