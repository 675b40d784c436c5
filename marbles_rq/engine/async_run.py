"""Async workflows and steps: an ``async def`` body runs on an event loop of the thread
that executes its delivery, and its recorded calls are awaited.

    @mr.step
    async def fetch(url: str) -> str: ...

    @mr.workflow
    async def crawl(ctx: mr.AsyncRunContext, urls: list[str]) -> int:
        pages = await asyncio.gather(*(fetch(u) for u in urls))  # positions: call order
        await ctx.sleep(3600)
        return len(pages)

What keeps a replay on the same ledger positions: a step takes its position when it is
*called*, before anything is awaited, so `asyncio.gather(fetch(a), fetch(b))` records `a` at
the first position and `b` at the second whichever finishes first. Each step body runs in a
frame of its own (a context variable, so concurrent tasks do not share one). The waiting
words (`sleep`, `wait_for_signal`, `ask`, `gather` ...) do what they do in a sync body
(parking the run when there is something to wait for); in an async body they are awaited.
A sync step called from an async body runs in a bounded thread pool (MARBLES_SYNC_STEPS),
so the loop goes on with the body's other tasks meanwhile; an async step called from a sync
body runs to its end on the thread's own loop.

Store calls stay synchronous (each a few hundred microseconds): a process executes several
runs at once by executing each in a thread of its own (transport/lean.py), each thread with
its own loop, and the store calls of different runs overlap there.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .. import tracing
from ..envvars import env_int
from ..errors import MarblesError
from . import context, event_waits, fanout, published, signal_waits, waiting
from .context import BranchCancelled, Frame, Ready, StopExecution
from .waiting import ParkRun

if TYPE_CHECKING:
    from ..store.records import StepRecord
    from .authoring import StepDef, WorkflowDef

T = TypeVar("T")


# What this module needs of the executor (engine/execute.py), which hands it async bodies
# and steps: described here, so that the executor depends on this module and not back.

class StepCall(Protocol):
    """One call of a step at its ledger position (execute.StepCall)."""

    key: str
    definition: StepDef
    attempts: int

    @property
    def replayed(self) -> bool: ...

    def replay(self) -> Any: ...

    def parked(self) -> StepRecord: ...

    def frame(self, parent: Frame) -> Frame: ...


class Watchdog(Protocol):
    """An execution's watchdog (execute.Watchdog): why it must stop, and who to tell."""

    reason: str | None
    on_stop: Callable[[], None] | None

    def raise_if_stopped(self) -> None: ...


class RunContext(context.Run, Protocol):
    """The run context a body executes in (execute.RunContext)."""

    root_frames: list[Frame]
    input: Any
    stream: Any
    log: Any
    report: waiting.Reporter

    @property
    def _watchdog(self) -> Watchdog: ...

    @property
    def attempt(self) -> int: ...

    @property
    def step_path(self) -> str: ...

    @property
    def idempotency_key(self) -> str: ...

    def claim_effect(self, key: str | None = None) -> bool: ...

    def tag(self, **tags: Any) -> None: ...

    def compensate(self, fn: Any, *args: Any, **kwargs: Any) -> None: ...

    def begin_attempt(self, call: Any) -> None: ...

    def encode_result(self, call: Any, value: Any) -> bytes: ...

    def step_succeeded(self, call: Any, result: bytes, tried: float) -> Any: ...

    def step_failed(self, call: Any, failure: BaseException, tried: float,
                    args: tuple[Any, ...] = ..., kwargs: dict[str, Any] | None = ...) -> float: ...

DEFAULT_SYNC_STEP_THREADS = 16
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_loops = threading.local()


def _sync_steps() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            size = env_int("MARBLES_SYNC_STEPS", DEFAULT_SYNC_STEP_THREADS, unit="threads")
            _pool = ThreadPoolExecutor(max_workers=max(1, size),
                                       thread_name_prefix="marbles-sync-step")
        return _pool


def thread_loop() -> asyncio.AbstractEventLoop:
    """This thread's event loop (one per executing thread, kept for its next run: clients
    such as httpx's keep their pooled connections on it)."""
    loop: asyncio.AbstractEventLoop | None = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        loop.set_task_factory(_task_in_own_frame)
        _loops.loop = loop
    return loop


