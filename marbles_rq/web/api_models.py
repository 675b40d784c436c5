"""The bodies the HTTP API reads and writes (web/routes_api.py), as msgspec Structs.

The handlers decode requests into these and encode replies from them (and from the client's
own views: RunStatus, RunsPage, Outcome, QuestionInfo, OutputEntry), and the OpenAPI
document (web/openapi.py) is generated from the same classes, so the two cannot drift.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..client.views import QuestionInfo, RunError


class StartBody(msgspec.Struct, forbid_unknown_fields=True):
    """Start a run of `workflow`. `input` is any JSON value, checked against the workflow's
    input type; absent (or null), the workflow's default input. With `id` the start is
    idempotent: the same id again answers the existing run with `created` false."""

    workflow: str
    input: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    id: str | None = None
    queue: str | None = None
    priority: int | None = None
    # Signal-with-start: the run (`id` required) is created if the id is new and gets this
    # signal in the same script call; an existing run just gets the signal.
    signal: StartSignal | None = None


class StartSignal(msgspec.Struct, forbid_unknown_fields=True):
    """The signal of a signal-with-start: its name and JSON payload (absent: null)."""

    name: str
    payload: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class SignalBody(msgspec.Struct, forbid_unknown_fields=True):
    """A signal's JSON payload (absent, or an empty body: null). `request_id`: the sender's
    id for this send; the same id again within a minute (a retry) records nothing twice."""

    payload: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    request_id: str | None = None


class SignalSent(msgspec.Struct, frozen=True):
    """A recorded signal: its number among the run's signals of that name, whether it woke
    the run (parked waiting for it) and whether that delivery is enqueued."""

    id: str
    name: str
    seq: int
    woken: bool
    dispatched: bool


class StartBatchBody(msgspec.Struct, forbid_unknown_fields=True):
    """Start many runs: all are validated first, so one bad request starts none."""

    runs: list[StartBody]


class Started(msgspec.Struct, frozen=True):
    """A start's answer. `created` false: a run with this id existed; nothing was started
    and the rest describes that run. `status` is the run's status at the start."""

    id: str
    created: bool
    workflow: str | None = None
    queue: str | None = None
    status: str | None = None
    # A workflow with a debounce, throttle or singleton: what this start did (outcome:
    # started | merged | dropped | skipped | cancelled_running; flow/gate_specs.py).
    decision: dict[str, Any] | None = None


class StartedBatch(msgspec.Struct, frozen=True):
    runs: list[Started]  # in request order


class RunResult(msgspec.Struct, frozen=True):
    """A finished run: `status` succeeded (with `result`), failed (with `error`: the
    exception's type, message and step) or cancelled (with `reason`)."""

    id: str
    status: str
    result: Any = None
    error: RunError | None = None
    reason: str | None = None


class State(msgspec.Struct, frozen=True):
    """A value the run published (`ctx.publish`): the last one under `key`."""

    id: str
    key: str
    value: Any = None


class AnswerBody(msgspec.Struct, forbid_unknown_fields=True):
    """An answer to a question: one of its choices (or the choice's number as text)."""

    value: Any


class NoteBody(msgspec.Struct, forbid_unknown_fields=True):
    """An approval or a rejection, with an optional note the run receives."""

    note: str | None = None


class RetryBody(msgspec.Struct, forbid_unknown_fields=True):
    """A retry of the failed step a run is paused on; `input_patch` (an RFC 7396 merge
    patch over the step's arguments by name) changes its input first."""

    input_patch: dict[str, Any] | None = None


class FailBody(msgspec.Struct, forbid_unknown_fields=True):
    """Giving up the failed step a run is paused on, with an optional reason."""

    reason: str | None = None


class EventBody(msgspec.Struct, forbid_unknown_fields=True):
    """An inbound event, as `marbles-rq events send`: the same (source, id) again is
    recorded once."""

    source: str
    id: str
    type: str | None = None
    payload: Any = None


class EventSent(msgspec.Struct, frozen=True):
    """`created` false: this (source, id) was received before; nothing new was recorded.
    `workflow` and `run` name the run its trigger started, when one matched."""

    event: str
    created: bool
    state: str
    workflow: str | None = None
    run: str | None = None


class OpenBatchInfo(msgspec.Struct, frozen=True):
    """An open batch of events: its id (its run's, once sealed), the trigger and key value
    it collects for, how many events it holds, when it opened and when it seals by time."""

    batch: str
    trigger: str
    workflow: str
    key: str
    size: int
    opened_at: str
    seals_at: str


class OpenBatches(msgspec.Struct, frozen=True):
    """Open event batches, oldest first."""

    batches: list[OpenBatchInfo]
