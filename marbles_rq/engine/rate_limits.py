"""Rate limits per key: ``@mr.workflow(rate_limit="100/min", rate_key="customer")`` and, in a
body, ``mr.rate_limit("stripe", "25/s")`` before a step.

**The limiter.** Each limit (a name: the workflow's, one per value of its key, or the one a
body passes) is GCRA in one Lua script (lua/take_rate.lua) on the limit's own hash tag, on
the Redis server's clock: exact on one Redis and on a cluster. Burst 1 (the default) spaces
admissions at least one interval (period / N) apart, so no window of one period holds more
than N; ``mr.Rate("25/s", burst=5)`` lets 5 through at once after a quiet spell.

**Held runs hold no worker.** A run the limit refuses joins the limit's queue (in the same
script: one FIFO per limit, in order of arrival) and parks, reason ``rate_limit``, with a
durable timer at its estimated turn less EARLY_MS; the controller wakes it like any timer
(after a restart too: the timer is the run's own, nothing else has to remember it). Woken,
the run replays to the same call and asks again. Only the queue's head may pass, and a
newcomer never passes a waiting queue, so runs are let through in order of arrival and each
wakes about once (a run woken before its turn, because those ahead took theirs late, parks
again until its new estimate). A head that comes back within IN_PLACE_MS of its turn waits
in place (a sleep of at most that long) rather than park again: the trip back through the
controller would eat that much of the rate (so does the run next after it: it becomes the
head one interval later). A head that has not come back STALE_MS after
its turn (cancelled, lost) is dropped so it cannot block the rest.

**Recorded once.** The admission is a ledger entry of its own (``<frame>.|rate:<name>#<n>``,
outside the frame's positions, like a patch decision: a limit added under running runs moves
no recorded call), held for the execution's next write. A replay returns at once; a
redelivery whose ledger lost it (a kill before the next write) gets the same admission from
the limiter, which remembers each caller's admission for KEEP_MS: nothing is taken twice.
The workflow's own limit is taken once, before the body's first step.

**The step's start is the admission.** The first step started after an admission records
the admission instant as its start (its ``step_started`` event's ``started_ms`` and its
ledger entry's ``at_ms``), so the starts a limit lets through are spaced exactly as it
admitted them.

Rates can be changed at run time (``marbles-rq limits set NAME RATE``, by a limit's name or
by a workflow's name for all its keys); a worker reads them at most OVERRIDES_TTL_S old.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ..store.records import StepRecord
from .authoring import InputError
from .context import Run, awaitable_here, check_branch, check_not_in_foreign_thread, current
from .rate_specs import MAX_NAME, Rate, as_rate, check_name
from .waiting import ParkRun, Wait

if TYPE_CHECKING:
    from .authoring import WorkflowDef

log = logging.getLogger("marbles_rq.engine.rate_limits")

RATE_PREFIX = "|rate:"
WORKFLOW_LIMIT = "|rate@workflow"
EARLY_MS = 100  # a held run's timer fires this much before its estimated turn ...
IN_PLACE_MS = 150  # ... and a run this close to it, the head or next, waits in place
IN_PLACE_MAX_S = 0.3  # for at most this long in all, then it parks again


def rate_limit(name: str, rate: str | Rate) -> Any:
    """Wait (parked, no worker held) until the rate limit `name` lets this run through, at
    most `rate` (``"25/s"``, ``"100/min"``, ``mr.Rate("25/s", burst=5)``) across every run
    that asks it; in order of arrival. Recorded: a replay does not take it again."""
    run = current("mr.rate_limit")
    check_name(name)
    _take(run, name, name, as_rate(rate), RATE_PREFIX + name)
    return awaitable_here(None)


def limit_name(definition: WorkflowDef, value: Any) -> str:
    """The name of the limit a run of `definition` with input `value` takes: the workflow's
    name, with the key's value in brackets when it has a rate_key."""
    key = definition.rate_key
    if key is None:
        return definition.name
    if callable(key):
        try:
            found = key(value)
        except Exception as exc:
            raise InputError(f"the rate_key of workflow {definition.name!r} failed on the "
                             f"input: {type(exc).__name__}: {exc}") from None
        what = "the rate_key function"
    else:
        data = value if isinstance(value, dict) else _as_dict(value)
        if not isinstance(data, dict) or key not in data:
            raise InputError(f"workflow {definition.name!r} limits its rate per input field "
                             f"{key!r}, which the input does not have")
        found, what = data[key], f"input field {key!r}"
        if isinstance(found, int) and not isinstance(found, bool):
            found = str(found)
    if not isinstance(found, str) or not found or len(found) > MAX_NAME:
        raise InputError(f"{what} (the rate key of workflow {definition.name!r}) must give "
                         f"a string of 1 to {MAX_NAME} characters, not {found!r}")
    label = found if callable(key) else f"{key}={found}"
    return check_name(f"{definition.name}[{label}]", "rate key")


