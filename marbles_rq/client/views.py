"""What the client returns: a run's status (the data of `marbles-rq status --json`), a page
of runs, and the outcome of each write (with the line the CLI prints for it).

Each is a msgspec Struct, so it is typed, documented here, and turns into the same JSON the
CLI and the HTTP API print (`msgspec.json.encode(status)`)."""

from __future__ import annotations

from typing import Any

import msgspec


class Concurrency(msgspec.Struct, frozen=True):
    limit: int
    key: str | None = None  # the limit's key ("customer=acme"); None: workflow-wide


class Waiting(msgspec.Struct, frozen=True):
    """Why a waiting run waits: reason question | timer | child | paused | ..., and what for
    (question keys, child ids, until_ms)."""

    reason: str | None
    for_: dict[str, Any] = msgspec.field(name="for", default_factory=dict)
    since: str | None = None


class RunError(msgspec.Struct, frozen=True):
    """A failed run's error: the exception's type and message, the step it came from."""

    type: str
    message: str
    step: str = ""
    traceback: str = ""


class StepInfo(msgspec.Struct, frozen=True):
    path: str
    position: int
    name: str
    attempts: int
    status: str  # running | succeeded | failed | parked | interrupted


class TimerInfo(msgspec.Struct, frozen=True):
    path: str
    position: int
    due_at: str | None
    fired_at: str | None = None


class PatchInfo(msgspec.Struct, frozen=True):
    """A patch decision the run recorded (`mr.patched`): `new` True for the new branch."""

    id: str
    path: str
    new: bool


class CompensationInfo(msgspec.Struct, frozen=True):
    """A registered undo, in the order undos run (the last registered first): its name,
    reference, the ledger entry that registered it, status (pending | running | done |
    failed | not_run: the run finished without running it), attempts, when it finished,
    and its error when it failed."""

    name: str
    undo: str
    registered_by: str
    status: str
    attempts: int = 0
    at: str | None = None
    error: str | None = None


class BatchInfo(msgspec.Struct, frozen=True):
    """The batch of events a batch run was started with (`@mr.on_event(batch=...)`): its id
    (the run's), trigger, key value, how many events, what sealed it (size | bytes | time),
    when it opened and sealed (ISO 8601), and its state."""

    batch: str
    trigger: str
    key: str
    events: int
    sealed_by: str
    opened_at: str
    sealed_at: str
    state: str


class QuestionInfo(msgspec.Struct, frozen=True):
    """A question or approval a run asked (also an entry of the feed)."""

    run: str
    key: str
    kind: str  # question | approval
    title: str
    state: str  # open | answered | timed_out | cancelled
    body: str | None = None
    choices: list[str] | None = None
    step: str = ""
    asked_ms: int = 0
    age_s: float = 0.0
    answer: Any = None
    answered_ms: int | None = None
    timeout_at_ms: int | None = None


class ReportInfo(msgspec.Struct, frozen=True):
    run: str
    key: str
    kind: str  # milestone | result | artifact
    entry: Any
    step: str = ""
    at_ms: int = 0


class SignalCounts(msgspec.Struct, frozen=True):
    """A run's signals of one name: sent to it, taken by its body, waiting to be taken."""

    sent: int
    taken: int
    buffered: int


