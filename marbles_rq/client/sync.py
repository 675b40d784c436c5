"""The Python client: start runs, wait for their results, and act on them.

    import marbles_rq as mr

    client = mr.connect()                         # the CLI's settings and variables
    run = client.start("report", {"month": "2026-11"}, id="report-2026-11")
    print(run.result(timeout=60))

Every write goes through the same engine call as the CLI command of the same name (the CLI
and the dashboard call this client), so the three never disagree; each refusal is a typed
MarblesError with the CLI's message.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
import redis

from ..deployment import Settings
from ..engine import catalog
from ..engine.authoring import (
    REGISTRY,
    InputError,
    Registry,
    UnknownWorkflowError,
    WorkflowDef,
)
from ..engine.execution import RunNotFoundError
from ..engine.json_values import changed_by_json
from ..engine.paging import Cursor, Filters, RunPager
from ..engine.published import published
from ..engine.runs import STATUSES, OutputEvent, RunStore, RunView
from ..engine.selection import RunFilter, Selection
from ..engine.signals import signals_json
from ..engine.undo_refs import FRAME
from ..engine.waits import Answered, WaitStore
from ..errors import ConfigError, InvalidIdError, MarblesError, RunSettledError
from ..payloads.fields import open_event
from ..store.connection import CLUSTER_SCHEMES, check_url, redact
from ..store.ids import check_id
from ..store.records import RunRecord
from ..store.redis_errors import one_line
from ..store.replies import as_text
from .errors import ResultTimeoutError, RunCancelledError, RunFailedError
from .outage import typed_outages
from .views import (
    BulkSummary,
    Outcome,
    OutputEntry,
    QuestionInfo,
    ReportInfo,
    RunsPage,
    RunStatus,
    RunSummary,
)

if TYPE_CHECKING:
    from ..artifacts.handle import ClientArtifact
    from ..artifacts.records import ArtifactInfo
    from ..engine.history import History
    from ..engine.ops import Enqueued, RunRequest
    from ..engine.rerun import Rerun
    from ..engine.signals import SignalSent, SignalStarted
    from ..flow.gate_specs import Decision
    from ..flow.lock_store import LockInfo
    from ..flow.rate_store import RateLimitInfo
    from ..sessions import Message, Session, SessionInfo, SessionListing
    from ..transport.lanes import Lanes
    from ..triggers.events import Sent

T = TypeVar("T")
StartAt = dt.datetime | float | None

# A blocking read is cut in slices so a timeout is honoured without a socket timeout: the
# connection's own timeout (3 s by default) must stay above one slice.
BLOCK_SLICE_MS = 1000


@dataclass(frozen=True)
class StartRequest:
    """One run of `Client.start_many`: as `Client.start`'s arguments."""

    workflow: str | WorkflowDef
    input: Any = None
    id: str | None = None
    queue: str | None = None
    priority: int | None = None
    input_json: bytes | str | None = None
    start_at: StartAt = None


def start_ms(start_at: StartAt) -> int:
    """`start_at` as epoch ms (0: at once)."""
    if start_at is None:
        return 0
    if isinstance(start_at, dt.datetime):
        if start_at.tzinfo is None:
            raise InputError("start_at must be a timezone-aware datetime (e.g. "
                             "datetime.now(timezone.utc) + timedelta(hours=1))")
        return int(start_at.timestamp() * 1000)
    if isinstance(start_at, bool) or not isinstance(start_at, int | float):
        raise InputError(f"start_at must be a datetime or epoch seconds, not "
                         f"{type(start_at).__name__}")
    if not math.isfinite(start_at):
        raise InputError(f"start_at must be a finite number of epoch seconds, not {start_at}")
    return int(start_at * 1000)


def wait_seconds(timeout: Any, name: str = "timeout") -> float | None:
    """A caller's timeout checked: None or infinity waits without end; NaN, text and the
    like are refused before anything waits."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(
            timeout):
        raise InputError(f"{name} must be a number of seconds or None, not {timeout!r}")
    return None if math.isinf(timeout) and timeout > 0 else float(timeout)


def epoch_ms(seconds: Any, name: str) -> int | None:
    """`since`/`until` of a runs page as epoch ms."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(
            seconds):
        raise InputError(f"{name} must be finite epoch seconds, not {seconds!r}")
    return int(seconds * 1000)


_ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")
_RELATIVE = re.compile(r"\+(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_start_at(text: str, now: float | None = None) -> float:
    """The CLI's --start-at: ISO 8601 with a zone (2026-12-24T18:00:00Z, ...+01:00) or
    "+N" s|m|h|d from now; epoch seconds."""
    if (m := _RELATIVE.fullmatch(text.strip())) is not None:
        return (time.time() if now is None else now) + float(m[1]) * _UNIT_S[m[2]]
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InputError(f"invalid start time {text!r}: give ISO 8601 with a zone "
                         f"(2026-12-24T18:00:00Z) or +N s|m|h|d (+90s, +2h)") from None
    if when.tzinfo is None:
        raise InputError(f"start time {text!r} has no zone: add Z or an offset (+01:00)")
    return when.timestamp()


def workflow_name(workflow: str | WorkflowDef) -> str:
    if isinstance(workflow, WorkflowDef):
        return workflow.name
    if not isinstance(workflow, str):
        raise InputError(f"a workflow is its name or its decorated function, not "
                         f"{type(workflow).__name__}")
    return workflow


def connect(redis_url: str | None = None, prefix: str | None = None, *,
            buckets: int | None = None, lanes: int | None = None, source: str | None = None,
            rq_url: str | None = None) -> Client:
    """A client of the deployment at `redis_url` (else MARBLES_REDIS_URL, else the local
    default) with key prefix `prefix` (else MARBLES_PREFIX, else "mrq"): the settings and
    environment variables of the CLI. `source` (else MARBLES_SOURCE) imports workflow
    definitions so inputs are validated here; without it, a workflow is known by name from
    what its workers declared. Nothing touches the network until the first call."""
    settings = Settings.from_env(redis_url, prefix, buckets=buckets, lanes=lanes,
                                 source=source, rq_url=rq_url)
    # A malformed URL is refused here, as documented, not at the first call.
    for url in (settings.redis_url, settings.rq_url):
        if url is not None:
            _check_url(url)
    return Client(settings)


def _check_url(url: str) -> None:
    """What opening the connection would refuse as ConfigError, without opening it."""
    parts = check_url(url)
    if parts.scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: scheme must be redis://, "
                          f"rediss://, unix:// or redis+cluster://")
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: no host")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _not_before_window(method: _Method) -> _Method:
    """A run id that names no recorded run may be an open debounce window's run (which
    `status` shows): say so (DebouncingError) rather than that no such run exists."""
    import functools

    @functools.wraps(method)
    def acting(self: Client, run_id: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, run_id, *args, **kwargs)
        except RunNotFoundError:
            from ..flow.debounce import refuse_window

            refuse_window(self.reader, run_id, method.__name__)
            raise

    return acting  # type: ignore[return-value]