def _as_dict(value: Any) -> Any:
    try:
        return msgspec.to_builtins(value)
    except (TypeError, msgspec.EncodeError):
        return None


def admit_run(run: Run, definition: WorkflowDef, value: Any) -> None:
    """The workflow's own rate limit, before its body runs (the executor calls it)."""
    assert definition.rate_limit is not None
    name = limit_name(definition, value)
    _take(run, name, definition.name, as_rate(definition.rate_limit), WORKFLOW_LIMIT)


def _take(run: Run, name: str, family: str, declared: Rate, marker: str) -> None:
    check_not_in_foreign_thread("mr.rate_limit")
    check_branch()
    frame = run.frame
    key = f"{frame.path}.{marker}#{frame.counters[marker]}"
    frame.counters[marker] += 1
    if key in run.ex.ledger:
        return
    from .patches import _passed

    if _passed(run):  # recorded past here before the limit was in the code: not taken
        return
    rates = run.runs.rates()
    run.call_store(rates.note, name, family, declared)
    rate: Rate = run.call_store(rates.effective, name, family, declared)
    token = f"{run.run_id}|{key}"
    virtual = run.ex.clock is not None
    give_up = time.monotonic() + IN_PLACE_MAX_S
    while True:
        taken = run.call_store(rates.take, name, token, rate)
        if taken.status == "admitted":
            break
        wait_ms = taken.at_ms - run.ex.server_now_ms()
        # Only the head and the next wait in place: a worker's executors all taken by runs
        # waiting behind a head would keep the head itself from being executed.
        if virtual or taken.position > 1 or wait_ms > IN_PLACE_MS or \
                time.monotonic() + wait_ms / 1000 > give_up:
            _park(run, name, family, taken.at_ms, taken.position, taken.queued, virtual)
        time.sleep(max(wait_ms, 2) / 1000)
    at = taken.at_ms
    record = StepRecord(version=1, key=key, name=marker, status="succeeded", attempts=0,
                        result=msgspec.Raw(msgspec.json.encode({"limit": name,
                                                                "admitted_ms": at})),
                        at_ms=at)
    run.hold_entry(record, "rate_admitted", {"step": key, "limit": name, "rate": rate.spec(),
                                             "at_ms": at})
    run.ex.admitted_ms = at
    from .. import metrics

    metrics.rate_admitted(family)


def _park(run: Run, name: str, family: str, turn_ms: int, position: int, queued: int,
          virtual: bool) -> None:
    from .. import metrics

    metrics.rate_held(family)
    wake = max(turn_ms - (0 if virtual else EARLY_MS), run.ex.server_now_ms() + 1)
    raise ParkRun([Wait("rate_limit", wake_at_ms=wake, details={"rate_limit": {
        "limit": name, "position": position, "queued": queued, "turn_ms": turn_ms}})])


RateKey = str | Callable[[Any], str]

__all__ = ["RATE_PREFIX", "WORKFLOW_LIMIT", "RateKey", "admit_run", "limit_name",
           "rate_limit"]
