"""Rate limits per key: ``@mr.workflow(rate_limit="100/min", rate_key="customer")`` and, in a
body, ``mr.rate_limit("stripe", "25/s")`` before a step.

**The limiter.** Each limit (a name: the workflow's, one per value of its key, or the one a
body passes) is GCRA in one Lua script (lua/take_rate.lua) on the limit's own hash tag, on
the Redis server's clock: exact on one Redis and on a cluster. Burst 1 (the default) spaces
admissions at least one interval (period / N) apart, so no window of one period holds more
than N; ``mr.Rate("25/s", burst=5)`` lets 5 through at once after a quiet spell.

**Held runs hold no worker.** A run the limit refuses joins the limit's queue (in the same
script: one FIFO per limit, in order of arrival) and parks, reason ``rate_limit``. Only the
queue's head may pass, and a newcomer never passes a waiting queue, so runs are let through
in order of arrival. Who wakes a held run:

* *the head chain*: each admission releases the held runs whose turn now comes within
  LOOKAHEAD_MS (flow/rate_store.py), each once, and the admitted run's worker wakes them
  at once (wake_run, cause ``rate``), so a held run is woken about once, near its turn, and
  nothing polls;
* *its own timer*: a released run (or one queued within the lookahead) parks with a durable
  timer at its estimated turn less EARLY_MS; one not released yet with a timer at twice its
  estimated wait plus FALLBACK_MS, the safety net for a worker killed between an admission
  and its wakes. The controller fires timers like any other (after a restart too): nothing
  else has to remember a held run, so a kill -9 of anything strands none.

Estimates assume the runs ahead take their turns on time, so they are never late; a run woken
before its turn asks again and parks again. One among the first three within IN_PLACE_MS of
its turn waits in place (at most IN_PLACE_MAX_S in all) rather than park: the trip back
through the controller would eat that much of the rate. A head that has not come back
STALE_MS after its turn (cancelled, lost) is dropped so it cannot block the rest.

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
import redis

from ..engine.authoring import InputError
from ..engine.context import Run, awaitable_here, check_branch, check_not_in_foreign_thread, current
from ..engine.waiting import ParkRun, Wait
from ..errors import MarblesError
from ..store.records import StepRecord
from ..store.redis_errors import one_line
from .rate_specs import MAX_NAME, Rate, as_rate, check_name

if TYPE_CHECKING:
    from ..engine.authoring import WorkflowDef
    from .rate_store import Taken

log = logging.getLogger("marbles_rq.flow.rate_limits")

RATE_PREFIX = "|rate:"
WORKFLOW_LIMIT = "|rate@workflow"
EARLY_MS = 100  # a released run's timer fires this much before its estimated turn ...
IN_PLACE_MS = 150  # ... and a run this close to it, among the first three, waits in place
IN_PLACE_MAX_S = 0.3  # for at most this long in all, then it parks again
# A run not released yet waits for the chain's wake; its own timer, a safety net (the worker
# that should wake it was killed in between), fires at twice its estimated wait plus this.
FALLBACK_MS = 10_000


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
    from ..engine.patches import _passed

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
        # Only the first three wait in place: a worker's executors all taken by runs waiting
        # behind a head would keep the head itself from being executed.
        if virtual or taken.position > 2 or wait_ms > IN_PLACE_MS or \
                time.monotonic() + wait_ms / 1000 > give_up:
            _park(run, name, family, taken, virtual)
        time.sleep(max(wait_ms, 2) / 1000)
    if taken.release and not virtual:
        _release(run, taken.release)
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


def _release(run: Run, tokens: tuple[str, ...]) -> None:
    """Wake the held runs the admission released (their turn is near): each is delivered
    now. A failure leaves them to their own timers."""
    from ..engine.waiting import deliver_now

    waits = run.runs.waits()
    for token in tokens:
        run_id = token.split("|", 1)[0]
        try:
            status, attempt, queue = waits.wake(run_id, "rate")
        except (redis.RedisError, MarblesError, OSError) as exc:
            log.warning("run %s: cannot wake run %s for its rate limit turn (%s); its timer "
                        "will", run.run_id, run_id, one_line(exc))
            continue
        if status == "woken":
            deliver_now(run.deliver, queue, run_id, attempt)


def _park(run: Run, name: str, family: str, taken: Taken, virtual: bool) -> None:
    from .. import metrics

    metrics.rate_held(family)
    now = run.ex.server_now_ms()
    turn = taken.at_ms
    if virtual:
        wake = turn
    elif taken.near:
        wake = turn - EARLY_MS
    else:  # the chain wakes it; this is the safety net
        wake = now + 2 * max(turn - now, 0) + FALLBACK_MS
    raise ParkRun([Wait("rate_limit", wake_at_ms=max(wake, now + 1), detail={"rate_limit": {
        "limit": name, "position": taken.position, "queued": taken.queued,
        "turn_ms": turn}})])


RateKey = str | Callable[[Any], str]

__all__ = ["RATE_PREFIX", "WORKFLOW_LIMIT", "RateKey", "admit_run", "limit_name",
           "rate_limit"]
