"""The client's own errors. Every refusal the client passes on is a MarblesError subclass
with a stable `code` (the same word the HTTP API answers with) and the message the CLI
prints: InputError (invalid input, ids, payloads), UnknownWorkflowError, RunNotFoundError,
AlreadyAnsweredError, ... These are the ones only waiting for a run raises."""

from __future__ import annotations

from typing import Any

from ..errors import MarblesError


class RunFailedError(MarblesError):
    """`result()` of a run that failed: `error` holds its error (type, message, step)."""

    code = "run_failed"

    def __init__(self, run_id: str, error: dict[str, Any] | None) -> None:
        self.run_id = run_id
        self.error = error or {}
        super().__init__(f"run {run_id} failed: {self.error.get('type', '?')}: "
                         f"{self.error.get('message', '')}")


class RunCancelledError(MarblesError):
    """`result()` of a run that was cancelled."""

    code = "run_cancelled"

    def __init__(self, run_id: str, reason: str | None = None) -> None:
        self.run_id, self.reason = run_id, reason
        super().__init__(f"run {run_id} was cancelled" + (f": {reason}" if reason else ""))


class ResultTimeoutError(MarblesError, TimeoutError):
    """`result(timeout=...)` passed its timeout before the run finished."""

    code = "timeout"
