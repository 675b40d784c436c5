"""Executing one delivery of a run: start the attempt, replay the ledger, run the body,
settle. This is what an RQ job runs, in a work-horse or in a pool executor."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import redis

from .. import metrics, tracing
from ..errors import MarblesError, RedisUnavailableError
from ..flow.limits import start as start_with_slot
from ..payloads.crypto import PayloadKeyMissing
from ..store.records import ErrorInfo, RunRecord, StepRecord
from ..store.redis_errors import is_outage, one_line
from ..terminal import safe
from . import (
    compensation,
    context,
    event_waits,
    fanout,
    published,
    signal_waits,
    step_retry,
    waiting,
)
from .authoring import REGISTRY, Registry, StepDef
from .context import (
    BranchCancelled,
    Frame,
    Limits,
    StepFailedError,
    StopExecution,
    check_branch,
    check_not_in_foreign_thread,
    decode_result,
    now_ms,
)
from .execution import Execution, HeldCommit, StepStart, event
from .runs import TIMEOUT_ERROR, RunStore
from .waiting import NonDeterminismError, ParkRun, Wait, deliver_now
from .watchdog_hub import HUB

log = logging.getLogger("marbles_rq.engine.execute")

EXIT_FENCED = 75  # a horse that learned it no longer owns its run exits with this code
# A step with no retries starts without a round trip of its own when the execution learned
# less than FRESH_FLAGS_S ago that the run is not cancelled, paused or timed out; its start
# is written by its commit, or by the watchdog once it has run START_DELAY_S.
FRESH_FLAGS_S = 0.2
START_DELAY_S = 0.15
# A step's success is written by the execution's next write, or by the watchdog this long
# after: the longest a finished step can be lost to a crash, and so run again.
HOLD_COMMIT_S = 0.05
# The reason a replay check's execution stops at: the first step its ledger does not hold.
REPLAY_REACHED_NEW_WORK = "reached_new_work"


class StoreUnavailable(StopExecution):
    """The store could not be reached from inside the body. Not the step's failure: the
    execution stops unsettled, its lease expires, and the run is delivered again."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("store_unavailable")
        self.cause = cause


def current(what: str = "mr.current()") -> RunContext:
    """The run executing in this thread, as its body holds it (`mr.current()`)."""
    # The executor installs only its own RunContext (engine/context.enter).
    return cast(RunContext, context.current(what))


def _error(exc: BaseException, step: str = "") -> ErrorInfo:
    tb = "".join(traceback.format_exception(exc))[-4000:]
    return ErrorInfo(type=type(exc).__name__, message=str(exc)[:2000], step=step, traceback=tb)


class Stream:
    def __init__(self, run: RunContext) -> None:
        self._run = run

    def write(self, value: Any) -> None:
        """Append to the run's live output. Strings as text, anything else as JSON."""
        data = {"text": value} if isinstance(value, str) else {"value": value}
        self._run._write("output", data, "write_bytes", "stream.write")


class RunLogger:
    """Log lines that go to the run's output and to the worker's log."""

    def __init__(self, run: RunContext) -> None:
        self._run = run

    def _log(self, level: int, msg: str, *args: Any) -> None:
        text = msg % args if args else msg
        log.log(level, "[%s] %s", self._run.run_id, safe(text))
        self._run._write("log", {"level": logging.getLevelName(level), "message": text},
                         "log_bytes", "a log line")

    def debug(self, msg: str, *args: Any) -> None:
        self._log(logging.DEBUG, msg, *args)

    def info(self, msg: str, *args: Any) -> None:
        self._log(logging.INFO, msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self._log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: Any) -> None:
        self._log(logging.ERROR, msg, *args)


@dataclass
class StepCall:
    """One call of a step at its ledger position, and what the ledger held there."""

    definition: StepDef
    key: str
    seq: int
    digest: str
    recorded: StepRecord | None
    attempts: int = 0
    patches: list[Any] = field(default_factory=list)  # engine/input_patch.py
    undo: bytes = b""  # the registration its success carries (compensate=), JSON

    def __post_init__(self) -> None:
        self.attempts = self.recorded.attempts if self.recorded is not None else 0
        self.patches = list(self.recorded.patches) if self.recorded is not None else []

    @property
    def replayed(self) -> bool:
        """The ledger holds its outcome: `replay` returns (or raises) it, nothing runs."""
        return self.recorded is not None and self.recorded.status in ("succeeded", "failed")

    def replay(self) -> Any:
        recorded = self.recorded
        assert recorded is not None
        if recorded.status == "failed":
            assert recorded.error is not None
            raise StepFailedError(recorded.error)
        return decode_result(recorded.result, self.definition.result_type)

    def record(self, status: str, **extra: Any) -> StepRecord:
        return StepRecord(version=1, key=self.key, name=self.definition.name, status=status,
                          attempts=extra.pop("attempts", self.attempts), at_ms=now_ms(),
                          seq=self.seq, args=self.digest, patches=self.patches, **extra)

    def parked(self) -> StepRecord:
        """A parked step is not finished: it replays from the top when the run is woken,
        under the same attempt number."""
        return self.record("parked", attempts=self.attempts - 1)

    def frame(self, parent: Frame) -> Frame:
        """The frame of this attempt's body, under `parent` (the caller's frame)."""
        return Frame(self.key, tag=f"{parent.tag or parent.path}>{self.key}~{self.attempts}")


