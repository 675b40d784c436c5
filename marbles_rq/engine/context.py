"""The run a workflow body executes in, as the body's API sees it: the run itself (through
`Run`, the small interface the executor implements), the frames of recorded calls and their
counters, what one run may write, and the signals of the recorded-call protocol.

The executor (engine/execute.py) installs its run here for the thread that executes the
body (`enter`, `leave`); the API a body calls (authoring's steps, waiting, fanout, api)
reads it from here and never imports the executor, so the executor can change without the
body's API, and the API has one way in.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Generator
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import msgspec

from ..envvars import env_int
from ..errors import MarblesError
from ..store.records import ErrorInfo, RunRecord, StepRecord
from . import authoring
from .runs import DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_MAX_OUTPUT_LINES

T = TypeVar("T")

if TYPE_CHECKING:
    from .authoring import Registry, StepDef
    from .execution import Execution
    from .runs import RunStore


class StopExecution(BaseException):
    """The execution must stop without writing (fenced) or settle (cancelled, timed out).
    A BaseException, so user code that catches Exception cannot swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BranchCancelled(BaseException):
    """A parallel branch stops at a boundary because a sibling failed."""


class StepFailedError(MarblesError):
    code = "step_failed"

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(f"step {error.step} failed: {error.type}: {error.message}")
        self.error = error


class ValueTooLargeError(MarblesError):
    """A run tried to write a value over its configured limit; nothing was written."""

    code = "value_too_large"


@dataclass(frozen=True)
class Limits:
    """What one run may write. Each from an environment variable of the worker."""

    write_bytes: int = 1 << 20        # one stream.write          MARBLES_MAX_WRITE
    log_bytes: int = 1 << 20          # one log line              MARBLES_MAX_LOG
    step_result_bytes: int = 1 << 20  # one step's result         MARBLES_MAX_STEP_RESULT
    result_bytes: int = 1 << 20       # the run's result          MARBLES_MAX_RESULT
    output_lines: int = DEFAULT_MAX_OUTPUT_LINES  # lines per run MARBLES_MAX_OUTPUT_LINES
    output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES  # bytes per run MARBLES_MAX_OUTPUT_BYTES

    ENV: ClassVar[dict[str, str]] = {
           "write_bytes": "MARBLES_MAX_WRITE", "log_bytes": "MARBLES_MAX_LOG",
           "step_result_bytes": "MARBLES_MAX_STEP_RESULT", "result_bytes": "MARBLES_MAX_RESULT",
           "output_lines": "MARBLES_MAX_OUTPUT_LINES", "output_bytes": "MARBLES_MAX_OUTPUT_BYTES"}

    @classmethod
    def from_env(cls) -> Limits:
        defaults = cls()
        return cls(**{name: env_int(var, getattr(defaults, name),
                                    unit="lines" if name == "output_lines" else "bytes")
                      for name, var in cls.ENV.items()})

    def check(self, what: str, size: int, limit: int, field_name: str) -> None:
        if size > limit:
            raise ValueTooLargeError(f"{what} is {size:,} bytes, over the limit of {limit:,} "
                                     f"({self.ENV[field_name]}); nothing was written")


@dataclass
class Frame:
    """One (re)entry of a step body, or the workflow body: its path and call counters."""

    path: str
    counters: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    seq: int = 0  # recorded calls made in this frame so far (steps, timers, children)
    # Which entry of the frame this is: the path with the try of each step on the way (a
    # retried step's writes are new output; a replay of the same try writes nothing again).
    tag: str = ""
    writes: int = 0  # output writes made in this entry so far: the next one's index

    def write_position(self) -> tuple[str, int]:
        """The position of the next output write here: (entry id, index)."""
        index = self.writes
        self.writes += 1
        return hashlib.sha1((self.tag or self.path).encode()).hexdigest()[:16], index


