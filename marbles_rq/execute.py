"""Executing one delivery of a run: start the attempt, replay the ledger, run the body,
settle. This is what an RQ job runs, in a work-horse or in a pool executor."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from .authoring import Registry, StepDef, UnknownWorkflowError
from .errors import MarblesError, RedisUnavailableError
from .records import ErrorInfo, StepRecord
from .runs import Execution, RunStore

log = logging.getLogger("marbles_rq.execute")

EXIT_FENCED = 75  # a horse that learned it no longer owns its run exits with this code


class StopExecution(BaseException):
    """The execution must stop without writing (fenced) or settle (cancelled, timed out).
    A BaseException, so user code that catches Exception cannot swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StoreUnavailable(StopExecution):
    """The store could not be reached from inside the body. Not the step's failure: the
    execution stops unsettled, its lease expires, and the run is delivered again."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("store_unavailable")
        self.cause = cause


class StepFailedError(MarblesError):
    code = "step_failed"

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(f"step {error.step} failed: {error.type}: {error.message}")
        self.error = error


_current: ContextVar[RunContext | None] = ContextVar("marbles_run", default=None)


def current_run() -> RunContext | None:
    """The run whose body is executing in this thread, if any."""
    return _current.get()


def current() -> RunContext:
    run = _current.get()
    if run is None:
        raise MarblesError("not inside a marbles-rq run")
    return run


def _error(exc: BaseException, step: str = "") -> ErrorInfo:
    tb = "".join(traceback.format_exception(exc))[-4000:]
    return ErrorInfo(type=type(exc).__name__, message=str(exc)[:2000], step=step, traceback=tb)


class Stream:
    def __init__(self, run: RunContext) -> None:
        self._run = run

    def write(self, value: Any) -> None:
        """Append to the run's live output. Strings as text, anything else as JSON."""
        data = {"text": value} if isinstance(value, str) else {"value": value}
        self._run._write("output", data)


class RunLogger:
    """Log lines that go to the run's output and to the worker's log."""

    def __init__(self, run: RunContext) -> None:
        self._run = run

    def _log(self, level: int, msg: str, *args: Any) -> None:
        text = msg % args if args else msg
        log.log(level, "[%s] %s", self._run.run_id, text)
        self._run._write("log", {"level": logging.getLevelName(level), "message": text})

    def debug(self, msg: str, *args: Any) -> None:
        self._log(logging.DEBUG, msg, *args)

    def info(self, msg: str, *args: Any) -> None:
        self._log(logging.INFO, msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self._log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: Any) -> None:
        self._log(logging.ERROR, msg, *args)


