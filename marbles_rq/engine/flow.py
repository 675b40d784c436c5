"""What a run body uses to wait, fan out and report: questions and approvals, reports,
durable timers, child runs, parallel steps.

Waiting never blocks a worker. A call that must wait raises ParkRun; the execution ends,
parks the run (engine/waits.py) and frees its worker; when what it waits for happens, the
run is delivered again and the body replays from the top against the ledger, where the call
now returns (the recorded answer, the fired timer, the child's result).

    approved = ctx.ask.approval("Ship it?")            # -> {"approved": bool, "note": ...}
    colour = ctx.ask.question("Colour?", choices=["red", "blue"])
    ctx.report.milestone({"built": 3})
    mr.sleep(3600)
    child = mr.start_child("resize", {"id": 7}); child.result()
    a, b = mr.parallel(lambda: fetch("a"), lambda: fetch("b"))
"""

from __future__ import annotations

import contextvars
import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from ..errors import InvalidIdError, MarblesError, RedisUnavailableError
from ..store.ids import ID_PATTERN
from ..store.records import AskRecord, ErrorInfo, ReportRecord, RunRecord, StepRecord
from ..store.redis_errors import one_line
from .authoring import InputError

if TYPE_CHECKING:
    from .execute import RunContext
    from .runs import Execution, RunStore

log = logging.getLogger("marbles_rq.engine.flow")

CHILD_CHECK_MS = 2_000  # the controller first checks a waited-for child after this long
MAX_CHOICES = 9
MAX_TITLE = 500
MAX_BODY = 20_000
MAX_CHOICE = 200
MAX_SLEEP_MS = 10 * 366 * 86_400_000  # timers are for up to ten years
TERMINAL = ("succeeded", "failed", "cancelled")
KIND_NAMES = {"|sleep": "mr.sleep", "|child": "mr.start_child"}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


# -- parking -----------------------------------------------------------------------------

@dataclass
class Wait:
    """One thing a run waits for."""

    reason: str  # question | timer | child | paused
    wake_at_ms: int = 0  # when the controller wakes it (0: only from outside)
    questions: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    until_ms: int = 0
    asks: list[AskRecord] = field(default_factory=list)
    ledger: list[StepRecord] = field(default_factory=list)


class ParkRun(BaseException):
    """The run must wait: the execution ends and the run parks. A BaseException, so a
    body's `except Exception` cannot swallow it."""

    def __init__(self, waits: list[Wait]) -> None:
        super().__init__(", ".join(w.reason for w in waits))
        self.waits = waits
        self.ledger: list[StepRecord] = [r for w in waits for r in w.ledger]


class BranchCancelled(BaseException):
    """A parallel branch stops at a boundary because a sibling failed."""


class NonDeterminismError(BaseException):
    """The replayed body called something else at a recorded position: the run fails. A
    BaseException, so a step's retries and a body's `except Exception` do not hide it."""

    def __init__(self, frame: str, position: int, recorded: str, called: str) -> None:
        super().__init__(
            f"non-deterministic replay in {frame} at position {position}: the ledger "
            f"recorded {_name(recorded)!r} there, the body now calls {_name(called)!r} "
            f"(a workflow must make its recorded calls in the same order on every replay)")
        self.frame = frame


def _name(name: str) -> str:
    return KIND_NAMES.get(name, name)


class AskTimeoutError(MarblesError):
    code = "ask_timeout"


class ChildFailedError(MarblesError):
    """A child run the parent waited for failed or was cancelled."""

    code = "child_failed"

    def __init__(self, child_id: str, status: str, error: ErrorInfo | None) -> None:
        what = f"{error.type}: {error.message}" if error is not None else status
        super().__init__(f"child run {child_id} {status}: {what}")
        self.child_id, self.status, self.error = child_id, status, error