class Run(Protocol):
    """What the body's API needs of the run executing: its store, execution and settings,
    and the recorded-call protocol (a position per call, store calls that stop the
    execution when the store is gone, ledger commits and their replies)."""

    runs: RunStore
    ex: Execution
    registry: Registry
    limits: Limits
    # Enqueue a delivery (queue, run id, attempt) now: a child (None: the controller does).
    deliver: Callable[[str, str, int], bool] | None
    # Child run id -> the ledger key of the call that took it in this execution.
    child_ids: dict[str, str]
    child_ids_lock: threading.Lock
    # The run's questions as this execution found them (read once, at its first ask).
    found_asks: dict[str, dict[str, Any]] | None

    @property
    def run_id(self) -> str: ...

    @property
    def frame(self) -> Frame: ...

    def position(self, name: str) -> tuple[str, int]:
        """The ledger key and frame position of the next recorded call of `name` here."""
        ...

    def step(self, fn: StepDef | Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` as a recorded step."""
        ...

    def prepare_child(self, workflow: str, input: bytes, child_id: str) -> RunRecord:
        """A child run's record, its request validated as any enqueue's (engine/ops.py)."""
        ...

    def call_store(self, call: Any, *args: Any) -> Any:
        """A store call from inside the body (an outage stops the execution unsettled)."""
        ...

    def check_reply(self, status: str) -> None:
        """Go on after a write's reply `status`, or stop (or park) as it says."""
        ...

    def hold_entry(self, record: StepRecord, event_type: str, data: dict[str, Any]) -> None:
        """Commit a ledger entry with the execution's next write."""
        ...

    def commit_entry(self, record: StepRecord, event_type: str, data: dict[str, Any]) -> None:
        """Commit a ledger entry and act on the reply."""
        ...

    def commit_entry_reply(self, record: StepRecord, event_type: str,
                           data: dict[str, Any]) -> str:
        """Commit a ledger entry; the reply, not yet checked."""
        ...


_current: ContextVar[Run | None] = ContextVar("marbles_run", default=None)
# The frames of the thread executing (a parallel branch has its own), and the event that
# tells a branch its sibling failed.
_frames: ContextVar[list[Frame] | None] = ContextVar("marbles_frames", default=None)
branch_cancel: ContextVar[threading.Event | None] = ContextVar("marbles_branch", default=None)
# True where the code executing is an `async def` workflow or step body (on its run's event
# loop): there a recorded call returns an awaitable. Off again inside a sync step that such a
# body runs in a thread (engine/async_run.py).
async_body: ContextVar[bool] = ContextVar("marbles_async", default=False)
_ACTIVE: list[Run] = []  # the runs executing in this process (several: --concurrency)


def enter(run: Run, frames: list[Frame]) -> tuple[Token[Run | None], Token[list[Frame] | None]]:
    """The executor: `run` executes its body in this thread, in `frames`."""
    tokens = _current.set(run), _frames.set(frames)
    _ACTIVE.append(run)
    return tokens


def leave(tokens: tuple[Token[Run | None], Token[list[Frame] | None]]) -> None:
    """The executor: the run that `enter` installed no longer executes here."""
    run = _current.get()
    _current.reset(tokens[0])
    _frames.reset(tokens[1])
    if run in _ACTIVE:
        _ACTIVE.remove(run)


def enter_branch(frame: Frame, cancel: threading.Event) -> None:
    """A parallel branch's thread: its own frame, and the event its siblings' failure sets."""
    _frames.set([frame])
    branch_cancel.set(cancel)


def set_frames(frames: list[Frame]) -> Token[list[Frame] | None]:
    """An async step's own frames, in its task (engine/async_run.py)."""
    return _frames.set(frames)


def reset_frames(token: Token[list[Frame] | None]) -> None:
    _frames.reset(token)


def thread_frames() -> list[Frame] | None:
    """The frames of this thread's body (None outside a run's body and its branches)."""
    return _frames.get()


def current_run() -> Run | None:
    """The run whose body is executing in this thread, if any."""
    return _current.get()


class Ready(Generic[T]):
    """A recorded call's outcome, already known, as an awaitable (what the module-level
    waiting words return in an async body: `await mr.sleep(5)`)."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, T]:
        return self.value
        yield  # a generator: `await` takes its return value

    def __repr__(self) -> str:
        return f"<marbles-rq awaitable: await it for {self.value!r}>"


def awaitable_here(value: T) -> T | Ready[T]:
    """`value`, or in an async body an awaitable of it."""
    return Ready(value) if async_body.get() else value



def check_not_in_foreign_thread(what: str) -> None:
    """A recorded call from a thread the body started would go unrecorded: refuse it."""
    active = list(_ACTIVE)
    if active and _current.get() is None:
        who = f"run {active[0].run_id}" if len(active) == 1 else "a run's body"
        raise MarblesError(f"{what} was called from a thread that {who} started; it would "
                           f"not be recorded. Run concurrent steps with mr.parallel(...)")


def current(what: str = "mr.current()") -> Run:
    """The run whose body is executing in this thread; `what` names the call that needs it
    in the error raised outside a run."""
    run = _current.get()
    if run is None:
        # In a thread the body started, say so (and what to use instead), not "not inside".
        check_not_in_foreign_thread(what)
        raise MarblesError("not inside a marbles-rq run")
    return run


def check_branch() -> None:
    """A parallel branch whose sibling failed stops at its next boundary."""
    cancel = branch_cancel.get()
    if cancel is not None and cancel.is_set():
        raise BranchCancelled()


def decode_result(raw: msgspec.Raw, result_type: Any) -> Any:
    """A recorded result, as `result_type` when it still fits, else as plain JSON."""
    data = bytes(raw)
    try:
        return msgspec.json.decode(data, type=result_type)
    except msgspec.ValidationError:
        return msgspec.json.decode(data)


def now_ms() -> int:
    """Now, in epoch ms: the run's own clock where it has one (a run in memory: its virtual
    clock), else this machine's."""
    run = _current.get()
    clock = run.ex.clock if run is not None else None
    return clock() if clock is not None else int(time.time() * 1000)


def _route_step(step: StepDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A decorated step called inside a run goes through its ledger; elsewhere it is a plain
    call (refused from a thread a body started: it would go unrecorded)."""
    run = current_run()
    if run is None:
        check_not_in_foreign_thread(f"step {step.name!r}")
        return step.fn(*args, **kwargs)
    return run.step(step, *args, **kwargs)


authoring.route_steps(_route_step)
