"""What a step's failure does under its retry policy (engine/retry_policy.py), inside an
execution: retry in the worker (a wait under INLINE_RETRY_S), park the run on a durable timer
until the next try (reason `retry`), pause it for a person (reason `failed_step`, when the
tries ran out and the step says on_exhausted="pause"), or fail.

The ledger entry of the step carries its tries across deliveries: `retrying` (failed try
`attempts`, the next one due at `result.due_ms`), `exhausted` (paused; `result.args` holds the
arguments it was called with, as JSON, for `retry --input-patch`). A retry by request writes
it back `running` with no tries and the patch appended to `patches`: every later replay
applies the same patches to the arguments the body passes (engine/input_patch.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any

import msgspec

from .. import metrics
from ..store.records import ErrorInfo, StepRecord
from .context import StepFailedError
from .execution import Execution
from .input_patch import PatchRefusedError, apply_patches, bound_args
from .retry_policy import NonRetryable, inline_limit_s
from .waiting import ParkRun, Wait

# `run` below is the executing RunContext and `call` its StepCall (engine/execute.py, which
# calls in here: typed Any, as this module sits below it).
RunContext = Any
StepCall = Any


def _error_text(record: StepRecord) -> str:
    error = record.error
    return "" if error is None else f"{error.type}: {error.message}"[:500]


def _retry_wait(call: StepCall, record: StepRecord, due: int, max_attempts: int,
                new: bool) -> Wait:
    return Wait("retry", wake_at_ms=due, until_ms=due, ledger=[record] if new else [],
                detail={"step": call.key, "name": call.definition.name,
                        "attempt": record.attempts, "max_attempts": max_attempts,
                        "next_at_ms": due, "error": _error_text(record)})


def _failed_wait(call: StepCall, record: StepRecord, max_attempts: int, new: bool) -> Wait:
    return Wait("failed_step", ledger=[record] if new else [],
                detail={"step": call.key, "name": call.definition.name,
                        "attempts": record.attempts, "max_attempts": max_attempts,
                        "error": _error_text(record), "patches": list(record.patches)})


def prepare(run: RunContext, call: StepCall, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Before a step's next try: park again if its retry is not due yet (the run was woken
    early: a resume, an answer to a parallel branch) or if it is still paused on its
    exhaustion; else its arguments with the recorded patches applied."""
    recorded = call.recorded
    if recorded is None or call.replayed:
        return args, kwargs
    policy = call.definition.policy(run.workflow_def)
    if recorded.status == "retrying":
        due = int(msgspec.json.decode(recorded.result).get("due_ms") or 0)
        if due > run.ex.server_ms:
            raise ParkRun([_retry_wait(call, recorded, due, policy.max_attempts, new=False)])
    elif recorded.status == "exhausted":
        raise ParkRun([_failed_wait(call, recorded, policy.max_attempts, new=False)])
    if call.patches:
        try:
            return apply_patches(call.definition.fn, args, kwargs, call.patches)
        except PatchRefusedError as exc:
            # A patch checked by a process without the step's code (types unknown there)
            # that does not fit: this try fails at once, and the step pauses again saying so.
            why = str(exc)

            # Wrapped, so that the pause records the step's own arguments (its signature).
            @functools.wraps(call.definition.fn)
            def refuse(*_: Any, **__: Any) -> Any:
                raise NonRetryable(why)

            call.definition = dataclasses.replace(call.definition, fn=refuse)
    return args, kwargs


def failed(run: RunContext, call: StepCall, failure: BaseException, error: ErrorInfo,
           tried: float, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """A try of `call` failed with `failure` (`error` as recorded): the seconds to wait in
    the worker before the next try, or ParkRun (a retry's timer, a pause), or
    StepFailedError (the step failed)."""
    definition, key, attempts = call.definition, call.key, call.attempts
    policy = definition.policy(run.workflow_def)
    again = attempts < policy.max_attempts and policy.retryable(failure)
    metrics.step_tried(run.ex.record.name, "retried" if again else "failed",
                       time.perf_counter() - tried)
    text = f"{error.type}: {error.message}"
    if again:
        delay: float = policy.delay_for(attempts)
        # On a virtual clock (the test kit) every wait is a timer: time moves only there.
        if delay < inline_limit_s() and run.ex.clock is None:
            run.commit_entry(call.record("running", error=error),
                             "step_retry", {"step": key, "attempt": attempts, "error": text,
                                            "retry_in_s": round(delay, 3)})
            return delay
        due = run.ex.server_now_ms() + math.ceil(delay * 1000)
        record = call.record("retrying", error=error,
                             result=msgspec.Raw(msgspec.json.encode({"due_ms": due})))
        metrics.step_retry_parked(run.ex.record.name)
        raise ParkRun([_retry_wait(call, record, due, policy.max_attempts, new=True)])
    if definition.exhausted(run.workflow_def) == "pause":
        record = call.record("exhausted", error=error, result=msgspec.Raw(msgspec.json.encode(
            {"args": bound_args(definition.fn, args, kwargs)})))
        metrics.step_paused(run.ex.record.name)
        raise ParkRun([_failed_wait(call, record, policy.max_attempts, new=True)])
    run.commit_entry(call.record("failed", error=error),
                     "step_failed", {"step": key, "attempt": attempts, "error": text})
    raise StepFailedError(error)


def notice_of(ex: Execution, waits: list[Wait]) -> bytes:
    """The pause notification to queue with this park (MARBLES_NOTIFY_URL set in this
    process, a step paused just now), as JSON; b"" for none."""
    from ..envvars import NOTIFY_URL_ENV

    if not os.environ.get(NOTIFY_URL_ENV):
        return b""
    for w in waits:
        if w.reason == "failed_step" and w.ledger:
            d = w.detail
            return msgspec.json.encode({
                "id": f"{ex.run_id}:{d['step']}:{ex.epoch}", "type": "step_paused",
                "run": ex.run_id, "workflow": ex.record.name, "step": d["step"],
                "attempts": d["attempts"], "error": d["error"], "at_ms": ex.server_now_ms(),
                "retry": f"marbles-rq retry {ex.run_id}", "fail": f"marbles-rq fail {ex.run_id}",
                "tries": 0})
    return b""