class RunContext:
    """What a workflow body receives: its input, steps, live output, effect keys, a logger."""

    def __init__(self, runs: RunStore, ex: Execution, input: Any, watchdog: Watchdog) -> None:
        self.runs = runs
        self.ex = ex
        self.input = input
        self.stream = Stream(self)
        self.log = RunLogger(self)
        self._watchdog = watchdog
        self._frames: list[str] = [ex.record.name]
        self._counters: dict[str, int] = defaultdict(int)

    @property
    def run_id(self) -> str:
        return self.ex.run_id

    @property
    def attempt(self) -> int:
        return self.ex.attempt

    @property
    def step_path(self) -> str:
        """The path of the step executing now (the workflow name outside steps)."""
        return self._frames[-1]

    @property
    def idempotency_key(self) -> str:
        """Stable across redeliveries: run id + step path + call position. Hand it to
        systems that accept an idempotency key."""
        return f"{self.run_id}:{self.step_path}"

    def claim_effect(self, key: str | None = None) -> bool:
        """Reserve an effect once per run (default key: the current idempotency key).
        True for the first claimer ever; False if it was claimed before (by this run's
        earlier delivery); stops the execution if a newer one owns the run.

        A reservation, not a transaction with the effect: a crash between this claim and
        the effect leaves the effect undone. Where the target system takes an idempotency
        key, give it `idempotency_key` instead; that is exactly-once end to end."""
        status: str = self._store(self.runs.claim_effect, self.ex, key or self.idempotency_key)
        if status == "stale_epoch":
            raise StopExecution("stale")
        return status == "ok"

    # -- steps ----------------------------------------------------------------------------

    def step(self, fn: StepDef | Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` as a recorded step: once per run, its result replayed afterwards."""
        definition = fn if isinstance(fn, StepDef) else StepDef(fn.__name__, fn)
        base = f"{self._frames[-1]}.{definition.name}"
        key = f"{base}#{self._counters[base]}"
        self._counters[base] += 1
        recorded = self.ex.ledger.get(key)
        if recorded is not None and recorded.status == "succeeded":
            return _decode_result(recorded.result, definition.result_type)
        if recorded is not None and recorded.status == "failed":
            assert recorded.error is not None
            raise StepFailedError(recorded.error)
        attempts = recorded.attempts if recorded is not None else 0
        while True:
            attempts += 1
            self._check(self._store(self.runs.start_step, self.ex, StepRecord(
                version=1, key=key, name=definition.name, status="running", attempts=attempts,
                at_ms=_now_ms())))
            self._frames.append(key)
            try:
                value = definition.fn(*args, **kwargs)
                result = msgspec.json.encode(value)
            except Exception as exc:
                failure = exc
            else:
                record = StepRecord(version=1, key=key, name=definition.name,
                                    status="succeeded", attempts=attempts,
                                    result=msgspec.Raw(result), at_ms=_now_ms())
                self._commit(record, "step_succeeded", {"step": key, "attempt": attempts})
                return _decode_result(record.result, definition.result_type)
            finally:
                self._frames.pop()
            error = _error(failure, key)
            if attempts <= definition.retries:
                delay = definition.delay_for(attempts)
                self._commit(StepRecord(version=1, key=key, name=definition.name,
                                        status="running", attempts=attempts, error=error,
                                        at_ms=_now_ms()),
                             "step_retry", {"step": key, "attempt": attempts,
                                            "error": f"{error.type}: {error.message}",
                                            "retry_in_s": round(delay, 3)})
                self._watchdog.sleep(delay)
                continue
            self._commit(StepRecord(version=1, key=key, name=definition.name, status="failed",
                                    attempts=attempts, error=error, at_ms=_now_ms()),
                         "step_failed", {"step": key, "attempt": attempts,
                                         "error": f"{error.type}: {error.message}"})
            raise StepFailedError(error)

    def _store(self, call: Any, *args: Any) -> Any:
        """A store call from inside the body: unreachable Redis stops the execution."""
        try:
            return call(*args)
        except (redis.ConnectionError, redis.TimeoutError, RedisUnavailableError) as exc:
            raise StoreUnavailable(exc) from exc

    def _commit(self, record: StepRecord, event_type: str, data: dict[str, Any]) -> None:
        status = self._store(self.runs.commit_step, self.ex, record, event_type,
                             msgspec.json.encode(data))
        if status in ("ok", "cancelled"):
            self.ex.ledger[record.key] = record
        self._check(status)

    def _write(self, type: str, data: dict[str, Any]) -> None:
        self._check(self._store(self.runs.write, self.ex, type, msgspec.json.encode(data)))

    def _check(self, status: str) -> None:
        if status == "ok":
            self._watchdog.raise_if_stopped()
            return
        raise StopExecution({"stale": "stale", "settled": "stale"}.get(status, status))


def _decode_result(raw: msgspec.Raw, result_type: Any) -> Any:
    data = bytes(raw)
    try:
        return msgspec.json.decode(data, type=result_type)
    except msgspec.ValidationError:
        return msgspec.json.decode(data)


def _now_ms() -> int:
    return int(time.time() * 1000)


class Watchdog:
    """Renews the execution's lease every ttl/3 from a thread, and learns from the renewal
    when the execution must stop: cancelled, timed out, or fenced by a newer delivery. A body
    that does not reach a step boundary soon after is ended by exiting the process."""

    def __init__(self, runs: RunStore, ex: Execution, *, hard_exit: bool) -> None:
        self.runs, self.ex, self.hard_exit = runs, ex, hard_exit
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{ex.run_id}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sleep(self, seconds: float) -> None:
        """A retry backoff that ends early when the execution must stop."""
        self._stop.wait(seconds)
        self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        if self.reason is not None:
            raise StopExecution(self.reason)

    def _loop(self) -> None:
        interval = self.ex.ttl_ms / 3000
        while not self._stop.wait(interval):
            try:
                status = self.runs.renew(self.ex)
            except (redis.RedisError, RedisUnavailableError, OSError) as exc:
                log.warning("run %s: cannot renew its lease (%s); retrying", self.ex.run_id, exc)
                continue
            if status == "ok":
                continue
            self.reason = {"settled": "stale"}.get(status, status)
            if status == "cancelled":
                settle_stopped(self.runs, self.ex, "cancelled")
            elif status == "timed_out":
                settle_stopped(self.runs, self.ex, "timed_out")
            log.warning("run %s attempt %s: %s; stopping", self.ex.run_id, self.ex.attempt,
                        self.reason)
            self._stop.set()
            if self.hard_exit:
                # The body may be inside a long step; give it a moment to reach a boundary.
                time.sleep(min(1.0, interval))
                os._exit(EXIT_FENCED)
            return


def _settled(reply_status: str, status: str) -> str:
    """What a delivery reports to RQ: the status it settled, or why it could not."""
    return status if reply_status == "ok" else reply_status


def settle_stopped(runs: RunStore, ex: Execution, reason: str) -> None:
    if reason == "cancelled":
        runs.settle(ex, "cancelled")
    elif reason == "timed_out":
        runs.settle(ex, "failed", error=ErrorInfo(type="RunTimeout",
                                                  message="the run passed its timeout"))


@dataclass
class Engine:
    """What executing a delivery needs in this process."""

    runs: RunStore
    registry: Registry
    worker_name: str
    lease_ms: int
    hard_exit: bool = True  # forked horses exit when fenced; set False in tests


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
                   lease_ms=eng.lease_ms, hard_exit=eng.hard_exit)


def execute(runs: RunStore, registry: Registry, run_id: str, attempt: int, *, worker: str,
            lease_ms: int, hard_exit: bool) -> str:
    started = runs.start(run_id, attempt, ttl_ms=lease_ms, worker=worker)
    if started.status != "ok" or started.execution is None:
        log.info("run %s delivery %s: %s %s", run_id, attempt, started.status, started.detail)
        return started.status
    ex = started.execution
    watchdog = Watchdog(runs, ex, hard_exit=hard_exit)
    token = None
    try:
        try:
            definition = registry.workflow(ex.record.name)
            value = definition.decode_input(bytes(ex.record.input))
        except (UnknownWorkflowError, msgspec.DecodeError) as exc:
            return _settled(runs.settle(ex, "failed", error=_error(exc)), "failed")
        ctx = RunContext(runs, ex, value, watchdog)
        token = _current.set(ctx)
        watchdog.start()
        try:
            result = definition.fn(ctx) if definition.input_type is None else definition.fn(
                ctx, value)
            encoded = msgspec.json.encode(result)
        except StepFailedError as exc:
            return _settled(runs.settle(ex, "failed", error=exc.error), "failed")
        except StoreUnavailable as lost:
            log.error("run %s attempt %s: the store is unreachable (%s); stopping unsettled, "
                      "it is redelivered once its lease expires", run_id, attempt, lost.cause)
            raise RedisUnavailableError(f"store unreachable: {lost.cause}") from None
        except StopExecution as stop:
            if stop.reason in ("cancelled", "timed_out"):
                settle_stopped(runs, ex, stop.reason)
            return stop.reason
        except (redis.RedisError, RedisUnavailableError):
            raise  # no settle possible; the lease expires and the run is redelivered
        except Exception as exc:
            return _settled(runs.settle(ex, "failed", error=_error(exc)), "failed")
        return _settled(runs.settle(ex, "succeeded", result=encoded), "succeeded")
    finally:
        watchdog.stop()
        if token is not None:
            _current.reset(token)