def _task_in_own_frame(loop: asyncio.AbstractEventLoop, coro: Any,
                       context: contextvars.Context | None = None) -> asyncio.Task[Any]:
    """Each task a body creates (`asyncio.gather(helper(a), helper(b))`) takes its recorded
    calls in a frame of its own, named by the order of creation in its creator's frame:
    sibling tasks reach their later calls in the order their awaits happen to finish, and a
    replay (recorded steps return at once) reaches them in another order, so one shared
    frame would hand a task its sibling's results, or fail the run with NonDeterminism."""
    copied = contextvars.copy_context() if context is None else context
    if asyncio.current_task(loop) is not None:
        copied.run(_enter_task_frame)
    return asyncio.Task(coro, loop=loop, context=copied)


def _enter_task_frame() -> None:
    frames = context.thread_frames()
    if not frames or context.current_run() is None:
        return
    parent = frames[-1]
    n = parent.counters["|task"]
    parent.counters["|task"] += 1
    context.set_frames([*frames, Frame(f"{parent.path}.|task#{n}",
                                       tag=f"{parent.tag or parent.path}.|task#{n}")])


class _InFlight:
    """The step attempts executing in a body's tasks. When the body parks while a sibling
    task is inside a step, that attempt ends and is recorded before the run parks: a sync
    step in the thread pool cannot be stopped, and an async one would be re-run on resume
    for no reason. No new attempt starts meanwhile."""

    def __init__(self) -> None:
        self.count = 0
        self.closing = False
        self.idle: asyncio.Event | None = None
        # Calls not yet awaited (a step's ledger key, or a token -> what to call it): a body
        # that returns with one left forgot an `await`, and it would silently never run.
        self.unawaited: dict[str, str] = {}

    def ended(self) -> None:
        self.count -= 1
        if self.count == 0 and self.idle is not None:
            self.idle.set()

    def drain(self, loop: asyncio.AbstractEventLoop) -> None:
        self.closing = True
        while self.count:
            self.idle = asyncio.Event()
            loop.run_until_complete(self.idle.wait())


_in_flight: contextvars.ContextVar[_InFlight | None] = contextvars.ContextVar(
    "marbles_in_flight", default=None)


def _finish_leftovers(loop: asyncio.AbstractEventLoop, body: asyncio.Task[Any] | None = None,
                      flight: _InFlight | None = None) -> None:
    """Cancel the tasks a body left running (asyncio.run does the same): none of them may
    write for this execution once it has its outcome. A body that parks first lets the
    step attempts in flight end (_InFlight)."""
    if (flight is not None and body is not None and body.done() and not body.cancelled()
            and isinstance(body.exception(), ParkRun)):
        flight.drain(loop)
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


def _run_on_loop(coro: Coroutine[Any, Any, T], on_task: Callable[[asyncio.Task[T]], None]
                 | None = None) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise MarblesError("an async step was called from sync code running on an event "
                           "loop; await it from an async body instead")
    loop = thread_loop()

    async def in_async_body() -> T:
        context.async_body.set(True)  # this task's own context
        return await coro

    flight = _InFlight()
    token = _in_flight.set(flight)  # the body's tasks copy it
    try:
        task = loop.create_task(in_async_body())
    finally:
        _in_flight.reset(token)
    if on_task is not None:
        on_task(task)
    try:
        value = loop.run_until_complete(task)
    finally:
        _finish_leftovers(loop, task, flight)
    if flight.unawaited:
        what = next(iter(flight.unawaited.values()))
        raise MarblesError(f"{what} was called but never awaited before the workflow "
                           f"returned, so it never ran: await it, or gather it")
    return value