def park(runs: RunStore, ex: Execution, parked: ParkRun,
         deliver: Callable[[str, str, int], bool] | None) -> str:
    """Park the run for what `parked` waits for; returns the delivery's outcome."""
    from .execute import count_finished, settle_stopped

    waits = parked.waits
    reasons = {w.reason for w in waits}
    reason = next(r for r in ("paused", "question", "child", "timer") if r in reasons)
    wake_at = min((w.wake_at_ms for w in waits if w.wake_at_ms), default=0)
    wait_for: dict[str, Any] = {}
    questions = [q for w in waits for q in w.questions]
    children = [c for w in waits for c in w.children]
    until = min((w.until_ms for w in waits if w.until_ms), default=0)
    if questions:
        wait_for["questions"] = questions
    if children:
        wait_for["children"] = children
    if until:
        wait_for["until_ms"] = until
    status, attempt, queue = runs.waits().park(
        ex, reason=reason, wake_at_ms=wake_at, wait_for=wait_for, ledger=parked.ledger,
        asks=[a for w in waits for a in w.asks])
    if status == "cancelled":
        if settle_stopped(runs, ex, "cancelled") == "ok":
            count_finished(ex, "cancelled")
        return "cancelled"
    if status == "requeued":
        _deliver(deliver, queue, ex.run_id, attempt)
        return "requeued"
    if status == "ok":
        log.info("run %s attempt %s parked: %s", ex.run_id, ex.attempt, reason)
        return "parked"
    return status


def _deliver(deliver: Callable[[str, str, int], bool] | None, queue: str, run_id: str,
             attempt: int) -> None:
    """Enqueue a delivery now; a failure leaves it to the controller (after its grace)."""
    if deliver is None:
        return
    try:
        deliver(queue, run_id, attempt)
    except (redis.RedisError, OSError) as exc:
        log.warning("run %s attempt %s: enqueue failed (%s); the controller dispatches it",
                    run_id, attempt, one_line(exc))


def wake_parent(runs: RunStore, parent: str, child: str,
                deliver: Callable[[str, str, int], bool] | None) -> None:
    """A child settled: wake its parent if it waits (the controller's check would, later)."""

    try:
        status, attempt, queue = runs.waits().wake(parent, "child", detail={"child": child})
    except (redis.RedisError, RedisUnavailableError, MarblesError, OSError) as exc:
        log.warning("run %s: cannot wake parent %s now (%s); the controller will", child,
                    parent, one_line(exc))
        return
    if status == "woken":
        _deliver(deliver, queue, parent, attempt)


# -- questions ---------------------------------------------------------------------------

