"""Compensation: undos registered as a run's steps succeed, run in reverse order as recorded
steps when the run fails, or when it is cancelled with compensation.

    charge = mr.step(compensate=refund)(charge)      # each success registers refund(...)
    ctx.compensate(release_stock, order_id)           # or register one after any step

A registration is a ledger entry, written before anything the body does after it: a
`ctx.compensate` call at its own position (name `|undo`), a step's `compensate=` inside the
step's success record (the same write as the success). A replay finds the entry and
registers nothing again.

When the body fails and undos are registered, the executor writes the phase marker
`|compensate` (with the failure) and runs the undos in the frame `|compensate`, the last
registered first, each a recorded step with its own retries: a redelivery finds the marker,
runs no body, replays the undos already recorded and runs the rest. An undo that fails after
its retries is recorded failed and the others still run. Then the run settles: failed with
the body's error, or cancelled when a cancel asked for the compensation (its marker says so:
see lua/cancel_compensate.lua).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import msgspec

from ..store.records import ErrorInfo, StepRecord, ledger_order
from . import context
from .authoring import StepDef
from .compensation_view import is_registration, plan, undo_doc
from .context import Frame, StepFailedError, check_branch, check_not_in_foreign_thread, now_ms
from .execution import Execution
from .undo_refs import (
    DEFAULT_RETRIES,
    FRAME,
    MARKER_KEY,
    UNDO,
    CompensationError,
    name_in_frame,
    undo_ref,
)
from .waiting import NonDeterminismError

__all__ = ["Compensated", "CompensationError", "compensate", "run_body"]


class Compensated(BaseException):
    """The run's compensations ran: it settles `status` (failed | cancelled) with `error`.
    A BaseException, so nothing between the executor and here takes it for a failure."""

    def __init__(self, status: str, error: ErrorInfo | None) -> None:
        super().__init__(status)
        self.status, self.error = status, error


@functools.lru_cache(maxsize=1024)
def _takes_result(fn: Callable[..., Any]) -> bool:
    try:
        return "result" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def undo_document(fn: Any, steps: dict[str, StepDef], args: tuple[Any, ...],
                  kwargs: dict[str, Any], *, with_result: bool) -> bytes:
    """A registration's document; CompensationError for an undo or arguments it refuses
    (not JSON: an undo's arguments are recorded, so that any worker can run it)."""
    from .json_values import changed_by_json

    ref, name = undo_ref(fn, steps)
    passes = with_result and _takes_result(fn.fn if isinstance(fn, StepDef) else fn)
    doc = {"fn": ref, "name": name, "args": args, "kwargs": kwargs, "passes_result": passes}
    try:
        raw = msgspec.json.encode(doc)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise CompensationError(f"undo {name!r}: its arguments are not JSON ({exc}); an "
                                f"undo's arguments are recorded so that any worker can run "
                                f"it") from None
    if changed_by_json([args, kwargs], raw):
        raise CompensationError(f"undo {name!r}: its arguments are not JSON (NaN or an "
                                f"infinity)")
    return raw


def compensate(run: context.Run, fn: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
    """`ctx.compensate(fn, *args, **kwargs)`: register `fn(*args, **kwargs)` as an undo, at
    this call's position (a replay registers nothing again)."""
    check_not_in_foreign_thread("compensate")
    check_branch()
    if run.frame.path.startswith(FRAME):
        raise CompensationError("an undo cannot register undos of its own")
    doc = undo_document(fn, run.registry.steps, args, kwargs, with_result=False)
    key, seq = run.position(UNDO)
    if key in run.ex.ledger:
        return  # registered by an earlier execution
    if run.ex.replay_only:
        from .context import StopExecution

        raise StopExecution("reached_new_work")
    record = StepRecord(version=1, key=key, name=UNDO, status="registered", attempts=0,
                        result=msgspec.Raw(doc), at_ms=now_ms(), seq=seq)
    run.hold_entry(record, "compensation_registered",
                   {"step": key, "undo": str(undo_doc(record)["name"])})
    run.ex.undos.append(key)


def step_undo(definition: StepDef, steps: dict[str, StepDef], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> bytes:
    """The registration a step declared with `compensate=` writes with its success (b"" for
    a step without one). Checked before the step runs: what cannot be undone is not done."""
    if definition.compensate is None:
        return b""
    return undo_document(definition.compensate, steps, args, kwargs, with_result=True)


def with_undo(ex: Execution, key: str, undo: bytes, done: StepRecord) -> StepRecord:
    """A step's success record, carrying its undo's registration when it has one."""
    if not undo:
        return done
    ex.undos.append(key)
    return msgspec.structs.replace(done, undo=msgspec.Raw(undo))


def registrations(ex: Execution) -> list[StepRecord]:
    """The run's registrations in the order they were made: those found in the ledger at
    the start (in commit order), then this execution's own."""
    fresh = list(dict.fromkeys(k for k in ex.undos if k in ex.ledger))
    mine = set(fresh)
    found = sorted((r for r in ex.ledger.values() if is_registration(r) and r.key not in mine),
                   key=ledger_order)
    return found + [r for r in (ex.ledger[k] for k in fresh) if is_registration(r)]


def _failure(exc: BaseException, error_of: Callable[[BaseException], ErrorInfo]) -> ErrorInfo:
    if isinstance(exc, StepFailedError):
        return exc.error
    if isinstance(exc, NonDeterminismError):
        return ErrorInfo(type="NonDeterminism", message=str(exc), step=exc.frame)
    return error_of(exc)


def run_body(run: context.Run, body: Callable[[], Any],
             error_of: Callable[[BaseException], ErrorInfo]) -> Any:
    """The body's output; or, where the run has undos to run, Compensated once they ran:
    after the body failed here, or at once when the ledger says the run is compensating
    (a redelivery during the compensations, a cancel that asked for them)."""
    marker = run.ex.ledger.get(MARKER_KEY)
    if marker is None:
        try:
            return body()
        except (Exception, SystemExit, KeyboardInterrupt, NonDeterminismError) as exc:
            if not registrations(run.ex):
                raise
            error = _failure(exc, error_of)
        marker = StepRecord(version=1, key=MARKER_KEY, name=MARKER_KEY, status="failed",
                            attempts=0, error=error, at_ms=now_ms())
        run.commit_entry(marker, "compensation_started",
                         {"reason": "failed", "undos": len(registrations(run.ex))})
    run_undos(run)
    if marker.status == "cancelled":
        raise Compensated("cancelled", None)
    raise Compensated("failed", marker.error)


def run_undos(run: context.Run) -> None:
    """Run every registered undo not recorded yet, the last registered first, each a
    recorded step in the compensate frame; one that fails is recorded and the rest run."""
    frames = context.thread_frames()
    assert frames is not None, "the executor installs the body's frames"
    frames.append(Frame(FRAME))
    try:
        for record, _key in plan(registrations(run.ex)):
            doc = undo_doc(record)
            definition = _resolve(str(doc["fn"]), run.registry.steps)
            kwargs = dict(doc["kwargs"])
            if doc.get("passes_result"):
                kwargs["result"] = msgspec.json.decode(bytes(record.result))
            try:
                run.step(definition, *doc["args"], **kwargs)
            except StepFailedError:
                continue  # recorded failed; the others still run
    finally:
        frames.pop()


def _resolve(ref: str, steps: dict[str, StepDef]) -> StepDef:
    """The step that runs undo `ref` here. One this worker cannot find runs as a step that
    fails saying so (recorded, like any undo that fails)."""
    name = name_in_frame(ref)
    try:
        if ref.startswith("step:"):
            found = steps.get(name)
            if found is None:
                raise CompensationError(f"undo step {name!r} is not registered on this worker")
            return found
        _, module, qualname = ref.split(":", 2)
        fn = getattr(importlib.import_module(module), qualname)
        return StepDef(name, fn, retries=DEFAULT_RETRIES)
    except (CompensationError, ImportError, AttributeError, ValueError) as exc:
        problem = str(exc) if isinstance(exc, CompensationError) else (
            f"undo {ref!r} cannot be found on this worker: {exc}")

        def missing(*args: Any, **kwargs: Any) -> None:
            raise CompensationError(problem)

        return StepDef(name, missing)