class RunContext:
    """What a workflow body receives: its input, steps, live output, effect keys, a logger."""

    def __init__(self, runs: RunStore, ex: Execution, input: Any, watchdog: Watchdog,
                 limits: Limits | None = None,
                 deliver: Callable[[str, str, int], bool] | None = None,
                 registry: Registry | None = None) -> None:
        self.runs = runs
        self.ex = ex
        self.input = input
        self.stream = Stream(self)
        self.log = RunLogger(self)
        self.limits = limits or Limits()
        self._watchdog = watchdog
        self.deliver = deliver
        self.registry = registry or REGISTRY
        self.ask = waiting.Ask(self)
        self.report = waiting.Reporter(self)
        # One frame per step body entered. A frame gets fresh counters on every (re)entry,
        # so a retried step replays its children at the positions it used before.
        self.root_frames: list[Frame] = [Frame(ex.record.name)]
        # What was recorded where: (frame path, position) -> record, to catch a replay
        # that calls something else at a recorded position.
        self.recorded_at: dict[tuple[str, int], StepRecord] = {}
        for record in ex.ledger.values():
            cut = record.key.rfind(f".{record.name}#")
            if record.seq >= 0 and cut > 0:
                self.recorded_at[(record.key[:cut], record.seq)] = record
        self.found_asks: dict[str, dict[str, Any]] | None = None
        # Child run id -> the ledger key of the call that took it in this execution. The
        # ledger shows a child only once committed: parallel branches starting children at
        # once must each see the other's before either records its child (engine/fanout.py).
        self.child_ids: dict[str, str] = {}
        self.child_ids_lock = threading.Lock()

    @functools.cached_property
    def workflow_def(self) -> Any:
        """The definition executing the run (its retry defaults apply to its steps)."""
        return self.registry.serving(self.ex.record.name, self.ex.record.wf_version)

    @property
    def _frames(self) -> list[Frame]:
        return context.thread_frames() or self.root_frames

    @property
    def frame(self) -> Frame:
        return self._frames[-1]

    def position(self, name: str) -> tuple[str, int]:
        """The ledger key and frame position of the next recorded call of `name` here.
        Raises NonDeterminismError when the ledger recorded another call at that position."""
        self.write_held()  # what comes after a step's success is written after it
        frame = self.frame
        base = f"{frame.path}.{name}"
        key = f"{base}#{frame.counters[base]}"
        frame.counters[base] += 1
        seq = frame.seq
        frame.seq += 1
        recorded = self.recorded_at.get((frame.path, seq))
        if recorded is not None and recorded.name != name:
            raise NonDeterminismError(frame.path, seq, recorded.name, name)
        return key, seq

    def sleep(self, seconds: float) -> None:
        """Park the run for `seconds` (durable: the controller wakes it, on the server's
        clock, after any restart). Holds no worker while it waits."""
        waiting.sleep(self, seconds)

    def sleep_until(self, when: Any) -> None:
        """Park the run until `when` (a timezone-aware datetime)."""
        waiting.sleep_until(self, when)

    def wait_for_signal(self, name: str, timeout_s: float | None = None) -> Any:
        """The payload of the next signal `name` sent to this run, parking the run (no
        worker held) until one arrives; SignalTimeoutError after `timeout_s` without one.
        Recorded in the ledger: a replay returns the same payload."""
        return signal_waits.wait_for_signal(self, name, timeout_s)

    def signals(self, name: str) -> list[Any]:
        """The payloads of the signals `name` buffered now, oldest first (perhaps none);
        never parks. Recorded in the ledger: a replay returns the same list."""
        return signal_waits.drain_signals(self, name)

    def start_child(self, workflow: str, input: Any = None, key: str | None = None
                    ) -> fanout.ChildRun:
        """Start a child run (recorded before it is enqueued, under a stable id)."""
        return fanout.start_child(self, workflow, input, key)

    def gather(self, *children: fanout.ChildRun) -> list[Any]:
        """The results of these children, parking until every one has settled."""
        return fanout.gather(self, list(children))

    def parallel(self, *calls: Callable[[], Any]) -> list[Any]:
        """Run zero-argument callables (steps, usually) together; their results in order."""
        return fanout.parallel(self, list(calls))

    def compensate(self, fn: StepDef | Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Register `fn(*args, **kwargs)` as an undo: if the run fails (or is cancelled with
        compensation) the undos run, the last registered first, as recorded steps. `fn`: a
        registered step or a module-level function; the arguments must be JSON. Recorded
        at this call's position: a replay registers nothing again (engine/compensation.py)."""
        compensation.compensate(self, fn, args, kwargs)

    def publish(self, key: str, value: Any) -> None:
        """Publish `value` (JSON) under `key`, readable from outside at any time (last write
        wins); recorded, so a replay does not publish it again (engine/published.py)."""
        published.publish(self, key, value)

    def tag(self, **tags: Any) -> None:
        """Record search tags on this run (`ctx.tag(customer="acme", region="eu")`): merged
        with its others, indexed at once, filterable in `runs --tag customer=acme`; a key
        given again takes the new value. Not a ledger entry: a replay sets the same values
        again. TagError: a bad key or value, or more than 16 tags (engine/tags.py)."""
        from .tags import check_tags, tag_run

        checked = check_tags(tags)
        if getattr(self.runs, "scripts", None) is None:
            return  # runs in memory (engine/memory_store.py) keep no tags
        self.call_store(tag_run, self.runs, self.run_id, checked)

    def wait_for_event(self, source: str, type: str | None = None,
                       match: dict[str, Any] | None = None, timeout_s: float | None = None,
                       lookback_s: float | None = None) -> event_waits.ReceivedEvent:
        """Park until an event of `source` (and `type`) whose payload matches `match`
        arrives (or came within `lookback_s`, 1 h by default); returns it, recorded
        (engine/event_waits.py). Raises EventWaitTimeoutError after `timeout_s`."""
        return event_waits.wait_for_event(self, source, type, match, timeout_s, lookback_s)

    @property
    def run_id(self) -> str:
        return self.ex.run_id

    @property
    def attempt(self) -> int:
        """The delivery number of this execution: every new delivery moves it, a resumption
        after a wait too. `status` shows `attempt` (1 + redeliveries) and `resumptions`
        apart; they are `ex.tries` and `ex.resumptions` here."""
        return self.ex.attempt

    @property
    def step_path(self) -> str:
        """The path of the step executing now (the workflow name outside steps)."""
        return self.frame.path

    @property
    def idempotency_key(self) -> str:
        """Stable across redeliveries: run id + step path + call position. Hand it to
        systems that accept an idempotency key."""
        return f"{self.run_id}:{self.step_path}"

    def claim_effect(self, key: str | None = None) -> bool:
        """Reserve an effect once per run (default key: the current idempotency key).
        True for the first claimer ever; False if it was claimed before (by this run's
        earlier delivery); stops the execution if a newer one owns the run or its lease
        expired.

        A reservation, not a transaction with the effect: a crash between this claim and
        the effect leaves the effect undone. Where the target system takes an idempotency
        key, give it `idempotency_key` instead; that is exactly-once end to end."""
        if self.ex.starts:
            # A step whose start waits for its commit (or the watchdog) writes it first: a
            # receipt never names a step the ledger does not show started, even if the run
            # is settled (cancelled, reaped) before that commit.
            started = self.call_store(self.runs.write_due_starts, self.ex, math.inf)
            if started is not None:
                self.check_reply(started)
        status: str = self.call_store(self.runs.claim_effect, self.ex,
                                      key or self.idempotency_key)
        if status == "stale_epoch":
            raise StopExecution("stale")
        return status == "ok"

    # -- steps ----------------------------------------------------------------------------

    def step(self, fn: StepDef | Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` as a recorded step: once per run, its result replayed afterwards. In an
        async body, an awaitable (engine/async_run.py); its ledger position is taken now."""
        definition = fn if isinstance(fn, StepDef) else StepDef(fn.__name__, fn)
        # `ctx.step` from a thread the body started would take the workflow's own frame and
        # race the body for its positions: refused like every other recorded call.
        check_not_in_foreign_thread(f"step {definition.name!r}")
        check_branch()
        call = self.open_step(definition, args, kwargs)
        args, kwargs = step_retry.prepare(self, call, args, kwargs)
        if context.async_body.get():
            from .async_run import step_async

            return step_async(self, call, args, kwargs)
        if call.replayed:
            return call.replay()
        definition = call.definition  # perhaps a test kit's override (open_step)
        body: Callable[[], Any] = functools.partial(definition.fn, *args, **kwargs)
        if inspect.iscoroutinefunction(definition.fn):
            from .async_run import run_here

            body = functools.partial(run_here, definition.fn, args, kwargs)
        while True:
            self.begin_attempt(call)
            self._frames.append(call.frame(self.frame))
            tried = time.perf_counter()
            try:
                with tracing.step(definition.name, call.key, call.attempts):
                    value = body()
                result = self.encode_result(call, value)
            except ParkRun as park:
                park.ledger.append(call.parked())
                raise
            except (Exception, SystemExit, KeyboardInterrupt) as exc:  # the step's failure
                failure = exc
            else:
                return self.step_succeeded(call, result, tried)
            finally:
                self._frames.pop()
            self._watchdog.sleep(self.step_failed(call, failure, tried, args, kwargs))

    def open_step(self, definition: StepDef, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> StepCall:
        """Take the next position for `definition`, and find what the ledger holds there."""
        key, seq = self.position(definition.name)
        digest = _digest(args, kwargs)
        recorded = self.ex.ledger.get(key)
        if (recorded is not None and recorded.status == "succeeded" and recorded.args
                and digest and recorded.args != digest):
            self.log.warning("step %s is replayed with other arguments than it was "
                                 "recorded with; returning its recorded result", key)
        undo = compensation.step_undo(definition, self.registry.steps, args, kwargs)
        if self.ex.override_step is not None:  # a test kit's mock or injected failure
            definition = self.ex.override_step(key, definition)
        return StepCall(definition, key, seq, digest, recorded, undo=undo)

    def begin_attempt(self, call: StepCall) -> None:
        if self.ex.replay_only:
            raise StopExecution(REPLAY_REACHED_NEW_WORK)
        # A try a kill interrupted stays counted (its entry is `running`), but a retry
        # policy's tries never pass its bound: an interrupted last try runs again as
        # itself. A step without retries keeps counting each run of its body (a kill's
        # rerun is redelivery, not a retry: it is not bounded).
        bound = call.definition.policy(self.workflow_def).max_attempts
        call.attempts += 1
        if bound > 1:
            call.attempts = min(call.attempts, bound)
        running = call.record("running")
        # The first step after a rate limit's admission starts at the admission instant
        # (flow/rate_limits.py): the starts a limit lets through keep its spacing.
        admitted = self.ex.admitted_ms
        if admitted:
            running = msgspec.structs.replace(running, at_ms=admitted)
        try:
            self._begin(running, single=bound == 1, admitted_ms=admitted)
        finally:
            self.ex.admitted_ms = 0

    def encode_result(self, call: StepCall, value: Any) -> bytes:
        result = msgspec.json.encode(value)
        self.limits.check(f"the result of step {call.key}", len(result),
                          self.limits.step_result_bytes, "step_result_bytes")
        return result

    def step_succeeded(self, call: StepCall, result: bytes, tried: float) -> Any:
        """Record the success, held for the execution's next write (engine/execution.py
        HeldCommit): the next recorded call, output line or settle writes it first (the
        settle in the same round trip), the watchdog within HOLD_COMMIT_S."""
        metrics.step_tried(self.ex.record.name, "succeeded", time.perf_counter() - tried)
        done = compensation.with_undo(self.ex, call.key, call.undo,
                                      call.record("succeeded", result=msgspec.Raw(result)))
        self.hold_entry(done, "step_succeeded", {"step": call.key, "attempt": call.attempts})
        return decode_result(done.result, call.definition.result_type)

    def hold_entry(self, record: StepRecord, event_type: str, data: dict[str, Any]) -> None:
        """Commit a ledger entry with the execution's next write (the one held before it is
        written now): nothing recorded after it can be written without it."""
        held = HeldCommit(record, event_type, msgspec.json.encode(data),
                          time.monotonic() + HOLD_COMMIT_S)
        status = self._call_store(self.runs.hold_commit, self.ex, held)
        self.ex.ledger[record.key] = record
        if status is not None:
            self.check_reply(status)
        self._watchdog.held(held)

    def step_failed(self, call: StepCall, failure: BaseException, tried: float,
                    args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> float:
        """Record a failed attempt: the delay before the next one in the worker, or ParkRun
        (a retry's timer, a pause), or StepFailedError (engine/step_retry.py)."""
        return step_retry.failed(self, call, failure, _error(failure, call.key), tried, args,
                                 kwargs or {})

    def _begin(self, running: StepRecord, *, single: bool, admitted_ms: int = 0) -> None:
        """Start a step attempt. A step with no retries, started while the execution's last
        look at cancel, pause and the deadline (the reply of its start or of the previous
        commit) is fresh, runs at once: its start is written with its commit, one round trip
        for the step (or by the watchdog if it runs past START_DELAY_S, or before any other
        write). Any other step asks Redis first: it does not start if the run was cancelled,
        paused or timed out meanwhile."""
        ex = self.ex
        now = time.monotonic()
        if single and now - ex.flags_at < FRESH_FLAGS_S and (
                not ex.deadline_ms or ex.server_now_ms() < ex.deadline_ms):
            self._watchdog.raise_if_stopped()
            check_branch()
            started_ms = admitted_ms or ex.server_now_ms()
            self._watchdog.defer_start(StepStart(
                running.key, running,
                event(step=running.key, attempt=running.attempts, started_ms=started_ms),
                now + START_DELAY_S))
            return
        self.check_reply(self.call_store(self.runs.start_step, ex, running))

    def prepare_child(self, workflow: str, input: bytes, child_id: str) -> RunRecord:
        """A child run's record, its request validated as any enqueue's (engine/ops.py)."""
        from .ops import RunRequest, prepare

        return prepare(RunRequest(workflow, input, child_id, origin="child"), self.registry)

    def call_store(self, call: Any, *args: Any) -> Any:
        """A store call from inside the body: unreachable Redis, or one that refuses writes
        (OOM, MISCONF, READONLY ...), stops the execution unsettled. A step success held
        for the next write is written first."""
        self.write_held()
        return self._call_store(call, *args)

    def write_held(self) -> None:
        """Write the step success held for the next write, if any, and act on its reply
        (or on that of one the watchdog wrote meanwhile)."""
        ex = self.ex
        if ex.held is None and not ex.held_reply:
            return
        status = self._call_store(self.runs.write_held, ex)
        reply, ex.held_reply = ex.held_reply, ""
        for seen in (status, reply):
            if seen:
                self.check_reply(seen)

    def _call_store(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except RedisUnavailableError as exc:
            raise StoreUnavailable(exc) from exc
        except redis.RedisError as exc:
            if is_outage(exc):
                raise StoreUnavailable(exc) from exc
            raise

    def commit_entry(self, record: StepRecord, event_type: str, data: dict[str, Any]) -> None:
        self.check_reply(self.commit_entry_reply(record, event_type, data))

    def commit_entry_reply(self, record: StepRecord, event_type: str,
                           data: dict[str, Any]) -> str:
        """Commit a ledger entry; the reply, not yet checked (the caller acts on it first)."""
        status: str = self.call_store(self.runs.commit_step, self.ex, record, event_type,
                                      msgspec.json.encode(data))
        if status in ("ok", "cancelled", "paused"):
            self.ex.ledger[record.key] = record
        return status

    def _write(self, type: str, data: dict[str, Any], limit: str, what: str) -> None:
        encoded = msgspec.json.encode(data)
        self.limits.check(what, len(encoded), getattr(self.limits, limit), limit)
        # A write has a position in the body (its frame entry and its index there), so a
        # replay writes nothing again. One from a thread the body started has none: its
        # place among the body's writes is not the same from one execution to the next.
        position = self.frame.write_position() if context.current_run() is self else None
        self.check_reply(self.call_store(self._append, type, encoded, position))

    def _append(self, type: str, encoded: bytes, position: tuple[str, int] | None) -> str:
        status = self.runs.write(self.ex, type, encoded, max_lines=self.limits.output_lines,
                                 max_bytes=self.limits.output_bytes, position=position)
        return "ok" if status in ("capped", "replayed") else status

    def check_reply(self, status: str) -> None:
        if status == "ok":
            self._watchdog.raise_if_stopped()
            check_branch()
            return
        if status == "paused":
            raise ParkRun([Wait("paused")])
        if status in ("settled", "stale") and self._watchdog.reason in ("cancelled",
                                                                         "timed_out"):
            # The watchdog learned it first and settled the run: say why it stopped.
            raise StopExecution(self._watchdog.reason)
        raise StopExecution({"stale": "stale", "settled": "stale"}.get(status, status))


def _digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A digest of a step's arguments ('' when they are not JSON: they are not compared)."""
    try:
        encoded = msgspec.json.encode([args, kwargs], order="sorted")
    except (TypeError, ValueError, OverflowError):
        return ""
    return hashlib.sha1(encoded).hexdigest()[:16]


class Watchdog:
    """Renews the execution's lease every ttl/3, and learns from the renewal when the
    execution must stop: cancelled, timed out, or fenced by a newer delivery. A body that
    does not reach a step boundary soon after is ended by exiting the process (a horse) or,
    an async body, by cancelling its task. It also writes the start of a step still running
    START_DELAY_S after it started (its start was deferred to its commit: see
    RunContext._begin). Ticked by the process's one watchdog thread (engine/watchdog_hub)."""

    def __init__(self, runs: RunStore, ex: Execution, *, hard_exit: bool) -> None:
        self.runs, self.ex, self.hard_exit = runs, ex, hard_exit
        self.reason: str | None = None
        self._stop = threading.Event()
        self._next_wake = float("inf")  # under ex.lock: when the hub ticks it next (monotonic)
        self._interval = ex.ttl_ms / 3000
        self._next_renew = 0.0
        # Set, under the lock, once the execution has its outcome. The process may outlive
        # the execution (a pool executor takes the next run), so the watchdog may end it
        # only while its own execution is still going.
        self._lock = threading.Lock()
        self._finished = False
        # Called (from the hub's thread) once the execution must stop: an async body's task
        # is cancelled at its next await (engine/async_run.py).
        self.on_stop: Callable[[], None] | None = None

    def start(self) -> None:
        self._next_renew = time.monotonic() + self._interval
        self._next_wake = self._next_renew
        HUB.add(self)

    def stop(self) -> None:
        self._stop.set()
        HUB.remove(self)

    def finish(self) -> None:
        """The execution has its outcome: from now on the watchdog changes nothing."""
        with self._lock:
            self._finished = True
        self.stop()

    def sleep(self, seconds: float) -> None:
        """A retry backoff that ends early when the execution must stop (none on a virtual
        clock: a run in memory does not wait for it)."""
        if self.ex.clock is None:
            self._stop.wait(seconds)
        self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        if self.reason is not None:
            raise StopExecution(self.reason)

    def defer_start(self, start: StepStart) -> None:
        """Keep a step's start for its commit; wake the hub if it would tick us past `due`.
        (Cheap: in a run of fast steps the hub is woken about once per START_DELAY_S.)"""
        ex = self.ex
        with ex.lock:
            ex.starts[id(start)] = start
            poke = start.due < self._next_wake
            if poke:
                self._next_wake = start.due
        if poke:
            HUB.poke()

    def held(self, held: HeldCommit) -> None:
        """A step's success is held for the next write: wake the hub by its `due`."""
        ex = self.ex
        with ex.lock:
            poke = held.due < self._next_wake
            if poke:
                self._next_wake = held.due
        if poke:
            HUB.poke()

    def renewal_due(self, now: float, early: bool = False) -> bool:
        """Its renewal is due (`early`: within half an interval) and may go in the hub's
        batch (engine/watchdog_hub.py): an execution holding a concurrency slot renews the
        slot first, itself."""
        due = self._next_renew - (self._interval / 2 if early else 0)
        return (not self._stop.is_set() and due <= now and self.ex.slot is None
                and not self.ex.locks and hasattr(self.runs, "renew_many"))

    def renewed(self, status: str | None, now: float) -> None:
        """The hub renewed it in a batch: `status` as `RunStore.renew`'s (None: not sent)."""
        self._next_renew = now + self._interval
        if status not in (None, "ok"):
            self._stopping(status)

    def tick(self, now: float) -> float:
        """The hub's call: write a held success and due starts, renew when due; when to tick
        next."""
        if self._stop.is_set():
            return math.inf
        ex = self.ex
        with ex.lock:
            first = next(iter(ex.starts.values()), None)
            held = ex.held
        if held is not None and held.due <= now:
            status = self._store_call(self.runs.write_held, ex)
            if status in ("stale", "settled", "cancelled", "timed_out"):
                self._stopping(status)
                return math.inf
            if status == "paused":
                ex.held_reply = status  # the body parks at its next boundary
            with ex.lock:
                first = next(iter(ex.starts.values()), None)
        if first is not None and first.due <= now:
            status = self._store_call(self.runs.write_due_starts, ex, now)
            if status not in (None, "ok"):
                self._stopping(status)
                return math.inf
        if self._next_renew <= now:
            self._next_renew = now + self._interval
            status = self._store_call(self.runs.renew, ex)
            if status not in (None, "ok"):
                self._stopping(status)
                return math.inf
        with ex.lock:
            first = next(iter(ex.starts.values()), None)
            wake_at = min(self._next_renew, first.due) if first is not None else self._next_renew
            if ex.held is not None:
                wake_at = min(wake_at, ex.held.due)
            self._next_wake = wake_at
        return wake_at if not self._stop.is_set() else math.inf

    def _store_call(self, call: Callable[..., str | None], *args: Any) -> str | None:
        try:
            return call(*args)
        except (redis.RedisError, RedisUnavailableError, OSError) as exc:
            log.warning("run %s: cannot renew its lease or write a step start (%s); retrying",
                        self.ex.run_id, one_line(exc))
            return None

    def _stopping(self, status: str) -> None:
        """A renewal or a late start said the execution must stop: stale, settled, cancelled
        or timed out. Settles it (cancelled, timed out) and, in a horse, ends the process if
        the body does not reach a boundary soon; nothing if our own settle landed first."""
        interval = self.ex.ttl_ms / 3000
        with self._lock:
            if self._finished:
                return  # our own settle landed first: nothing to stop
            self.reason = {"settled": "stale", "expired": "stale"}.get(status, status)
        if status in ("cancelled", "timed_out"):
            try:
                if settle_stopped(self.runs, self.ex, status) == "ok":
                    count_finished(self.ex, status)
            except (redis.RedisError, RedisUnavailableError, OSError) as exc:
                # The body settles it at its next boundary; the scripts refuse its steps.
                log.warning("run %s: cannot settle it %s yet (%s)", self.ex.run_id, status,
                            one_line(exc))
        log.warning("run %s attempt %s: %s; stopping", self.ex.run_id, self.ex.attempt,
                    self.reason)
        if self.on_stop is not None:
            self.on_stop()
        if self.hard_exit:
            # The body may be inside a long step; give it a moment to reach a boundary.
            self._stop.wait(min(1.0, interval))
            with self._lock:
                if not self._finished:
                    if self.ex.slot is not None:
                        self.ex.slot.release()  # only its holder's: a newer one keeps its own
                    os._exit(EXIT_FENCED)
        self._stop.set()


def _settled(reply_status: str, status: str) -> str:
    """What a delivery reports to RQ: the status it settled, or why it could not."""
    return status if reply_status == "ok" else reply_status


def settle_stopped(runs: RunStore, ex: Execution, reason: str,
                   deliver: Callable[[str, str, int], bool] | None = None) -> str:
    """Settle a run whose execution stopped on a cancel or its deadline: the settle's reply
    (ok, or why not; handed_over: the cancel asked for compensation, which a new delivery
    runs)."""
    if reason == "cancelled":
        status = runs.settle(ex, "cancelled")
        if status == "compensate":
            status, attempt, queue = runs.hand_over_compensation(ex)
            if status == "ok":
                deliver_now(deliver, queue, ex.run_id, attempt)
                return "handed_over"
        if status == "ok":
            runs.waits().cancel_children(ex.run_id)
        return status
    if reason == "timed_out":
        return runs.settle(ex, "failed", error=TIMEOUT_ERROR)
    return "ok"


@dataclass
class Engine:
    """What executing a delivery needs in this process."""

    runs: RunStore
    registry: Registry
    worker_name: str
    lease_ms: int
    hard_exit: bool = True  # forked horses exit when fenced; set False in tests
    limits: Limits = field(default_factory=Limits)
    # Enqueue a delivery (queue, run id, attempt) on the transport: a woken run, a child.
    # Without it the controller dispatches them after its grace.
    deliver: Callable[[str, str, int], bool] | None = None


_ENGINE: Engine | None = None


def configure(engine: Engine) -> None:
    global _ENGINE
    _ENGINE = engine


def engine() -> Engine:
    if _ENGINE is None:
        raise MarblesError("no marbles-rq engine configured in this process: run deliveries "
                           "with 'marbles-rq worker'")
    return _ENGINE


def execute_delivery(run_id: str, attempt: int) -> str:
    """The RQ job function: execute delivery `attempt` of run `run_id`."""
    eng = engine()
    worker = os.environ.get("RQ_WORKER_ID") or eng.worker_name
    return execute(eng.runs, eng.registry, run_id, int(attempt), worker=worker,
                   lease_ms=eng.lease_ms, hard_exit=eng.hard_exit, limits=eng.limits,
                   deliver=eng.deliver)


def execute(runs: RunStore, registry: Registry, run_id: str, attempt: int, *, worker: str,
            lease_ms: int, hard_exit: bool, limits: Limits | None = None,
            deliver: Callable[[str, str, int], bool] | None = None) -> str:
    with tracing.delivery(run_id, attempt) as traced:
        outcome = _execute(runs, registry, run_id, attempt, worker=worker, lease_ms=lease_ms,
                           hard_exit=hard_exit, limits=limits, deliver=deliver, traced=traced)
        settled = outcome.ex is not None and outcome.status in FINISHED
        if settled:
            assert outcome.ex is not None
            count_finished(outcome.ex, outcome.status)
            traced.end(FINISHED[outcome.status], outcome.ex.record, outcome.ex.server_now_ms())
        else:
            traced.end(outcome.status)
    if outcome.parent and outcome.status in ("succeeded", "failed", "cancelled", "timed_out"):
        # A parent waiting for this child goes on now, not at the controller's next check.
        fanout.wake_parent(runs, outcome.parent, run_id, deliver)
    return outcome.status


# What an execution's outcome status means for a run that it settled just now.
FINISHED = {"succeeded": "succeeded", "failed": "failed", "cancelled": "cancelled",
            "timed_out": "failed"}


def count_finished(ex: Execution, status: str) -> None:
    """Metrics of a run this execution settled just now (status: an outcome in FINISHED)."""
    metrics.run_finished(ex.record.name, FINISHED[status],
                         (ex.server_now_ms() - ex.record.requested_at_ms) / 1000)


def park_run(runs: RunStore, ex: Execution, parked: ParkRun,
             deliver: Callable[[str, str, int], bool] | None) -> str:
    """Park the run for what `parked` waits for; returns the delivery's outcome."""
    waits = parked.waits
    reasons = {w.reason for w in waits}
    reason = next(r for r in ("paused", "failed_step", "question", "signal", "child", "event",
                              "timer", "retry", "rate_limit", "lock") if r in reasons)
    wake_at = min((w.wake_at_ms for w in waits if w.wake_at_ms), default=0)
    wait_for: dict[str, Any] = {}
    questions = [q for w in waits for q in w.questions]
    children = [c for w in waits for c in w.children]
    signals = sorted({s for w in waits for s in w.signals})
    until = min((w.until_ms for w in waits if w.until_ms), default=0)
    if questions:
        wait_for["questions"] = questions
    if children:
        wait_for["children"] = children
    if signals:
        wait_for["signals"] = signals  # send_signal wakes it for these; park_run checks them
    if until:
        wait_for["until_ms"] = until
    if events := [e for w in waits for e in w.events]:
        wait_for["events"] = events
    for w in waits:
        wait_for.update(w.detail)
    runs.write_held(ex)  # a step's success before the park (its reply: the park's too)
    status, attempt, queue = runs.waits().park(
        ex, reason=reason, wake_at_ms=wake_at, wait_for=wait_for, ledger=parked.ledger,
        asks=[a for w in waits for a in w.asks], notice=step_retry.notice_of(ex, waits))
    if status == "cancelled":
        if settle_stopped(runs, ex, "cancelled", deliver) == "ok":
            count_finished(ex, "cancelled")
        return "cancelled"
    if status == "requeued":
        deliver_now(deliver, queue, ex.run_id, attempt)
        return "requeued"
    if status == "ok":
        log.info("run %s attempt %s parked: %s", ex.run_id, ex.attempt, reason)
        return "parked"
    return status


def _run_body(ctx: RunContext, definition: Any, value: Any, watchdog: Watchdog) -> Any:
    """The workflow body's output (an async body on this thread's loop), after its rate
    limit admitted the run (a held run parks here)."""
    if definition.rate_limit is not None:
        from ..flow.rate_limits import admit_run

        admit_run(ctx, definition, value)
    if definition.is_async:
        from .async_run import run_body

        return run_body(ctx, definition, value, watchdog)
    return definition.fn(ctx) if definition.input_type is None else definition.fn(ctx, value)


@dataclass(frozen=True)
class _Outcome:
    status: str
    parent: str = ""
    ex: Execution | None = None  # set when this execution settled the run (metrics)


def _execute(runs: RunStore, registry: Registry, run_id: str, attempt: int, *, worker: str,
             lease_ms: int, hard_exit: bool, limits: Limits | None,
             deliver: Callable[[str, str, int], bool] | None,
             traced: Any = tracing.NO_SPAN) -> _Outcome:
    limits = limits or Limits()
    # A run with a concurrency limit takes its slot first, or is handed back (flow/limits).
    started = start_with_slot(runs, run_id, attempt, ttl_ms=lease_ms, worker=worker)
    if started.status == "corrupt":
        log.warning("run %s delivery %s: %s; failing the run", run_id, attempt, started.detail)
        runs.fail_corrupt(run_id, started.detail)
        return _Outcome("failed")
    if started.status == "cancelled":
        # start_attempt settled it cancelled just now (a cancel asked while it was queued, or
        # while an execution whose lease expired ran it): its children go with it, as in
        # every other cancelled settle (settle_stopped, the reaper).
        log.info("run %s delivery %s: cancelled before it started", run_id, attempt)
        runs.waits().cancel_children(run_id)
        return _Outcome(started.status)
    if started.status == "key_missing" and started.execution is not None:
        # Not this worker's to fail: another worker (or this one, once given the key) can.
        note = f"waiting for a worker that can read it: {started.detail}"
        status = runs.defer(started.execution, note)
        log.warning("run %s: %s; handed back (%s)", run_id, started.detail, status)
        return _Outcome("deferred")
    if started.status != "ok" or started.execution is None:
        log.info("run %s delivery %s: %s %s", run_id, attempt, started.status, started.detail)
        return _Outcome(started.status)
    ex = started.execution
    parent = ex.record.parent
    if parent and runs.parent_cancelled(parent):
        # The parent was cancelled (or asked to be) after this child was noted in its ledger:
        # its cancel may have walked its children before this run was recorded (the child
        # lives in another slot; see fanout.start_child). It never runs its body.
        runs.cancel(run_id, f"its parent {parent} was cancelled")
        reply = settle_stopped(runs, ex, "cancelled")
        if ex.slot is not None:
            ex.slot.release()
        log.info("run %s: its parent %s was cancelled; cancelled (%s)", run_id, parent, reply)
        return _Outcome(_settled(reply, "cancelled"), "", ex if reply == "ok" else None)
    metrics.run_started(ex.record.name, ex.kind)
    traced.begin(ex.record, ex.kind, worker)
    definition = registry.serving(ex.record.name, ex.record.wf_version)
    if definition is None:
        # Not this worker's to fail: a rolling deploy, or a worker with other sources.
        note = (f"waiting for a worker that knows workflow {ex.record.name!r} (worker "
                f"{worker} does not)")
        if ex.record.name in registry.workflows:
            note = (f"waiting for a worker that serves version {ex.record.wf_version!r} of "
                    f"workflow {ex.record.name!r} (worker {worker} serves "
                    f"{', '.join(map(repr, sorted(registry.versions[ex.record.name])))})")
        status = runs.defer(ex, note)
        if ex.slot is not None:
            ex.slot.release()
        log.warning("run %s: %s; handed back (%s)", run_id, note, status)
        return _Outcome("deferred")
    watchdog = Watchdog(runs, ex, hard_exit=hard_exit)
    tokens = None
    try:
        try:
            value = definition.decode_input(bytes(ex.record.input))
        except msgspec.DecodeError as exc:
            return _Outcome(_settled(runs.settle(ex, "failed", error=_error(exc)), "failed"),
                            parent, ex)
        ctx = RunContext(runs, ex, value, watchdog, limits, deliver, registry)
        if definition.tags:
            # Recorded at start too, for a run started by a caller that had not imported
            # the definition (tags merge: the same ones again change nothing).
            from .tags import TagError

            try:
                ctx.tag(**definition.tags)
            except TagError as exc:  # the body's own tags took the room: they stay
                log.warning("run %s: declared tags not recorded: %s", run_id, exc)
        tokens = context.enter(ctx, ctx.root_frames)
        watchdog.start()
        status, result, error = "succeeded", b"", None
        try:
            output = compensation.run_body(
                ctx, functools.partial(_run_body, ctx, definition, value, watchdog), _error)
            result = msgspec.json.encode(output)
            limits.check("the run's result", len(result), limits.result_bytes, "result_bytes")
        except compensation.Compensated as done:
            status, error = done.status, done.error
        except StepFailedError as exc:
            status, error = "failed", exc.error
        except ParkRun as park:
            watchdog.finish()
            return _Outcome(park_run(runs, ex, park, deliver), parent)
        except NonDeterminismError as exc:
            status, error = "failed", ErrorInfo(type="NonDeterminism", message=str(exc),
                                                step=exc.frame)
        except BranchCancelled:  # cannot escape parallel(); a bug if it does
            status, error = "failed", ErrorInfo(type="BranchCancelled",
                                                message="a parallel branch escaped")
        except StoreUnavailable as lost:
            log.error("run %s attempt %s: the store is unavailable (%s); stopping unsettled, "
                      "it is redelivered once its lease expires", run_id, attempt,
                      one_line(lost.cause))
            raise RedisUnavailableError(f"store unavailable: {one_line(lost.cause)}") from None
        except StopExecution as stop:
            watchdog.finish()
            if stop.reason in ("cancelled", "timed_out"):
                settled = settle_stopped(runs, ex, stop.reason, deliver) == "ok"
                return _Outcome(stop.reason, parent, ex if settled else None)
            return _Outcome(stop.reason)
        except redis.RedisError:
            raise  # no settle possible; the lease expires and the run is redelivered
        except PayloadKeyMissing as missing:
            # A value sealed with a key this worker lacks (a signal, an answer, a child's
            # result, sealed by a process given a newer key first): not the run's failure.
            watchdog.finish()
            runs.write_held(ex)  # a step's success held for the next write is still the run's
            status = runs.defer(ex, f"waiting for a worker that can read it: {missing}")
            log.warning("run %s: %s; handed back (%s)", run_id, missing, status)
            return _Outcome("deferred")
        # sys.exit() and a KeyboardInterrupt raised by the body are its failure (a real
        # SIGINT never lands here: RQ's handlers turn it into a warm shutdown).
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            status, error = "failed", _error(exc)
        watchdog.finish()
        if status == "succeeded":
            return _Outcome(_settled(runs.settle(ex, "succeeded", result=result), "succeeded"),
                            parent, ex)
        if status == "cancelled":  # compensated after a cancel that asked for it
            return _Outcome(_settled(settle_stopped(runs, ex, "cancelled", deliver),
                                     "cancelled"), parent, ex)
        return _Outcome(_settled(runs.settle(ex, "failed", error=error), "failed"), parent, ex)
    finally:
        watchdog.finish()
        if ex.held is not None:
            # The body ended another way (an error the executor does not settle): a step's
            # success held for the next write is still the run's.
            with contextlib.suppress(redis.RedisError, RedisUnavailableError, OSError):
                runs.write_held(ex)
        if ex.slot is not None:
            ex.slot.release()  # settled, parked, handed back or stopped: no longer executing
        if ex.locks:  # taken where no `with` gives them back (its entry's write refused)
            from ..flow.locks import release_held

            release_held(runs, ex, deliver)
        if tokens is not None:
            context.leave(tokens)