@typed_outages(lambda self: self.settings.redis_url)
class Client:
    """A deployment, as an application uses it. Thread-safe: redis-py pools connections."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    # -- what it opens ----------------------------------------------------------------------

    @property
    def runs_store(self) -> RunStore:
        return self.settings.runs()

    @property
    def reader(self) -> RunStore:
        """The store for reads: it never records the deployment's meta (a status of a
        deployment not created yet writes nothing) and runs no script."""
        return self.settings.runs(read_only=True)

    @property
    def lanes(self) -> Lanes:
        return self.settings.rq()

    def _waits(self) -> WaitStore:
        return WaitStore(self.runs_store)

    def close(self) -> None:
        """Close the connections (the client opens them again if used after)."""
        for opened in (self.settings._store, self.settings._reader):
            if opened is not None:
                opened.client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- starting runs ----------------------------------------------------------------------

    def _registry_for(self, name: str) -> Registry:
        """The definitions to validate with: the workflow's own when this process imported
        it, else the defaults its workers declared (its input is then sent as JSON)."""
        if name in REGISTRY.workflows:
            return REGISTRY
        reader = self.reader
        try:
            found = catalog.lookup(reader.client, reader.keys, name)
        except UnknownWorkflowError:
            if REGISTRY.workflows:  # workflows were imported: name them, as the CLI does
                REGISTRY.workflow(name)
            raise
        return Registry(workflows={name: found})

    def prepare(self, workflow: str | WorkflowDef, input: Any = None, *,
                id: str | None = None, queue: str | None = None, priority: int | None = None,
                input_json: bytes | str | None = None, start_at: StartAt = None,
                how: str = "give an input") -> RunRecord:
        """Validate a start completely (input, id, queue, priority) and return the record it
        would write; nothing is written. Raises the error `start` would (`how` ends the
        message of a missing input: how to give one)."""
        from ..engine.ops import prepare

        request, registry = self._request(workflow, input, id=id, queue=queue,
                                          priority=priority, input_json=input_json,
                                          start_at=start_at, how=how)
        return prepare(request, registry)

    def _request(self, workflow: str | WorkflowDef, input: Any, *, id: str | None,
                 queue: str | None, priority: int | None, input_json: bytes | str | None,
                 start_at: StartAt, how: str) -> tuple[RunRequest, Registry]:
        # Here, not at the top: starting runs brings in RQ, which a client that only reads
        # (a `status`, the dashboard's pages) never needs.
        from ..engine.ops import RunRequest

        self.settings.load_source()  # once, on the first start: readers never import it
        name = workflow_name(workflow)
        registry = REGISTRY if isinstance(workflow, WorkflowDef) else self._registry_for(name)
        raw = _input_bytes(registry.workflow(name), input, input_json, how)
        return RunRequest(name, raw, id, queue, strict=True, priority=priority,
                          not_before_ms=start_ms(start_at)), registry

    def signal_with_start(self, workflow: str | WorkflowDef, input: Any = None, *, id: str,
                          signal: tuple[str, Any], queue: str | None = None,
                          priority: int | None = None, input_json: bytes | str | None = None,
                          payload_json: bytes | None = None, request_id: str | None = None,
                          how: str = "give an input") -> SignalStarted:
        """Start run `id` if no run has that id and deliver `signal` (name, payload) to it,
        in one script call: concurrent callers create one run, which gets every signal. A
        run that exists just gets the signal (RunSettledError if it has finished)."""
        from ..engine.signals import start_with_signal

        request, registry = self._request(workflow, input, id=id, queue=queue,
                                          priority=priority, input_json=input_json,
                                          start_at=None, how=how)
        name, payload = signal
        return start_with_signal(self.runs_store, self.lanes, request, name, payload,
                                 payload_json=payload_json, registry=registry,
                                 request_id=request_id)

    def start(self, workflow: str | WorkflowDef, input: Any = None, *, id: str | None = None,
              queue: str | None = None, priority: int | None = None,
              input_json: bytes | str | None = None, start_at: StartAt = None,
              signal: tuple[str, Any] | None = None) -> RunHandle:
        """Record a run of `workflow` (its name, or the decorated function) and enqueue it.

        `input` is a Python value (dict, list, msgspec Struct, dataclass ...) sent as JSON;
        `input_json` passes JSON text instead. None (and no input_json) means what the CLI's
        omitted --input means: the workflow's default input. With `id`, the start is
        idempotent: the same id again returns a handle to the existing run, with
        `handle.created` False, and starts nothing. `start_at` (a timezone-aware datetime,
        or epoch seconds) records the run now and starts it then: the controller enqueues
        it at that time; no worker holds it before. `signal=(name, payload)` with an `id` is
        signal-with-start: the run is created if the id is new and gets the signal in the
        same script call (an existing run just gets it), so no signal is lost to a race.

        Raises InputError (input, queue, priority, payload size), InvalidIdError,
        UnknownWorkflowError; nothing is written then."""
        if signal is not None:
            if start_at is not None:
                raise InputError("signal-with-start starts the run now: no start_at")
            if id is None:
                raise InputError("signal-with-start needs an id (it makes the start "
                                 "idempotent)")
            if self._gated(workflow) is not None:
                raise InputError("signal-with-start does not apply a debounce, throttle or "
                                 "singleton: start the run without signal=")
            started = self.signal_with_start(workflow, input, id=id, signal=signal,
                                             queue=queue, priority=priority,
                                             input_json=input_json)
            return RunHandle(self, started.run_id, created=started.created,
                             workflow=started.record.name, queue=started.record.queue,
                             dispatched=started.dispatched, initial_status=started.status)
        from ..engine.ops import prepare

        request, registry = self._request(workflow, input, id=id, queue=queue,
                                          priority=priority, input_json=input_json,
                                          start_at=start_at, how="give an input")
        record = prepare(request, registry)
        definition = registry.workflow(request.name)
        if definition.gate is not None:  # debounce, throttle, singleton: decided first
            return self._start_gated(definition, record, given_id=id is not None,
                                     start_at=start_at is not None)
        return self.start_record(record)

    def _gated(self, workflow: str | WorkflowDef) -> WorkflowDef | None:
        """The definition of `workflow` when it has a debounce, throttle or singleton
        (flow/enqueue_gates.py), else None."""
        self.settings.load_source()
        if isinstance(workflow, WorkflowDef):
            definition = workflow
        elif workflow in REGISTRY.workflows:
            definition = REGISTRY.workflows[workflow]
        else:
            definition = self._registry_for(workflow).workflow(workflow)
        return definition if definition.gate is not None else None

    def _start_gated(self, definition: WorkflowDef, record: RunRecord, *, given_id: bool,
                     start_at: bool) -> RunHandle:
        from ..flow.enqueue_gates import check_request, enqueue

        check_request(definition.gate, given_id=given_id, start_at=start_at)
        done, decision = enqueue(self.runs_store, self.lanes, record, definition)
        if done is not None:
            return RunHandle(self, done.run_id, created=done.created, workflow=done.record.name,
                             queue=done.record.queue, dispatched=done.dispatched,
                             initial_status=done.status, decision=decision)
        return RunHandle(self, decision.run_id, created=decision.outcome == "started",
                         workflow=definition.name,
                         queue=record.queue, dispatched=False,
                         initial_status="waiting" if decision.until_ms else None,
                         decision=decision)

    def start_record(self, record: RunRecord) -> RunHandle:
        """Record and enqueue a prepared run (see `prepare`)."""
        from ..engine.ops import enqueue_record

        done = enqueue_record(self.runs_store, self.lanes, record)
        return self._handle_of(done)

    def start_many(self, requests: Iterable[StartRequest]) -> list[RunHandle]:
        """Start many runs: all are validated first (one bad request starts none), then
        recorded and enqueued 500 to a round trip. Handles come back in request order."""
        from ..engine.ops import ENQUEUE_CHUNK, enqueue_records

        records = []
        for index, r in enumerate(requests):
            try:
                if self._gated(r.workflow) is not None:
                    raise InputError(f"workflow {workflow_name(r.workflow)!r} has a debounce, "
                                     f"throttle or singleton, which start_many does not "
                                     f"apply: start its runs one by one")
                records.append(self.prepare(r.workflow, r.input, id=r.id, queue=r.queue,
                                            priority=r.priority, input_json=r.input_json,
                                            start_at=r.start_at))
            except MarblesError as exc:
                # Which of hundreds was refused: the same error, its line naming the request.
                exc.args = (f"request {index}: {exc}",)
                raise
        handles: list[RunHandle] = []
        for at in range(0, len(records), ENQUEUE_CHUNK):
            done = enqueue_records(self.runs_store, self.lanes, records[at:at + ENQUEUE_CHUNK])
            handles += [self._handle_of(d) for d in done]
        return handles

    def _handle_of(self, done: Enqueued) -> RunHandle:
        return RunHandle(self, done.run_id, created=done.created, workflow=done.record.name,
                         queue=done.record.queue, dispatched=done.dispatched,
                         initial_status=done.status)

    def handle(self, run_id: str) -> RunHandle:
        """A handle to an existing run (not checked until used)."""
        return RunHandle(self, check_id(run_id, "run id"))

    # -- reading ----------------------------------------------------------------------------

    def status(self, run_id: str) -> RunStatus:
        return msgspec.convert(self.status_json(run_id), RunStatus)

    def status_json(self, run_id: str) -> dict[str, Any]:
        """`status --json`'s document (RunStatus's fields, as plain JSON values)."""
        view = self.reader.get(check_id(run_id, "run id"))
        if view is None:
            window = self._window(run_id)  # a debounce window's run, not recorded yet
            if window is not None:
                return {**window.to_json(), "questions": [], "reports": [], "published": {},
                        "signals": {}}
            view = self.reader.get(run_id)  # its window closed between the two reads
        if view is None:
            raise RunNotFoundError(f"no run with id {run_id!r} (finished runs are pruned once "
                                   f"their retention ends, 7 days unless the workflow sets "
                                   f"retention_s)")
        data = view.to_json()
        waits = WaitStore(self.reader)
        data["questions"] = [q.to_json() for q in waits.questions(run_id)]
        data["reports"] = [r.to_json() for r in waits.run_reports(run_id)]
        data["artifacts"] = [{**r["entry"], "step": r["step"]} for r in data["reports"]
                             if r["kind"] == "artifact" and isinstance(r["entry"], dict)]
        data["published"] = published(self.reader, run_id)
        data["signals"] = signals_json(self.reader, run_id)  # per name: sent, taken, buffered
        data["batch"] = self.batch(run_id)
        # Its own session's id (the run's id: a session exists once the body opens it) and
        # the sessions it opened (marbles_rq/sessions/).
        data["session"] = run_id
        data["sessions"] = self.run_sessions(run_id)
        return data

    def batch(self, run_id: str) -> dict[str, Any] | None:
        """The batch of events a batch run was started with (`@mr.on_event(batch=...)`):
        {"batch", "trigger", "key", "events", "sealed_by", "opened_at", "sealed_at",
        "state"}; None for a run that no batch started."""
        from ..triggers.batches import Batches

        return Batches(self.reader).get(check_id(run_id, "run id"))

    def open_batches(self) -> list[Any]:
        """The open event batches (`OpenBatch`: trigger, key, size, opened and sealing
        times), oldest first."""
        from ..triggers.batches import Batches

        return Batches(self.reader).open()

    def runs(self, *, status: str | None = None, workflow: str | None = None,
             queue: str | None = None, since: float | None = None, until: float | None = None,
             limit: int = 50, cursor: str | None = None,
             tag: str | dict[str, str] | list[str] | None = None) -> RunsPage:
        """Runs newest first, a page at a time: `since`/`until` are epoch seconds of their
        creation; `cursor` is the previous page's; `tag` ("key=value", a list of them, or a
        mapping) keeps the runs carrying every one. A page's cost does not grow with the
        number of runs (engine/paging.py)."""
        from ..engine.tags import parse_tags

        tags = parse_tags([tag] if isinstance(tag, str) else [
            f"{k}={v}" for k, v in tag.items()] if isinstance(tag, dict) else tag or [])
        if status is not None and status not in STATUSES:  # a typo would list no run
            raise InputError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        _check_limit(limit, 10_000)
        try:
            after = Cursor.decode(cursor)
        except ValueError as exc:
            raise InvalidIdError(str(exc)) from None
        page = RunPager(self.reader).page(limit=limit, after=after, filters=Filters(
            status=status, workflow=workflow, queue=queue,
            since_ms=epoch_ms(since, "since"), until_ms=epoch_ms(until, "until"), tags=tags))
        rows = [RunSummary(id=r.id, name=r.name, queue=r.queue, status=r.status,
                           attempt=r.attempt, created_ms=r.created_ms, started_ms=r.started_ms,
                           finished_ms=r.finished_ms, parent=r.parent,
                           resumptions=r.resumptions, tags=r.tags, version=r.version,
                           waiting=r.waiting)
                for r in page.rows]
        return RunsPage(rows, None if page.next is None else page.next.encode(),
                        not page.exhausted_budget)

    # -- many runs at once -------------------------------------------------------------------

    def select(self, **criteria: Any) -> RunFilter:
        """A filter for the bulk operations: status, workflow, queue, since, until (epoch
        seconds of creation), tags ("key=value" texts or a mapping), question (an open
        question's key). At least one is needed. FilterError."""
        return RunFilter.build(**criteria)

    def count(self, target: RunFilter, sample: int = 10) -> tuple[int, list[str]]:
        """How many runs `target` selects now, and the first `sample` ids (a dry run)."""
        return Selection(self.reader, target, batch=1000).count(sample)

    def cancel_many(self, target: RunFilter | Iterable[str], **options: Any) -> BulkSummary:
        """Cancel the runs a filter selects (`client.select(status="queued")`), or these
        ids, a batch at a time; see `bulk`."""
        return self.bulk("cancel", target, **options)

    def pause_many(self, target: RunFilter | Iterable[str], **options: Any) -> BulkSummary:
        return self.bulk("pause", target, **options)

    def resume_many(self, target: RunFilter | Iterable[str], **options: Any) -> BulkSummary:
        return self.bulk("resume", target, **options)

    def rerun_many(self, target: RunFilter | Iterable[str], *, from_step: str | None = None,
                   **options: Any) -> BulkSummary:
        """Rerun the finished runs selected; each rerun's id is fixed by the operation, so
        the same call again reruns nothing twice (skipped: already rerun)."""
        return self.bulk("rerun", target, from_step=from_step, **options)

    def approve_many(self, target: RunFilter | Iterable[str], key: str | None = None,
                     note: str | None = None, **options: Any) -> BulkSummary:
        """Approve approval `key` (default: the filter's question) of each selected run."""
        return self.bulk("approve", target, key=key, note=note, **options)

    def reject_many(self, target: RunFilter | Iterable[str], key: str | None = None,
                    note: str | None = None, **options: Any) -> BulkSummary:
        return self.bulk("reject", target, key=key, note=note, **options)

    def bulk(self, action: str, target: RunFilter | Iterable[str], *, key: str | None = None,
             note: str | None = None, from_step: str | None = None,
             rerun_key: str | None = None, batch: int = 100,
             on_batch: Callable[[BulkSummary], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> BulkSummary:
        """Apply `action` (cancel, pause, resume, rerun, approve, reject) to each run of
        `target`, `batch` runs per pass: per run the one-run call of the same name. Runs
        with nothing to do are skipped with a reason; `should_stop` is asked between
        batches (True: stop; the summary says `stopped`). Safe to run again."""
        from .bulk import run_bulk

        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 1000:
            raise InputError(f"batch must be 1 to 1000, not {batch!r}")
        if note is not None:
            note = _note(note)
        return run_bulk(self, action, target, key=key, note=note, from_step=from_step,
                        rerun_key_=rerun_key, batch=batch, on_batch=on_batch,
                        should_stop=should_stop)

    # -- artifacts (marbles_rq/artifacts) ----------------------------------------------------

    def artifact(self, name: str, media_type: str | None = None) -> ClientArtifact:
        """A handle on artifact `name`: put (compare-and-set with expect_version), get,
        open, versions, version, latest, delete. ArtifactNameError for a bad name."""
        from ..artifacts.handle import ClientArtifact
        from ..artifacts.store import ArtifactStore

        return ClientArtifact(ArtifactStore(self.runs_store), name, media_type)

    def artifact_info(self, name: str) -> ArtifactInfo:
        """One artifact as the listing shows it. UnknownArtifactError."""
        from ..artifacts.store import ArtifactStore

        return ArtifactStore(self.reader).info(name)

    def artifacts(self) -> list[ArtifactInfo]:
        """Every artifact declared or written, by name: latest version, version count."""
        from ..artifacts.store import ArtifactStore

        return ArtifactStore(self.reader).listing()

    # -- rate limits (flow/rate_limits.py) ------------------------------------------------

    def rate_limits(self) -> list[RateLimitInfo]:
        """Every rate limit declared or taken: rate in force, burst, held runs, last
        admission."""
        from ..flow.rate_store import catalog_rates

        store = self.reader
        return store.rates().list(catalog_rates(store.client, store.keys))

    def set_rate_limit(self, name: str, rate: str, burst: int | None = None) -> RateLimitInfo:
        """Change limit `name`'s rate (or every limit of workflow `name`) until
        `reset_rate_limit`; workers apply it within a second. RateError for a bad rate,
        UnknownRateLimitError for a name never declared nor taken."""
        from ..flow.rate_specs import Rate, check_burst
        from ..flow.rate_store import catalog_rates

        store = self.runs_store
        limit = Rate(rate.strip() if isinstance(rate, str) else rate,
                     1 if burst is None else check_burst(burst))
        return store.rates().set(name, limit, catalog_rates(store.client, store.keys))

    def reset_rate_limit(self, name: str) -> RateLimitInfo:
        """Back to the rate the source declares."""
        from ..flow.rate_store import catalog_rates

        store = self.runs_store
        return store.rates().reset(name, catalog_rates(store.client, store.keys))

    # -- locks (flow/locks.py) ----------------------------------------------------------------

    def locks(self) -> list[LockInfo]:
        """Every lock a run took or waited for: its holder (run id, epoch, since, lease
        expiry; "" when free) and its waiters in order of arrival."""
        return self.reader.locks().list()

    def feed(self, limit: int = 100) -> list[QuestionInfo]:
        """Open questions and approvals across runs, oldest first (`limit`: 1 to 1000)."""
        _check_limit(limit, 1000)
        now_ms = int(time.time() * 1000)
        return [msgspec.convert(q.to_json(now_ms), QuestionInfo)
                for q in WaitStore(self.reader).feed(limit)]

    def reports(self, limit: int = 20) -> list[ReportInfo]:
        """The newest reports across runs (`limit`: 1 to 1000)."""
        _check_limit(limit, 1000)
        reports = WaitStore(self.reader).reports(limit)
        return [msgspec.convert(r.to_json(), ReportInfo) for r in reports]

    def output(self, run_id: str, *, after: str = "0-0", block_ms: int | None = None,
               count: int = 1000) -> list[OutputEntry]:
        """Output entries of a run after the entry id `after` (a cursor); with `block_ms`,
        waits up to that long for the first new one."""
        if not isinstance(after, str) or not _ENTRY_ID.fullmatch(after):
            raise InvalidIdError(f"invalid output entry id {after!r}: expected <ms>-<seq>")
        events = self.reader.output(check_id(run_id, "run id"), after=after,
                                        block_ms=block_ms, count=count)
        return [entry_of(ev) for ev in events]

    # -- acting on runs ---------------------------------------------------------------------

    def _deliver(self, run_id: str, attempt: int, queue: str) -> str:
        """Enqueue a woken run's delivery now; the controller dispatches it if this fails."""
        try:
            self.lanes.enqueue(queue, run_id, attempt)
        except redis.RedisError as exc:
            return f"; the controller will dispatch it ({one_line(exc)})"
        return ""

    def cancel(self, run_id: str, *, compensate: bool = False) -> Outcome:
        """Cancel a run and its children: a queued or waiting run never starts again; a
        running one stops at its next step boundary. outcome: cancelled | requested |
        settled (it had finished: nothing done). `compensate`: first run the undos its
        steps registered (docs/how-to/compensation.md); outcome then also compensating (a
        delivery runs them, then the run ends cancelled)."""
        runs = self.runs_store
        if compensate:
            return self._cancel_compensate(check_id(run_id, "run id"))
        outcome = self._cancel_beyond_record(run_id, runs.cancel(check_id(run_id, "run id")))
        message = {"cancelled": f"run {run_id} cancelled",
                   "requested": f"run {run_id} is running; cancel requested, it stops at its "
                                f"next step boundary",
                   "settled": f"run {run_id} has already finished; nothing to cancel"}[outcome]
        children = [] if outcome == "settled" else WaitStore(runs).cancel_children(run_id)
        return Outcome(run_id, outcome, message, children)

    def _cancel_beyond_record(self, run_id: str, outcome: str) -> str:
        """A cancel's outcome once what the run's record does not hold is done: a debounce
        window's run (not recorded yet) is cancelled with its window; a run cancelled
        before it executed frees its singleton key. RunNotFoundError when neither knows it."""
        if outcome == "missing":
            from ..flow.debounce import cancel_window

            if cancel_window(self.runs_store, self.lanes, run_id):
                outcome = "cancelled"
        if outcome == "cancelled":
            self._free_singleton(run_id)
        if outcome == "missing":
            raise RunNotFoundError(f"no run with id {run_id!r}")
        return outcome

    def _cancel_compensate(self, run_id: str) -> Outcome:
        runs = self.runs_store
        outcome, attempt, queue = runs.cancel_compensate(run_id)
        outcome = self._cancel_beyond_record(run_id, outcome)
        tail = ""
        if outcome == "woken":
            tail = self._deliver(run_id, attempt, queue)
        message = {
            "cancelled": f"run {run_id} cancelled (it had not started: nothing to undo)",
            "requested": f"run {run_id} is running; cancel requested: it stops at its next "
                         f"step boundary, then its compensations run",
            "woken": f"run {run_id} is compensating (delivery {attempt}){tail}; it ends "
                     f"cancelled",
            "queued": f"run {run_id} is compensating; it ends cancelled",
            "compensating": f"run {run_id} is already compensating; it ends {queue}",
            "settled": f"run {run_id} has already finished; nothing to cancel"}[outcome]
        children = [] if outcome in ("settled", "compensating") else (
            WaitStore(runs).cancel_children(run_id))
        return Outcome(run_id, "compensating" if outcome in ("woken", "queued") else outcome,
                       message, children)
    def _free_singleton(self, run_id: str) -> None:
        """A run cancelled before it executed: free its singleton's key (a running one
        frees it when it settles)."""
        view = self.reader.get(run_id)
        if view is not None and view.record.singleton:
            from ..flow.singleton import cleared

            cleared(self.runs_store, view.record)

    @_not_before_window
    def pause(self, run_id: str) -> Outcome:
        """Pause a run: a running one parks at its next step boundary, a queued one when it
        starts, a waiting one at once; only `resume` wakes it. RunSettledError if it had
        finished. outcome: paused | requested | already."""
        outcome = self._waits().pause(check_id(run_id, "run id"))
        if outcome == "settled":
            raise RunSettledError(f"run {run_id} has already finished; nothing to pause")
        return Outcome(run_id, outcome, {
            "paused": f"run {run_id} paused",
            "requested": f"run {run_id} will park at its next step boundary (paused)",
            "already": f"run {run_id} is already paused"}[outcome])

    @_not_before_window
    def resume(self, run_id: str) -> Outcome:
        """Resume a paused run. outcome: woken (delivered again) | resumed (it had not
        parked yet; it carries on). NotPausedError, RunSettledError."""
        outcome, attempt, queue = self._waits().resume(check_id(run_id, "run id"))
        if outcome == "woken":
            return Outcome(run_id, outcome, f"run {run_id} resumed (delivery {attempt})"
                           + self._deliver(run_id, attempt, queue))
        if outcome == "resumed":
            return Outcome(run_id, outcome,
                           f"run {run_id} resumed before it parked; it carries on")
        raise RunSettledError(f"run {run_id} has already finished; nothing to resume")

    @_not_before_window
    def answer(self, run_id: str, key: str, value: Any) -> Outcome:
        """Answer question `key` with `value` (one of its choices, or the choice's number as
        text). The first answer wins: AlreadyAnsweredError after; UnknownQuestionError,
        AnswerRefusedError."""
        # Only text is ever accepted; the repr of anything else (deep, huge) is never shown.
        what = f"answered {value!r}" if isinstance(value, str) else "answered"
        return self._answer(run_id, key, value, "question", what)

    @_not_before_window
    def approve(self, run_id: str, key: str, note: str | None = None) -> Outcome:
        """Approve approval `key`; the run receives {"approved": True, "note": note}."""
        return self._answer(run_id, key, {"approved": True, "note": _note(note)}, "approval",
                            "approved")

    @_not_before_window
    def reject(self, run_id: str, key: str, note: str | None = None) -> Outcome:
        """Reject approval `key`; the run receives {"approved": False, "note": note}."""
        return self._answer(run_id, key, {"approved": False, "note": _note(note)},
                            "approval", "rejected")

    @_not_before_window
    def retry(self, run_id: str, input_patch: Any = None) -> Outcome:
        """Run the step a run is paused on (its tries ran out, on_exhausted="pause") again
        now, its tries counted from 1; `input_patch` (a JSON object) first changes the
        step's arguments, as an RFC 7396 merge patch over them by name, recorded in the
        ledger. NotFailedStepError (not paused on a failed step), PatchRefusedError,
        RunSettledError, RunNotFoundError."""
        from ..engine import failed_steps

        check_id(run_id, "run id")
        done = failed_steps.retry(self._waits(), self.runs_store.get(run_id), run_id,
                                  input_patch, REGISTRY)
        what = "with its input patched" if input_patch is not None else "now"
        return Outcome(run_id, "retried", f"run {run_id}: step {done.step} retried {what} "
                       f"(delivery {done.attempt})"
                       + self._deliver(run_id, done.attempt, done.queue))

    @_not_before_window
    def fail(self, run_id: str, reason: str | None = None) -> Outcome:
        """Give up the step a run is paused on: it fails with its last error and `reason`,
        and the run goes on as after any failed step (it ends failed unless its body catches
        StepFailedError). NotFailedStepError, RunSettledError, RunNotFoundError."""
        from ..engine import failed_steps

        check_id(run_id, "run id")
        done = failed_steps.fail(self._waits(), self.runs_store.get(run_id), run_id, reason)
        # An undo given up is recorded failed and the other undos run: no body is left to
        # handle it, and the run ends as its compensation says (failed, or cancelled).
        after = ("it is recorded failed; the other undos run, then the run ends"
                 if done.step.startswith(f"{FRAME}.") else
                 "the run fails unless its body handles it")
        return Outcome(run_id, "failed", f"run {run_id}: step {done.step} given up (delivery "
                       f"{done.attempt}: {after})"
                       + self._deliver(run_id, done.attempt, done.queue))

    def _answer(self, run_id: str, key: str, value: Any, kind: str, what: str) -> Outcome:
        done: Answered = self._waits().answer(check_id(run_id, "run id"), key, value,
                                              kind=kind)
        if done.woken_attempt:
            tail = "; run woken" + self._deliver(run_id, done.woken_attempt, done.queue)
        else:
            tail = "; the run sees it when it next replays"
        return Outcome(run_id, "answered", f"run {run_id}: {done.question.key} {what}{tail}")

    def send_event(self, source: str, id: str, type: str | None = None, payload: Any = None,
                   *, payload_json: bytes | str | None = None) -> Sent:
        """Record an inbound event (as `marbles-rq events send`), deliver it to the runs
        waiting for it, and start the run of the `@mr.on_event` trigger it matches; the same
        (source, id) again is recorded once. The triggers are those of the source this client
        imports (connect(source=...) or MARBLES_SOURCE) for the sources they name, else those
        the deployment's workers declared; with none matching, the event is journaled as
        unmatched (and still delivered to waiting runs)."""
        from ..triggers.events import Events

        self.settings.load_source()
        raw = encode_json(payload, "the payload") if payload_json is None else (
            payload_json.encode() if isinstance(payload_json, str) else bytes(payload_json))
        # Every input error before touching Redis.
        Events.validate(source, id, type=type or "", payload=raw)
        return Events(self.runs_store, self.lanes).send(source, id, type=type or "",
                                                        payload=raw)

    @_not_before_window
    def rerun(self, run_id: str, *, from_step: str | None = None,
              new_id: str | None = None) -> Rerun:
        """A new run of a finished run's workflow with its recorded input (as `marbles-rq
        rerun`); `from_step` copies the results recorded before that step. The same
        `new_id` again returns that rerun. RerunError, RunNotFoundError, InvalidIdError."""
        from ..engine.rerun import rerun

        self.settings.load_source()
        return rerun(self.runs_store, self.lanes, check_id(run_id, "run id"),
                     from_step=from_step, new_id=new_id)

    @_not_before_window
    def signal(self, run_id: str, name: str, payload: Any = None, *,
               payload_json: bytes | None = None, request_id: str | None = None) -> SignalSent:
        """Send signal `name` to a run: recorded durably after its earlier signals of that
        name, taken once by ctx.wait_for_signal / ctx.signals (buffered if it has not asked
        yet); a run parked for it is woken in the same script call. `request_id` makes a
        retried send record once. RunNotFoundError, RunSettledError (it has finished),
        InvalidSignalError, PayloadTooLargeError, SignalBufferFullError."""
        from ..engine.signals import send_signal

        return send_signal(self.runs_store, check_id(run_id, "run id"), name, payload,
                           payload_json=payload_json, rq=self.lanes, request_id=request_id)

    # -- histories ---------------------------------------------------------------------------

    def export(self, *run_ids: str) -> list[History]:
        """The runs' histories, as `marbles-rq export` writes them (input, version, ledger,
        answers, signals, children's outcomes): what `marbles_rq.testing.check_replays`
        and `replay --check --from` replay against new code. RunNotFoundError."""
        from ..engine.history import read_histories

        return read_histories(self.reader, [check_id(r, "run id") for r in run_ids])

    # -- published state --------------------------------------------------------------------

    def get(self, run_id: str, key: str) -> Any:
        """The value the run last published under `key` (`ctx.publish`). RunNotFoundError,
        NotPublishedError."""
        from ..engine.published import get_published

        return get_published(self.reader, run_id, key)

    def wait_for(self, run_id: str, key: str, timeout: float = 60.0) -> Any:
        """Block until the run has published `key` and return the value (at once if it has):
        a blocking read of its output stream, not polling. PublishedWaitTimeoutError;
        NotPublishedError when the run finishes without publishing it."""
        from ..engine.published import wait_published

        return wait_published(self.reader, run_id, key, timeout)

    # -- waiting ----------------------------------------------------------------------------

    def result(self, run_id: str, timeout: float | None = None, *,
               type: type[T] | Any = Any) -> Any:
        """Wait until the run finishes and return its result (decoded as `type` when given).
        Reads the run's output stream with blocking reads, so it returns as the final entry
        is written. RunFailedError (its `.error`), RunCancelledError, ResultTimeoutError,
        RunNotFoundError."""
        final = self._final(check_id(run_id, "run id"), wait_seconds(timeout))
        return settle(run_id, final, type)

    def _final(self, run_id: str, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        last = self._last_entry(run_id)
        while True:
            if last is not None and last[1] == "final":
                return dict(last[2])
            after = "0-0" if last is None else last[0]
            left_ms = BLOCK_SLICE_MS if deadline is None else int(
                (deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise ResultTimeoutError(f"run {run_id} did not finish within {timeout} s")
            events = self.reader.output(run_id, after=after,
                                            block_ms=max(1, min(left_ms, BLOCK_SLICE_MS)))
            for ev in events:
                last = (ev.id, ev.type, ev.data)
                if ev.type == "final":
                    return dict(ev.data)
            if not events and last is None and self.reader.get(run_id) is None and (
                    self._window(run_id) is None) and self.reader.get(run_id) is None:
                raise RunNotFoundError(f"no run with id {run_id!r}")

    def _window(self, run_id: str) -> RunView | None:
        from ..flow.debounce import window_view

        return window_view(self.reader, run_id)

    def _last_entry(self, run_id: str) -> tuple[str, str, Any] | None:
        """The run's newest output entry (id, type, data), or None for an empty stream."""
        rows: Any = self.reader.client.xrevrange(self.reader.keys.output(run_id), count=1)
        if not rows:
            return None
        eid, fields = rows[0]
        data = open_event(self.reader.store, msgspec.json.decode(fields.get(b"d", b"null")))
        return as_text(eid), as_text(fields.get(b"t", b"")), data

    def watch(self, run_id: str, *, after: str = "0-0", follow: bool = True
              ) -> Iterator[OutputEntry]:
        """The run's output entries from after `after`, following until its final entry
        (or, with follow=False, only what is there now)."""
        check_id(run_id, "run id")
        while True:
            entries = self.output(run_id, after=after,
                                  block_ms=BLOCK_SLICE_MS if follow else None)
            for entry in entries:
                yield entry
                after = entry.id
                if entry.type == "final":
                    return
            if not follow and len(entries) < 1000:
                return

    # -- sessions (marbles_rq/sessions/) -----------------------------------------------------

    def session(self, session_id: str) -> Session:
        """Create-or-get the session `session_id` (creating under an existing id returns the
        existing one, unchanged). One a client creates is kept until deleted.
        SessionCorruptError when its record cannot be decoded."""
        from ..sessions import Session, SessionStore

        store = SessionStore(self.runs_store)
        record, _, created = store.open(session_id)
        return Session(store, session_id, parent=record.parent, created=created)

    def sessions(self, *, limit: int | None = None) -> SessionListing:
        """Every session, newest activity first; `.corrupt` names the records skipped
        because they cannot be decoded."""
        from ..sessions import SessionStore

        return SessionStore(self.reader).listing(limit=limit)

    def session_info(self, session_id: str) -> SessionInfo:
        """One session's summary. SessionNotFoundError, SessionCorruptError."""
        from ..sessions import SessionStore

        return SessionStore(self.reader).info(session_id)

    def session_messages(self, session_id: str, *, after: int = 0,
                         limit: int | None = None) -> list[Message]:
        """The messages of a session after position `after`, without creating it.
        SessionNotFoundError."""
        from ..sessions import SessionStore

        return SessionStore(self.reader).read(session_id, after=after, limit=limit)

    def delete_session(self, session_id: str) -> int:
        """Delete a session and its messages, whoever uses it: how many it held.
        SessionNotFoundError."""
        from ..sessions import SessionStore

        return SessionStore(self.runs_store).delete(session_id)

    def run_sessions(self, run_id: str) -> list[str]:
        """The ids of the sessions run `run_id` opened (`mr.session`)."""
        from ..sessions import SessionStore

        return SessionStore(self.reader).of_run(check_id(run_id, "run id"))


def entry_of(event: OutputEvent) -> OutputEntry:
    return OutputEntry(event.id, event.type, event.attempt, event.happened_ms, event.data)


def settle(run_id: str, final: dict[str, Any], type: Any = Any) -> Any:
    """A final output entry's data as `result()` answers it."""
    status = final.get("status")
    if status == "succeeded":
        value = final.get("result")
        return value if type is Any else msgspec.convert(value, type)
    if status == "cancelled":
        raise RunCancelledError(run_id, final.get("reason"))
    raise RunFailedError(run_id, final.get("error"))


def _note(note: Any) -> str | None:
    """An approval's note: text within MARBLES_MAX_PAYLOAD (it is stored in the run, as an
    input is), or None."""
    if note is None:
        return None
    if not isinstance(note, str):
        raise InputError(f"a note is text, not {type(note).__name__}")
    from ..engine.ops import PayloadTooLargeError, max_payload

    size, limit = len(note.encode("utf-8", "surrogatepass")), max_payload()
    if size > limit:
        raise PayloadTooLargeError(f"the note is {size} bytes; the limit is {limit} (set "
                                   f"MARBLES_MAX_PAYLOAD to change it)")
    return note


def _input_bytes(definition: WorkflowDef, value: Any, input_json: bytes | str | None,
                 how: str) -> bytes:
    if input_json is not None:
        if value is not None:
            raise InputError("give input or input_json, not both")
        return input_json.encode() if isinstance(input_json, str) else bytes(input_json)
    if value is None:
        return definition.omitted_input(how)
    return encode_input(value)


def _check_limit(limit: Any, high: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= high:
        raise InputError(f"limit must be 1 to {high}, not {limit!r}")


def encode_json(value: Any, what: str = "input") -> bytes:
    """A Python value as JSON, refused as InputError when it cannot be: a value of a type
    JSON has no form for, NaN or an infinity (msgspec would write null: the value would
    change on its way), or nesting that would overflow the encoder's recursion."""
    try:
        encoded = msgspec.json.encode(value)
    except (TypeError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise InputError(f"{what} cannot be sent as JSON: {exc}") from None
    except RecursionError:
        from ..engine.ops import MAX_DEPTH, InputTooDeepError

        raise InputTooDeepError(f"{what} nests arrays or objects deeper than {MAX_DEPTH} "
                                f"levels") from None
    if changed_by_json(value, encoded):
        raise InputError(f"{what} cannot be sent as JSON: it holds NaN or an infinity")
    return encoded


def encode_input(value: Any) -> bytes:
    """A workflow's input as JSON (see encode_json)."""
    return encode_json(value)


class RunClient(Protocol):
    """What a RunHandle asks of its client: the Client, or the test kit's Environment
    (marbles_rq/testing), which offers the same calls on runs in memory."""

    def status(self, run_id: str) -> RunStatus: ...
    def result(self, run_id: str, timeout: float | None = None, *, type: Any = Any) -> Any: ...
    def cancel(self, run_id: str, *, compensate: bool = False) -> Outcome: ...
    def pause(self, run_id: str) -> Outcome: ...
    def resume(self, run_id: str) -> Outcome: ...
    def retry(self, run_id: str, input_patch: Any = None) -> Outcome: ...
    def fail(self, run_id: str, reason: str | None = None) -> Outcome: ...
    def answer(self, run_id: str, key: str, value: Any) -> Outcome: ...
    def approve(self, run_id: str, key: str, note: str | None = None) -> Outcome: ...
    def reject(self, run_id: str, key: str, note: str | None = None) -> Outcome: ...
    def get(self, run_id: str, key: str) -> Any: ...
    def signal(self, run_id: str, name: str, payload: Any = None, *,
               request_id: str | None = None) -> SignalSent: ...
    def watch(self, run_id: str, *, after: str = "0-0", follow: bool = True
              ) -> Iterator[OutputEntry]: ...
    def wait_for(self, run_id: str, key: str, timeout: float = 60.0) -> Any: ...


class RunHandle:
    """One run, by id. `created` is True when `start` recorded it, False when a run with
    that id existed (nothing was started), None for a handle from `Client.handle`. A
    started handle also knows its workflow, queue, whether its first delivery was enqueued
    (`dispatched`; False: the controller enqueues it) and the run's status then."""

    def __init__(self, client: RunClient, run_id: str, *, created: bool | None = None,
                 workflow: str | None = None, queue: str | None = None,
                 dispatched: bool | None = None, initial_status: str | None = None,
                 decision: Decision | None = None) -> None:
        self.client, self.id = client, run_id
        self.created, self.workflow, self.queue = created, workflow, queue
        self.dispatched, self.initial_status = dispatched, initial_status
        # What the start did, for a workflow with a debounce, throttle or singleton (started,
        # merged, dropped, skipped, cancelled_running; flow/gate_specs.py); None without
        # one. Dropped: `id` is "" (no run was made).
        self.decision = decision

    def __repr__(self) -> str:
        return f"RunHandle({self.id!r}, created={self.created})"

    def status(self) -> RunStatus:
        return self.client.status(self.id)

    def result(self, timeout: float | None = None, *, type: Any = Any) -> Any:
        return self.client.result(self.id, timeout, type=type)

    def cancel(self, *, compensate: bool = False) -> Outcome:
        return self.client.cancel(self.id, compensate=compensate)

    def pause(self) -> Outcome:
        return self.client.pause(self.id)

    def resume(self) -> Outcome:
        return self.client.resume(self.id)

    def retry(self, input_patch: Any = None) -> Outcome:
        """Retry the step the run is paused on (see Client.retry)."""
        return self.client.retry(self.id, input_patch)

    def fail(self, reason: str | None = None) -> Outcome:
        """Give up the step the run is paused on (see Client.fail)."""
        return self.client.fail(self.id, reason)

    def answer(self, key: str, value: Any) -> Outcome:
        return self.client.answer(self.id, key, value)

    def approve(self, key: str, note: str | None = None) -> Outcome:
        return self.client.approve(self.id, key, note)

    def reject(self, key: str, note: str | None = None) -> Outcome:
        return self.client.reject(self.id, key, note)

    def watch(self, *, after: str = "0-0", follow: bool = True) -> Iterator[OutputEntry]:
        return self.client.watch(self.id, after=after, follow=follow)

    def get(self, key: str) -> Any:
        return self.client.get(self.id, key)

    def signal(self, name: str, payload: Any = None, *,
               request_id: str | None = None) -> SignalSent:
        return self.client.signal(self.id, name, payload, request_id=request_id)

    def wait_for(self, key: str, timeout: float = 60.0) -> Any:
        return self.client.wait_for(self.id, key, timeout)