class Ask:
    """`ctx.ask`: questions and approvals that park the run until someone answers."""

    def __init__(self, run: RunContext) -> None:
        self._run = run

    def approval(self, title: str, body: str | None = None, key: str | None = None, *,
                 timeout_s: float | None = None, default: Any = ...) -> dict[str, Any]:
        """{"approved": bool, "note": str | None}, once someone approves or rejects."""
        answer = self._ask("approval", title, body, None, key, timeout_s, default)
        return answer if isinstance(answer, dict) else {"approved": bool(answer), "note": None}

    def question(self, title: str, body: str | None = None, choices: list[str] | None = None,
                 key: str | None = None, *, timeout_s: float | None = None,
                 default: Any = ...) -> str:
        """The answer text (one of `choices` when given, at most 9)."""
        if choices is not None:
            if not 1 <= len(choices) <= MAX_CHOICES or not all(
                    isinstance(c, str) and c for c in choices):
                raise InputError(f"choices: 1 to {MAX_CHOICES} non-empty strings")
            if len(set(choices)) != len(choices):
                raise InputError("choices must differ from each other")
        if default is not ... and choices and default not in choices:
            raise InputError(f"the default {default!r} is not one of the choices")
        answer = self._ask("question", title, body, choices, key, timeout_s, default)
        # An answer is text; a timed-out question returns its default as given (None too).
        return answer if isinstance(answer, str) or answer is default else str(answer)

    def _ask(self, kind: str, title: str, body: str | None, choices: list[str] | None,
             key: str | None, timeout_s: float | None, default: Any) -> Any:
        from .execute import check_not_in_foreign_thread
        from .waits import check_key

        check_not_in_foreign_thread(f"ask.{kind}")
        run = self._run
        run._check_branch()
        if not isinstance(title, str) or not title.strip():
            raise InputError("a question needs a title")
        # The feed lists every open question of every run: one run must not swamp it.
        if len(title) > MAX_TITLE:
            raise InputError(f"a question's title is at most {MAX_TITLE} characters")
        if body is not None and (not isinstance(body, str) or len(body) > MAX_BODY):
            raise InputError(f"a question's body is text of at most {MAX_BODY} characters")
        if choices is not None and any(len(c) > MAX_CHOICE for c in choices):
            raise InputError(f"a choice is at most {MAX_CHOICE} characters")
        if timeout_s is not None and not 0 < timeout_s <= 366 * 86400:
            raise InputError("timeout_s must be between 0 and a year")
        frame = run.frame
        n = frame.counters["|ask"]
        frame.counters["|ask"] += 1
        qkey = check_key(key, "question key") if key is not None else _local(run, f"ask:{n}")
        state = run_asks(run).get(qkey)
        if state is not None and state["kind"] != kind:
            # An answer recorded for another kind of ask (the code changed under a waiting
            # run) must not be read as this one: "no" is not an approval.
            raise NonDeterminismError(frame.path, n, f"ask.{state['kind']}", f"ask.{kind}")
        if state is not None and state["state"] == "answered":
            return state["answer"]
        if state is not None and state["state"] == "timed_out":
            if default is not ...:
                return default
            raise AskTimeoutError(f"question {qkey!r} was not answered within its timeout")
        if state is not None and state["state"] == "cancelled":
            from .execute import StopExecution

            raise StopExecution("cancelled")
        record = AskRecord(version=1, key=qkey, ask=kind, title=title, body=body,
                           choices=choices, step=frame.path, timeout_s=timeout_s or 0.0,
                           default=msgspec.Raw(msgspec.json.encode(
                               None if default is ... else default)),
                           has_default=default is not ...)
        raise ParkRun([Wait("question", questions=[qkey], asks=[record])])


def run_asks(run: RunContext) -> dict[str, dict[str, Any]]:
    """The run's questions as this execution found them (read once, at its first ask)."""
    if run._asks is None:

        questions = run._store(run.runs.waits().questions, run.run_id)
        run._asks = {q.key: {"state": q.state, "answer": q.answer, "kind": q.record.ask}
                     for q in questions}
    return run._asks


def _local(run: RunContext, name: str) -> str:
    """A default key: `name` in the workflow's own frame, `<step>/<name>` inside a step."""
    root = run.ex.record.name
    path = run.frame.path
    if path == root:
        return name
    # Never a '|' (the feed's separator), and at most 128 characters.
    frame = path[len(root) + 1:].replace("|parallel#", "parallel").replace("|", "")
    key = f"{frame}/{name}"
    if len(key) > 128 or not key.isprintable():
        import hashlib

        key = f"{hashlib.sha1(path.encode()).hexdigest()[:16]}/{name}"
    return key


# -- reports -----------------------------------------------------------------------------

class Reporter:
    """`ctx.report`: milestones and results, kept with the run and listed in the feed."""

    def __init__(self, run: RunContext) -> None:
        self._run = run

    def milestone(self, entry: Any, key: str | None = None) -> None:
        self._add("milestone", entry, key)

    def result(self, entry: Any, key: str | None = None) -> None:
        self._add("result", entry, key)

    def _add(self, kind: str, entry: Any, key: str | None) -> None:
        from .execute import _now_ms, check_not_in_foreign_thread
        from .waits import check_key

        check_not_in_foreign_thread(f"report.{kind}")
        run = self._run
        frame = run.frame
        n = frame.counters[f"|{kind}"]
        frame.counters[f"|{kind}"] += 1
        rkey = check_key(key, "report key") if key is not None else _local(run, f"{kind}:{n}")
        encoded = msgspec.json.encode(entry)
        run.limits.check(f"report {rkey}", len(encoded), run.limits.write_bytes, "write_bytes")
        record = ReportRecord(version=1, key=rkey, report=kind, entry=msgspec.Raw(encoded),
                              step=frame.path, at_ms=_now_ms())
        status = run._store(run.runs.waits().add_report, run.ex, record)
        run._check("ok" if status == "exists" else status)