class RateLimit(msgspec.Struct, frozen=True):
    """A rate limit: the rate in force (set at run time, else the source's), its burst, the
    runs it holds and its last admission (epoch ms, null: none yet)."""

    name: str
    family: str
    rate: str
    burst: int
    source: str
    overridden: bool
    held: int
    admissions: int
    last_admission_ms: int | None = None


class RateLimits(msgspec.Struct, frozen=True):
    """Every rate limit declared or taken."""

    limits: list[RateLimit]


class RateLimitBody(msgspec.Struct, forbid_unknown_fields=True):
    """A rate to set at run time: N/s, N/min, N/h or N/<count><unit> (5/10s); burst >= 1."""

    rate: str
    burst: int | None = None


class Feed(msgspec.Struct, frozen=True):
    """Open questions and approvals across runs, oldest first."""

    questions: list[QuestionInfo]


class ErrorDetail(msgspec.Struct, frozen=True):
    code: str  # a stable word (web/api_errors.py lists them with their HTTP status)
    message: str  # one line, the one the CLI prints for the same refusal


class ErrorBody(msgspec.Struct, frozen=True):
    """Every refusal of the API: one JSON object."""

    error: ErrorDetail


class BulkFilter(msgspec.Struct, forbid_unknown_fields=True):
    """Which runs a bulk operation acts on: every given criterion must hold (at least one).
    `since`/`until`: epoch seconds of the runs' creation; `tags`: "key=value" texts;
    `question`: the key of a question or approval the run has open."""

    status: str | None = None
    workflow: str | None = None
    queue: str | None = None
    since: float | None = None
    until: float | None = None
    tags: list[str] = msgspec.field(default_factory=list)
    question: str | None = None


class BulkBody(msgspec.Struct, forbid_unknown_fields=True):
    """A bulk operation: `action` (cancel, pause, resume, rerun, approve, reject) on the
    runs `filter` selects, or on `ids` (one of the two). approve/reject: `key` (default: the
    filter's question) and `note`; rerun: `from_step`. `dry_run`: count and sample only."""

    action: str
    filter: BulkFilter | None = None
    ids: list[str] | None = None
    key: str | None = None
    note: str | None = None
    from_step: str | None = None
    dry_run: bool = False


class BulkDone(msgspec.Struct, frozen=True):
    """What a bulk operation did: `matched` runs looked at, `done` acted on, `skipped` per
    reason (nothing to do: already cancelled, not paused ...), `failed` per error code with
    the first messages in `failures`. A dry run: `matched` and `sample` only."""

    action: str
    matched: int
    done: int = 0
    skipped: dict[str, int] = msgspec.field(default_factory=dict)
    failed: dict[str, int] = msgspec.field(default_factory=dict)
    failures: list[BulkFailureItem] = msgspec.field(default_factory=list)
    dry_run: bool = False
    sample: list[str] = msgspec.field(default_factory=list)


class BulkFailureItem(msgspec.Struct, frozen=True):
    run_id: str
    message: str


class LockHolder(msgspec.Struct, frozen=True):
    """A lock (`mr.lock`): its holder (null: free; the run id, the holding execution's epoch,
    since when and until when its lease lasts without a renewal, epoch ms) and the runs
    waiting for it, in order of arrival."""

    name: str
    waiters: list[str]
    holder: str | None = None
    epoch: int | None = None
    since_ms: int | None = None
    until_ms: int | None = None


class Locks(msgspec.Struct, frozen=True):
    """Every lock a run took or waited for."""

    locks: list[LockHolder]
# -- artifacts (marbles_rq/artifacts) ---------------------------------------------------------

class ArtifactSummary(msgspec.Struct, frozen=True):
    """An artifact: its latest version (0: none), how many versions it keeps, its declared
    media type, when it was first known and last written (epoch ms), the latest's size."""

    name: str
    latest: int
    versions: int
    media_type: str
    created_ms: int
    size: int
    updated_ms: int | None = None


class Artifacts(msgspec.Struct, frozen=True):
    """Every artifact declared or written, by name."""

    artifacts: list[ArtifactSummary]


class ArtifactVersionInfo(msgspec.Struct, frozen=True):
    """One version: its number, size and sha256 of its content, media type, meta (JSON),
    the run and step that wrote it (null: from outside a run), when (ISO 8601 UTC)."""

    name: str
    version: int
    size: int
    sha256: str
    media_type: str
    created_at: str
    meta: Any = None
    run: str | None = None
    step: str | None = None


class ArtifactDetail(msgspec.Struct, frozen=True):
    """An artifact and every version it keeps, oldest first."""

    name: str
    latest: int
    media_type: str
    versions: list[ArtifactVersionInfo]


class ArtifactRemoved(msgspec.Struct, frozen=True):
    """The versions a delete removed."""

    name: str
    removed: list[int]