def must_await(what: str, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """`coro`, noted as not awaited until it starts (see _InFlight.unawaited)."""
    flight = _in_flight.get()
    if flight is None:
        return coro
    token = f"{what}@{id(coro):x}"
    flight.unawaited[token] = what

    async def awaited() -> T:
        flight.unawaited.pop(token, None)
        return await coro

    return awaited()


def run_here(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> T:
    """An async step called from a sync body: run to its end on this thread's loop."""
    return _run_on_loop(_awaited(fn(*args, **kwargs)))


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def run_body(run: RunContext, definition: WorkflowDef, value: Any, watchdog: Watchdog) -> Any:
    """Execute an async workflow body to its outcome on this thread's loop. A watchdog that
    learns the run must stop (cancelled, timed out, fenced) cancels the body's task: it
    stops at its next await, as StopExecution."""
    actx = AsyncRunContext(run)
    coro = definition.fn(actx) if definition.input_type is None else definition.fn(actx, value)
    loop = thread_loop()
    ended = threading.Event()  # a cancel that comes late must not reach this loop's next run

    def cancellable(task: asyncio.Task[Any]) -> None:
        def cancel_all() -> None:
            if ended.is_set():
                return
            for each in asyncio.all_tasks(loop):  # the body's and its leftovers (_InFlight)
                each.cancel()

        def cancel() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing runs on it
                loop.call_soon_threadsafe(cancel_all)
        watchdog.on_stop = cancel

    try:
        return _run_on_loop(coro, cancellable)
    except asyncio.CancelledError:
        if watchdog.reason is not None:
            raise StopExecution(watchdog.reason) from None
        raise MarblesError("the workflow's task was cancelled by its own code") from None
    finally:
        ended.set()
        watchdog.on_stop = None


async def _in_thread(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """A sync step's body in the sync-step pool, in a copy of this task's context (the run,
    the step's frames), as sync code: its own recorded calls are plain calls."""
    copied = contextvars.copy_context()

    def call() -> T:
        context.async_body.set(False)
        return fn(*args, **kwargs)

    return await asyncio.get_running_loop().run_in_executor(_sync_steps(), copied.run, call)


def step_async(run: RunContext, call: StepCall, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Coroutine[Any, Any, Any]:
    """The awaitable of a step called in an async body (its position is already taken)."""
    flight = _in_flight.get()
    if flight is not None:
        flight.unawaited[call.key] = f"step {call.definition.name!r} ({call.key})"
    return _step(run, call, args, kwargs)


async def _step(run: RunContext, call: StepCall, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    flight = _in_flight.get()
    if flight is not None:
        flight.unawaited.pop(call.key, None)
    if call.replayed:
        return call.replay()
    definition = call.definition
    is_async = inspect.iscoroutinefunction(definition.fn)
    while True:
        if flight is not None and flight.closing:
            raise asyncio.CancelledError  # the body parked: no new attempt (_InFlight)
        run.begin_attempt(call)
        if flight is not None:
            flight.count += 1
        token = context.set_frames([*(context.thread_frames() or run.root_frames),
                                    call.frame(run.frame)])
        tried = time.perf_counter()
        try:
            try:
                with tracing.step(definition.name, call.key, call.attempts):
                    if is_async:
                        value = await definition.fn(*args, **kwargs)
                    else:
                        value = await _in_thread(definition.fn, args, kwargs)
                result = run.encode_result(call, value)
            except ParkRun as park:
                park.ledger.append(call.parked())
                raise
            except (Exception, SystemExit, KeyboardInterrupt) as exc:  # the step's failure
                failure: BaseException = exc
            else:
                return run.step_succeeded(call, result, tried)
            finally:
                context.reset_frames(token)
            delay = run.step_failed(call, failure, tried, args, kwargs)
        finally:
            if flight is not None:
                flight.ended()
        await _backoff(run, delay)


async def _backoff(run: RunContext, seconds: float) -> None:
    """A retry's wait; the watchdog cancels the task if the run must stop meanwhile (none
    on a virtual clock: a run in memory does not wait for it)."""
    if run.ex.clock is None:
        await asyncio.sleep(seconds)
    run._watchdog.raise_if_stopped()


async def parallel(run: RunContext, calls: list[Callable[[], Any]]) -> list[Any]:
    """`await ctx.parallel(lambda: fetch(a), lambda: fetch(b))`: as the sync `parallel`
    (engine/fanout.py), with each branch a task in a frame of its own: stable positions
    whatever order they finish in; the first failure stops the siblings at their next
    boundary and is raised; a branch that parks parks the run once the others are done."""
    frame, n, base = fanout.open_parallel(run, calls)
    if not calls:
        return []
    cancel = threading.Event()
    failed_at: list[tuple[float, int]] = []

    async def branch(i: int, call: Callable[[], Any]) -> tuple[str, Any]:
        context.enter_branch(Frame(f"{base}[{i}]",
                                   tag=f"{frame.tag or frame.path}.|parallel#{n}[{i}]"), cancel)
        try:
            value = call()
            if inspect.isawaitable(value):
                value = await value
            return "ok", value
        except ParkRun as parked:
            return "park", parked
        except BranchCancelled:
            return "cancelled", None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            failed_at.append((time.monotonic(), i))
            cancel.set()
            return "error", exc

    # Each task copies this context, then sets its own frame in its copy.
    outcomes = await asyncio.gather(*(branch(i, c) for i, c in enumerate(calls)))
    return fanout.branches_outcome(list(outcomes), failed_at)


class AsyncAsk:
    """`await ctx.ask.approval(...)`, `await ctx.ask.question(...)`."""

    def __init__(self, run: RunContext) -> None:
        self._ask = waiting.Ask(run)

    def approval(self, title: str, body: str | None = None, key: str | None = None,
                 **options: Any) -> Ready[dict[str, Any]]:
        return Ready(self._ask.approval(title, body, key, **options))

    def question(self, title: str, body: str | None = None,
                 choices: list[str] | None = None, key: str | None = None,
                 **options: Any) -> Ready[str]:
        return Ready(self._ask.question(title, body, choices, key, **options))


class AsyncRunContext:
    """What an ``async def`` workflow receives: the run context, with the words that may
    wait awaitable (`await ctx.sleep(60)`, `await ctx.step(fetch, url)`), the others as in
    a sync body (`ctx.publish`, `ctx.log`, `ctx.stream`, `ctx.start_child` ...)."""

    def __init__(self, run: RunContext) -> None:
        self.sync = run  # the sync context: its calls block this body's loop
        self.ask = AsyncAsk(run)

    # -- as in a sync body -------------------------------------------------------------

    @property
    def input(self) -> Any:
        return self.sync.input

    @property
    def stream(self) -> Any:
        return self.sync.stream

    @property
    def log(self) -> Any:
        return self.sync.log

    @property
    def report(self) -> waiting.Reporter:
        return self.sync.report

    @property
    def run_id(self) -> str:
        return self.sync.run_id

    @property
    def attempt(self) -> int:
        return self.sync.attempt

    @property
    def step_path(self) -> str:
        return self.sync.step_path

    @property
    def idempotency_key(self) -> str:
        return self.sync.idempotency_key

    def claim_effect(self, key: str | None = None) -> bool:
        return self.sync.claim_effect(key)

    def publish(self, key: str, value: Any) -> None:
        published.publish(self.sync, key, value)

    def compensate(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Register an undo (see RunContext.compensate); not awaited."""
        self.sync.compensate(fn, *args, **kwargs)

    def tag(self, **tags: Any) -> None:
        self.sync.tag(**tags)

    def signals(self, name: str) -> list[Any]:
        return signal_waits.drain_signals(self.sync, name)

    def start_child(self, workflow: str, input: Any = None, key: str | None = None
                    ) -> fanout.ChildRun:
        return fanout.start_child(self.sync, workflow, input, key)

    # -- awaited -----------------------------------------------------------------------

    def step(self, fn: Any, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        """Run `fn` (sync or async) as a recorded step; awaitable. Its ledger position is
        taken at this call, so `asyncio.gather(ctx.step(f, a), ctx.step(f, b))` records
        in call order."""
        token = context.async_body.set(True)
        try:
            awaitable: Coroutine[Any, Any, Any] = self.sync.step(fn, *args, **kwargs)
        finally:
            context.async_body.reset(token)
        return awaitable

    # The waiting words do their work when called, as the module-level ones do (`mr.sleep`):
    # a forgotten `await` must not skip a durable wait; the awaitable holds the outcome.

    def sleep(self, seconds: float) -> Ready[None]:
        waiting.sleep(self.sync, seconds)
        return Ready(None)

    def sleep_until(self, when: dt.datetime) -> Ready[None]:
        waiting.sleep_until(self.sync, when)
        return Ready(None)

    def wait_for_signal(self, name: str, timeout_s: float | None = None) -> Ready[Any]:
        return Ready(signal_waits.wait_for_signal(self.sync, name, timeout_s))

    def wait_for_event(self, source: str, type: str | None = None,
                       match: dict[str, Any] | None = None,
                       timeout_s: float | None = None,
                       lookback_s: float | None = None) -> Ready[event_waits.ReceivedEvent]:
        return Ready(event_waits.wait_for_event(self.sync, source, type, match, timeout_s,
                                                lookback_s))

    def gather(self, *children: fanout.ChildRun) -> Ready[list[Any]]:
        """The results of child runs, parking until every one has settled."""
        return Ready(fanout.gather(self.sync, list(children)))

    def parallel(self, *calls: Callable[[], Any]) -> Coroutine[Any, Any, list[Any]]:
        return must_await("ctx.parallel(...)", parallel(self.sync, list(calls)))