# -- timers ------------------------------------------------------------------------------

def sleep(run: RunContext, seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (
            0 <= seconds <= MAX_SLEEP_MS / 1000):
        raise InputError(f"sleep takes seconds from 0 to ten years, not {seconds!r}")
    # Rounded up: a sleep is never shorter than asked.
    _timer(run, lambda: run.ex.server_now_ms() + math.ceil(seconds * 1000))


def sleep_until(run: RunContext, when: dt.datetime) -> None:
    if not isinstance(when, dt.datetime) or when.tzinfo is None:
        raise InputError("sleep_until takes a timezone-aware datetime")
    # Exact, rounded up to the next millisecond: a float timestamp can land a fraction of a
    # millisecond before `when`, and a timer must never fire before it.
    _timer(run, lambda: -((_EPOCH - when) // dt.timedelta(milliseconds=1)))


def _timer(run: RunContext, due_of: Callable[[], int]) -> None:
    from .execute import _now_ms, check_not_in_foreign_thread

    check_not_in_foreign_thread("sleep")
    run._check_branch()
    key, seq = run.position("|sleep")
    recorded = run.ex.ledger.get(key)
    if recorded is not None:
        due = int(msgspec.json.decode(recorded.result)["due_ms"])
        new: list[StepRecord] = []
    else:
        due = due_of()
        if due - run.ex.server_ms > MAX_SLEEP_MS:
            raise InputError("a timer is due at most ten years ahead")
        record = StepRecord(version=1, key=key, name="|sleep", status="waiting", attempts=0,
                            result=msgspec.Raw(msgspec.json.encode({"due_ms": due})),
                            at_ms=_now_ms(), seq=seq)
        new = [record]
    # The controller wakes a timer only once the server's clock has passed its due time,
    # and this execution started after that wake: fired, and never early.
    if due <= run.ex.server_ms:
        if recorded is not None and recorded.status != "fired":
            # The first execution past it records it fired, whatever woke the run (its
            # timer, a resume after a pause that outlasted it, an answer to a parallel
            # branch): ledger and output then say so once. Written where it fires, not by
            # the wake, which neither knows the timer's entry nor ends every such wait.
            fired_ms = run.ex.server_ms
            run._commit(msgspec.structs.replace(recorded, status="fired", result=msgspec.Raw(
                msgspec.json.encode({"due_ms": due, "fired_ms": fired_ms}))),
                "timer_fired", {"timer": key, "due_ms": due, "late_ms": fired_ms - due})
        return
    raise ParkRun([Wait("timer", wake_at_ms=due, until_ms=due, ledger=new)])


# -- child runs --------------------------------------------------------------------------

class ChildRun:
    """A child run started by `start_child`: its id, and `result()`."""

    def __init__(self, run: RunContext, child_id: str, workflow: str) -> None:
        self._run = run
        self.id = child_id
        self.workflow = workflow

    def __repr__(self) -> str:
        return f"ChildRun({self.id!r}, {self.workflow!r})"

    def result(self) -> Any:
        """The child's result; parks the parent until the child settles. Raises
        ChildFailedError when it failed or was cancelled."""
        return gather(self._run, [self])[0]


def child_id(parent: str, key: str) -> str:
    candidate = f"{parent}.{key}"
    if len(candidate) <= 128:
        return candidate
    import hashlib

    return f"{parent[:100]}.{hashlib.sha1(candidate.encode()).hexdigest()[:20]}"


def start_child(run: RunContext, workflow: str, input: Any = None,
                key: str | None = None) -> ChildRun:
    from .execute import _now_ms, check_not_in_foreign_thread
    from .ops import RunRequest, prepare

    check_not_in_foreign_thread("start_child")
    run._check_branch()
    lkey, seq = run.position("|child")
    recorded = run.ex.ledger.get(lkey)
    if recorded is not None and recorded.status == "succeeded":
        data = msgspec.json.decode(recorded.result)
        return ChildRun(run, data["id"], data["workflow"])
    # (A "running" entry is a note whose child may not have been recorded: again, below.)
    if key is not None and not ID_PATTERN.fullmatch(key):
        raise InvalidIdError(f"invalid child key {key!r}: expected [A-Za-z0-9_.:-]{{1,128}}")
    rel = lkey[len(run.ex.record.name) + 1:] if lkey.startswith(run.ex.record.name + ".") \
        else lkey
    suffix = key if key is not None else _position_id(rel)
    cid = child_id(run.run_id, suffix)
    with run.child_ids_lock:  # a check and a claim as one: parallel branches race here
        used_at = run.child_ids.get(cid, lkey)
        for other in list(run.ex.ledger.values()):
            if other.name == "|child" and other.key != lkey and (
                    msgspec.json.decode(other.result).get("id") == cid):
                used_at = other.key
        if used_at != lkey:
            # A second child under one id would silently be the first one.
            raise MarblesError(f"child id {cid} is already used by this run's child started "
                               f"at {used_at}: give each child its own key")
        run.child_ids[cid] = lkey
    record = prepare(RunRequest(workflow, msgspec.json.encode(input), cid, origin="child"),
                     run.registry)
    record = msgspec.structs.replace(record, parent=run.run_id)
    named = msgspec.Raw(msgspec.json.encode({"id": cid, "workflow": record.name}))
    # The parent's ledger names the child before the child exists, in the parent's own slot:
    # a cancel of the parent that walks its children after this finds this one, and the
    # child, recorded after it, checks its parent when it starts (engine/execute.py). So
    # whichever comes first, the child of a cancelled parent never runs its body; and a
    # cancelled, finished or stale parent records no child at all (note_child refuses).
    run._check(run._store(run.runs.note_child, run.ex, StepRecord(
        version=1, key=lkey, name="|child", status="running", attempts=1, result=named,
        at_ms=_now_ms(), seq=seq)))
    recorded_run = run._store(run.runs.record, record)
    if not recorded_run.created and recorded_run.record.parent != run.run_id:
        raise MarblesError(f"child id {cid} is taken by another run (started by "
                           f"{recorded_run.record.parent or 'no parent'})")
    entry = StepRecord(version=1, key=lkey, name="|child", status="succeeded", attempts=1,
                       result=named, at_ms=_now_ms(), seq=seq)
    committed = run._commit_status(entry, "child_started",
                                   {"child": cid, "workflow": record.name})
    if recorded_run.created:
        _deliver_or_cancel(run, record, committed)
    run._check(committed)
    return ChildRun(run, cid, record.name)


def _deliver_or_cancel(run: RunContext, record: RunRecord, committed: str) -> None:
    """Deliver a child this execution has just recorded, unless its parent can no longer
    take it. The reply of the child's ledger commit says so on the common path (ok, paused:
    this execution still owns the running parent; cancelled: a cancel was asked). Any other
    reply (stale, settled, timed_out) costs a read of the parent: a newer execution may own
    it and adopt the child, or it was cancelled, finished or purged while this execution was
    between its note and its record. A cancel's walk may then have passed before the child
    existed (another slot), and nothing would ever gather it: the child is cancelled before
    any delivery; the note stays, so a later walk finds it too."""
    if committed == "cancelled" or (committed not in ("ok", "paused")
                                    and run.runs.parent_stopped(run.run_id)):
        run.runs.cancel(record.id, f"its parent {run.run_id} stopped before the child was "
                                   f"recorded")
        return
    from .flowctl import delivery_queue

    _deliver(run.deliver, delivery_queue(record), record.id, 1)


def _position_id(rel: str) -> str:
    """An id-safe rendering of a ledger position (step names may hold any character)."""
    import hashlib

    readable = rel.replace("|child#", "c")
    safe = "".join(c if c.isalnum() or c in "_-" else "-" for c in readable)
    if safe != readable:
        # Lossy: two positions could render alike (steps "a.b" and "a-b"), and the second
        # would silently get the first one's child. A digest of the position tells them apart.
        safe = f"{safe[:50]}-{hashlib.sha1(rel.encode()).hexdigest()[:8]}"
    if ID_PATTERN.fullmatch(safe) and len(safe) <= 60:
        return safe
    return "c-" + hashlib.sha1(rel.encode()).hexdigest()[:16]


def gather(run: RunContext, children: list[ChildRun]) -> list[Any]:
    """Every child's result (in order); parks until all have settled."""
    from .authoring import REGISTRY
    from .execute import StepFailedError, _decode_result, check_not_in_foreign_thread

    check_not_in_foreign_thread("a child's result")
    run._check_branch()
    if not children:
        return []
    states = run._store(run.runs.child_states, [c.id for c in children])
    pending = [c.id for c, st in zip(children, states, strict=True) if st[0] not in TERMINAL]
    if pending:
        raise ParkRun([Wait("child", children=pending,
                            wake_at_ms=run.ex.server_now_ms() + CHILD_CHECK_MS)])
    results = []
    for child, (status, result, error) in zip(children, states, strict=True):
        if status != "succeeded":
            info = None if not error else msgspec.json.decode(error, type=ErrorInfo)
            raise ChildFailedError(child.id, status, info)
        definition = (run.registry or REGISTRY).workflows.get(child.workflow)
        result_type = Any
        if definition is not None:
            from typing import get_type_hints

            try:
                result_type = get_type_hints(definition.fn).get("return", Any)
            except Exception:
                result_type = Any
        try:
            results.append(_decode_result(msgspec.Raw(result or b"null"), result_type))
        except msgspec.DecodeError as exc:
            raise StepFailedError(ErrorInfo(type="ChildResultUnreadable",
                                            message=str(exc))) from None
    return results


# -- parallel steps ----------------------------------------------------------------------

def parallel(run: RunContext, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` in threads, each in a frame of its own (stable ledger positions whatever
    order they finish in). The first failure stops the siblings at their next boundary and
    is raised once they have stopped; a branch that parks parks the run once the others are
    done."""
    from .execute import Frame, StopExecution, _branch_cancel, _frames, check_not_in_foreign_thread

    check_not_in_foreign_thread("parallel")
    run._check_branch()
    if not all(callable(c) for c in calls):
        raise InputError("parallel takes zero-argument callables, e.g. lambda: fetch(url)")
    frame = run.frame
    n = frame.counters["|parallel"]
    frame.counters["|parallel"] += 1
    base = f"{frame.path}.|parallel#{n}"
    cancel = threading.Event()
    failed_at: list[tuple[float, int]] = []
    lock = threading.Lock()

    def branch(i: int, call: Callable[[], Any]) -> tuple[str, Any]:
        _frames.set([Frame(f"{base}[{i}]", tag=f"{frame.tag or frame.path}.|parallel#{n}[{i}]")])
        _branch_cancel.set(cancel)
        try:
            return "ok", call()
        except ParkRun as parked:
            return "park", parked
        except BranchCancelled:
            return "cancelled", None
        except BaseException as exc:
            with lock:
                failed_at.append((time.monotonic(), i))
            cancel.set()
            return "error", exc

    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="marbles-par") as pool:
        futures = [pool.submit(contextvars.copy_context().run, branch, i, call)
                   for i, call in enumerate(calls)]
        outcomes = [f.result() for f in futures]
    stops = [v for kind, v in outcomes if kind == "error" and isinstance(v, StopExecution)]
    if stops:
        raise stops[0]
    if failed_at:
        raise outcomes[min(failed_at)[1]][1]
    parks = [v for kind, v in outcomes if kind == "park"]
    if parks:
        merged = ParkRun([w for p in parks for w in p.waits])
        merged.ledger = [r for p in parks for r in p.ledger]
        raise merged
    run._check_branch()
    return [v for _, v in outcomes]