class RunStatus(msgspec.Struct, frozen=True):
    """One run as `marbles-rq status --json` shows it. Times are ISO 8601 UTC text;
    `attempt` is 1 + redeliveries, `delivery` counts every delivery (wakes too),
    `resumptions` the wakes after a wait."""

    id: str
    name: str
    queue: str
    status: str  # queued | running | waiting | succeeded | failed | cancelled
    attempt: int
    # The workflow version it started on (`@mr.workflow(version=...)` or a fingerprint of
    # the code); "" for a run recorded before runs carried one.
    version: str = ""
    lane: int = 0
    priority: int = 0
    concurrency: Concurrency | None = None
    resumptions: int = 0
    delivery: int = 0
    start_at: str | None = None  # asked to start no earlier than this
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    input: Any = None
    result: Any = None
    error: RunError | None = None
    worker: str | None = None
    cancel_requested: bool = False
    note: str | None = None
    waiting: Waiting | None = None
    pause_requested: bool = False
    parent: str | None = None
    rerun_of: str | None = None
    rerun_from_step: str | None = None
    children: list[dict[str, Any]] = msgspec.field(default_factory=list)
    timers: list[TimerInfo] = msgspec.field(default_factory=list)
    patches: list[PatchInfo] = msgspec.field(default_factory=list)
    steps: list[StepInfo] = msgspec.field(default_factory=list)
    questions: list[QuestionInfo] = msgspec.field(default_factory=list)
    reports: list[ReportInfo] = msgspec.field(default_factory=list)
    # The artifact versions the run wrote: {"name", "version", "size", "media_type", "step"}.
    artifacts: list[dict[str, Any]] = msgspec.field(default_factory=list)
    published: dict[str, Any] = msgspec.field(default_factory=dict)  # ctx.publish's values
    signals: dict[str, SignalCounts] = msgspec.field(default_factory=dict)  # per name
    # The trace its spans belong to when workers trace (docs/operate/tracing.md): the
    # enqueuer's, or one derived from the run id. 32 hex digits.
    trace_id: str | None = None
    tags: dict[str, str] = msgspec.field(default_factory=dict)  # search tags (ctx.tag)
    # "compensating" while its compensations run (status stays running or queued); None
    # otherwise. The registered undos, in the order they run (docs/how-to/compensation.md).
    phase: str | None = None
    compensations: list[CompensationInfo] = msgspec.field(default_factory=list)
    batch: BatchInfo | None = None  # set for a run a batch of events started

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed", "cancelled")


class RunSummary(msgspec.Struct, frozen=True):
    """A row of `Client.runs()` (read without the ledger)."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int
    created_ms: int
    started_ms: int | None = None
    finished_ms: int | None = None
    parent: str = ""
    resumptions: int = 0
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    version: str = ""  # the workflow version it started on ("": recorded before versions)
    # A waiting run's wait, {"reason", "for"} as in `status --json` (a retry's next try and
    # count, a failed step's tries); None when it is not waiting.
    waiting: dict[str, Any] | None = None


class RunsPage(msgspec.Struct, frozen=True):
    """A page of runs, newest first. Pass `cursor` back for the next page (None: no more);
    `complete` is False when a filtered page stopped at its scan budget before filling."""

    runs: list[RunSummary]
    cursor: str | None
    complete: bool = True


class Outcome(msgspec.Struct, frozen=True):
    """What a write did: `outcome` is a stable word (cancelled, requested, settled, paused,
    already, resumed, woken, answered ...), `message` the line the CLI prints."""

    run_id: str
    outcome: str
    message: str
    children: list[str] = msgspec.field(default_factory=list)  # cancel: children cancelled


class OutputEntry(msgspec.Struct, frozen=True):
    """One entry of a run's output: id (the stream id, a cursor), type (started,
    step_started, step_succeeded, ..., final), the delivery that wrote it, when, and data."""

    id: str
    type: str
    delivery: int
    at_ms: int
    data: Any


class BulkFailure(msgspec.Struct, frozen=True):
    run_id: str
    message: str


class BulkSummary(msgspec.Struct):
    """What a bulk operation did (`Client.cancel_many` ..., `marbles-rq cancel --status
    ...`): `done` runs acted on, `skipped` per reason (already cancelled, already finished,
    not paused, already answered ...: nothing to do, not an error), `failed` per reason,
    with the first messages in `failures`. `stopped` is True when it was interrupted
    between batches: the same operation again does the rest (what was done is skipped)."""

    action: str
    matched: int = 0
    done: int = 0
    skipped: dict[str, int] = msgspec.field(default_factory=dict)
    failed: dict[str, int] = msgspec.field(default_factory=dict)
    failures: list[BulkFailure] = msgspec.field(default_factory=list)
    stopped: bool = False

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def n_failed(self) -> int:
        return sum(self.failed.values())

    def line(self) -> str:
        """The summary line the CLI prints."""
        def by_reason(counts: dict[str, int]) -> str:
            return "" if not counts else " (" + ", ".join(
                f"{reason}: {n}" for reason, n in sorted(counts.items())) + ")"

        return (f"{self.action}: done {self.done}, skipped {self.n_skipped}"
                f"{by_reason(self.skipped)}, failed {self.n_failed}{by_reason(self.failed)}")
