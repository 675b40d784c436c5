"""Acting on a run paused on a failed step (on_exhausted="pause", reason `failed_step`):
`retry` runs the step again now, its tries counted from 1, after an optional input patch
(engine/input_patch.py); `fail` gives up: the step fails with its error and the reason, and
the run goes on as after any failed step (the body gets StepFailedError; unless it catches
it, the run ends failed). Both write the step's ledger entry and wake the run in one script
(lua/resolve_step.lua); the client, the CLI, the HTTP API, the dashboard and the test kit all
come through here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from ..store.records import ErrorInfo, StepRecord
from .authoring import InputError, Registry
from .execution import RunNotFoundError
from .input_patch import check_patch
from .runs import TERMINAL, RunView

MAX_REASON = 500


class NotFailedStepError(InputError):
    """The run is not paused on a failed step (a finished run included): nothing to retry
    or fail. Bad input to the CLI (exit 2); HTTP 409."""

    code = "not_failed_step"


class Resolves(Protocol):
    def resolve_step(self, run_id: str, key: str, expected: StepRecord, entry: StepRecord,
                     action: str, event: dict[str, Any]) -> tuple[str, int, str]: ...


@dataclass(frozen=True)
class Resolution:
    run_id: str
    action: str  # retry | fail
    step: str
    attempt: int  # the delivery it was woken as
    queue: str
    args: dict[str, Any] | None = None  # a retry's arguments after its patch


def paused_step(view: RunView | None, run_id: str, what: str) -> StepRecord:
    """The ledger entry of the step `view`'s run is paused on; else why not, one line."""
    if view is None:
        raise RunNotFoundError(f"no run with id {run_id!r}")
    if view.status in TERMINAL:
        raise NotFailedStepError(f"run {run_id} has already finished ({view.status}); "
                                 f"nothing to {what}")
    key = (view.wait_for or {}).get("step") if view.status == "waiting" else None
    record = next((s for s in view.steps if s.key == key), None)
    if record is None or record.status != "exhausted":
        state = view.status + (f" ({view.wait_reason})" if view.status == "waiting" else "")
        raise NotFailedStepError(f"run {run_id} is not paused on a failed step (it is "
                                 f"{state}); nothing to {what}")
    return record


def retry(waits: Resolves, view: RunView | None, run_id: str, input_patch: Any = None,
          registry: Registry | None = None) -> Resolution:
    """Run the paused step again now, `input_patch` (a JSON object, RFC 7396) applied to its
    arguments first. PatchRefusedError for a patch that does not fit."""
    record = paused_step(view, run_id, "retry")
    patches = list(record.patches)
    args = None
    if input_patch is not None:
        recorded = msgspec.json.decode(record.result) if record.result else None
        definition = registry.steps.get(record.name) if registry is not None else None
        args = check_patch(record.name, (recorded or {}).get("args"), input_patch,
                           definition.fn if definition is not None else None)
        patches.append(input_patch)
    entry = msgspec.structs.replace(record, status="running", attempts=0, error=None,
                                    result=msgspec.Raw(b"null"), patches=patches,
                                    at_ms=int(time.time() * 1000))
    event: dict[str, Any] = {"step": record.key, "attempts": record.attempts}
    if input_patch is not None:
        event |= {"patch": input_patch, "args": args}
    return _resolve(waits, run_id, record, entry, "retry", event, args)


def fail(waits: Resolves, view: RunView | None, run_id: str, reason: str | None = None
         ) -> Resolution:
    """Give the paused step up: it fails with its last error and `reason`."""
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON):
        raise InputError(f"a reason is text of at most {MAX_REASON} characters")
    record = paused_step(view, run_id, "fail")
    last = record.error or ErrorInfo(type="StepFailed", message="", step=record.key)
    given_up = f"given up: {reason}" if reason else "given up by request"
    error = msgspec.structs.replace(last, message=f"{last.message} ({given_up})")
    entry = msgspec.structs.replace(record, status="failed", error=error,
                                    result=msgspec.Raw(b"null"), at_ms=int(time.time() * 1000))
    return _resolve(waits, run_id, record, entry, "fail",
                    {"step": record.key, "reason": reason,
                     "error": f"{error.type}: {error.message}"}, None)


def _resolve(waits: Resolves, run_id: str, record: StepRecord, entry: StepRecord, action: str,
             event: dict[str, Any], args: dict[str, Any] | None) -> Resolution:
    status, attempt, queue = waits.resolve_step(run_id, record.key, record, entry, action, event)
    if status == "woken":
        return Resolution(run_id, action, record.key, attempt, queue, args)
    if status == "missing":
        raise RunNotFoundError(f"no run with id {run_id!r}")
    if status == "settled":
        raise NotFailedStepError(f"run {run_id} has already finished; nothing to {action}")
    raise NotFailedStepError(f"run {run_id} is no longer paused on step {record.key} (another "
                             f"retry or fail came first); nothing to {action}")


class Lists(Protocol):
    def failed_steps(self, limit: int = 100) -> list[str]: ...


def feed_entries(waits: Lists, views: Any, limit: int = 100) -> list[dict[str, Any]]:
    """The runs paused on a failed step, oldest first, as the feed lists them: {run,
    workflow, step, attempts, max_attempts, error, since_ms}. `views(ids)`: their RunViews."""
    out = []
    for view in views(waits.failed_steps(limit)):
        what = view.wait_for or {}
        if view.status != "waiting" or not what.get("step") or "attempts" not in what:
            continue  # resolved, or cancelled, since the feed listed it
        out.append({"run": view.record.id, "workflow": view.record.name,
                    "step": what["step"], "attempts": what.get("attempts"),
                    "max_attempts": what.get("max_attempts"), "error": what.get("error"),
                    "since_ms": view.wait_since_ms})
    return out
