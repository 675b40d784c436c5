"""What a run body uses to fan out: child runs (started under stable ids, their results
gathered by parking until they settle) and parallel steps.

    child = mr.start_child("resize", {"id": 7}); child.result()
    a, b = mr.parallel(lambda: fetch("a"), lambda: fetch("b"))
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from ..errors import InvalidIdError, MarblesError, RedisUnavailableError
from ..store.ids import ID_PATTERN
from ..store.records import ErrorInfo, RunRecord, StepRecord
from ..store.redis_errors import one_line
from .authoring import InputError
from .context import (
    BranchCancelled,
    Frame,
    Run,
    StepFailedError,
    StopExecution,
    awaitable_here,
    check_branch,
    check_not_in_foreign_thread,
    decode_result,
    enter_branch,
    now_ms,
)
from .waiting import ParkRun, Wait, deliver_now

if TYPE_CHECKING:
    from .runs import RunStore

log = logging.getLogger("marbles_rq.engine.fanout")

CHILD_CHECK_MS = 2_000  # the controller first checks a waited-for child after this long
TERMINAL = ("succeeded", "failed", "cancelled")


class ChildFailedError(MarblesError):
    """A child run the parent waited for failed or was cancelled."""

    code = "child_failed"

    def __init__(self, child_id: str, status: str, error: ErrorInfo | None) -> None:
        what = f"{error.type}: {error.message}" if error is not None else status
        super().__init__(f"child run {child_id} {status}: {what}")
        self.child_id, self.status, self.error = child_id, status, error


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
        deliver_now(deliver, queue, parent, attempt)


# -- child runs --------------------------------------------------------------------------

class ChildRun:
    """A child run started by `start_child`: its id, and `result()`."""

    def __init__(self, run: Run, child_id: str, workflow: str) -> None:
        self._run = run
        self.id = child_id
        self.workflow = workflow

    def __repr__(self) -> str:
        return f"ChildRun({self.id!r}, {self.workflow!r})"

    def result(self) -> Any:
        """The child's result; parks the parent until the child settles. Raises
        ChildFailedError when it failed or was cancelled. Awaited in an async body."""
        return awaitable_here(gather(self._run, [self])[0])


def child_id(parent: str, key: str) -> str:
    candidate = f"{parent}.{key}"
    if len(candidate) <= 128:
        return candidate
    import hashlib

    return f"{parent[:100]}.{hashlib.sha1(candidate.encode()).hexdigest()[:20]}"


def start_child(run: Run, workflow: str, input: Any = None,
                key: str | None = None) -> ChildRun:
    check_not_in_foreign_thread("start_child")
    check_branch()
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
    record = run.prepare_child(workflow, msgspec.json.encode(input), cid)
    record = msgspec.structs.replace(record, parent=run.run_id)
    named = msgspec.Raw(msgspec.json.encode({"id": cid, "workflow": record.name}))
    # The parent's ledger names the child before the child exists, in the parent's own slot:
    # a cancel of the parent that walks its children after this finds this one, and the
    # child, recorded after it, checks its parent when it starts (engine/execute.py). So
    # whichever comes first, the child of a cancelled parent never runs its body; and a
    # cancelled, finished or stale parent records no child at all (note_child refuses).
    run.check_reply(run.call_store(run.runs.note_child, run.ex, StepRecord(
        version=1, key=lkey, name="|child", status="running", attempts=1, result=named,
        at_ms=now_ms(), seq=seq)))
    recorded_run = run.call_store(run.runs.record, record)
    if not recorded_run.created and recorded_run.record.parent != run.run_id:
        raise MarblesError(f"child id {cid} is taken by another run (started by "
                           f"{recorded_run.record.parent or 'no parent'})")
    entry = StepRecord(version=1, key=lkey, name="|child", status="succeeded", attempts=1,
                       result=named, at_ms=now_ms(), seq=seq)
    committed = run.commit_entry_reply(entry, "child_started",
                                   {"child": cid, "workflow": record.name})
    if recorded_run.created:
        _deliver_or_cancel(run, record, committed)
    run.check_reply(committed)
    return ChildRun(run, cid, record.name)


def _deliver_or_cancel(run: Run, record: RunRecord, committed: str) -> None:
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
    from ..flow.limit_specs import delivery_queue

    deliver_now(run.deliver, delivery_queue(record), record.id, 1)


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


def gather(run: Run, children: list[ChildRun]) -> list[Any]:
    """Every child's result (in order); parks until all have settled."""
    from .authoring import REGISTRY

    check_not_in_foreign_thread("a child's result")
    check_branch()
    if not children:
        return []
    states = run.call_store(run.runs.child_states, [c.id for c in children])
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
            results.append(decode_result(msgspec.Raw(result or b"null"), result_type))
        except msgspec.DecodeError as exc:
            raise StepFailedError(ErrorInfo(type="ChildResultUnreadable",
                                            message=str(exc))) from None
    return results


# -- parallel steps ----------------------------------------------------------------------

def open_parallel(run: Run, calls: list[Callable[[], Any]]) -> tuple[Frame, int, str]:
    """The checks and the position of a `parallel` call (sync or async: engine/async_run):
    its frame, its number there, and its branches' base path."""
    check_not_in_foreign_thread("parallel")
    check_branch()
    if not all(callable(c) for c in calls):
        raise InputError("parallel takes zero-argument callables, e.g. lambda: fetch(url)")
    frame = run.frame
    n = frame.counters["|parallel"]
    frame.counters["|parallel"] += 1
    return frame, n, f"{frame.path}.|parallel#{n}"


def parallel(run: Run, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` in threads, each in a frame of its own (stable ledger positions whatever
    order they finish in). The first failure stops the siblings at their next boundary and
    is raised once they have stopped; a branch that parks parks the run once the others are
    done."""
    frame, n, base = open_parallel(run, calls)
    cancel = threading.Event()
    failed_at: list[tuple[float, int]] = []
    lock = threading.Lock()

    def branch(i: int, call: Callable[[], Any]) -> tuple[str, Any]:
        enter_branch(Frame(f"{base}[{i}]", tag=f"{frame.tag or frame.path}.|parallel#{n}[{i}]"),
                     cancel)
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
    return branches_outcome(outcomes, failed_at)


def branches_outcome(outcomes: list[tuple[str, Any]],
                     failed_at: list[tuple[float, int]]) -> list[Any]:
    """What parallel branches that all ended come to (sync or async: engine/async_run.py):
    a stop first, then the first failure, then one park for everything they wait for;
    else their results in order."""
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
    check_branch()
    return [v for _, v in outcomes]

