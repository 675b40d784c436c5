"""The test kit's environment: workflows run by the in-memory engine (the real executor over
runs kept in memory: engine/memory_engine.py) on a virtual clock, driven by the test.

    env = Environment(start=datetime(2027, 3, 1, 9, tzinfo=UTC), tz="Europe/Berlin")
    run = env.start(order, {"id": 7})        # a RunHandle, as the client's start returns
    env.run_until_idle()                     # deliver what can run now; the clock stays
    run.approve("ship")                      # the handle's calls act on the environment
    env.advance(timedelta(days=30))          # timers, timeouts, schedules fire in order
    assert run.result() == {"shipped": True}

Nothing executes behind the test's back: `start`, `answer`, `signal`, `send_event` record
what they do (as the client's calls do) and `run_until_idle`, `advance` and `result`
deliver the runs that can run. Nothing touches Redis.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

import msgspec

from ..client.errors import ResultTimeoutError
from ..client.sync import (
    RunHandle,
    _input_bytes,
    _note,
    encode_json,
    entry_of,
    settle,
    workflow_name,
)
from ..client.views import Outcome, OutputEntry, RunStatus
from ..engine.authoring import REGISTRY, Registry, WorkflowDef
from ..engine.context import Limits
from ..engine.execution import RunNotFoundError
from ..engine.memory_engine import MemoryEngine
from ..engine.memory_store import _Run
from ..engine.ops import RunRequest, prepare
from ..engine.runs import TERMINAL
from ..engine.signals import SignalSent, check_name, encode_payload
from ..engine.waits import (
    AlreadyAnsweredError,
    NotPausedError,
    Report,
    UnknownQuestionError,
    answer_of_kind,
)
from ..errors import RunSettledError
from ..store.ids import check_id
from .faults import Faults
from .schedules import Schedules

if TYPE_CHECKING:
    from ..triggers.schedule_spec import ScheduleRegistry

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# A day short of datetime.max, so reading the clock in any zone stays in range.
_LAST_MS = (dt.datetime(9999, 12, 30, tzinfo=dt.UTC) - _EPOCH) // dt.timedelta(milliseconds=1)


def _ms(when: dt.datetime) -> int:
    return (when - _EPOCH) // dt.timedelta(milliseconds=1)


class Environment:
    """Workflows on a virtual clock, in memory (see the module's note).

    `start`: the clock's first reading (an aware datetime; a naive one is read in `tz`);
    now by default. `tz`: the zone `now()` answers in (UTC by default). `registry`: the
    workflows (those declared by imported modules by default). `schedules`: fire the
    declared schedules (`@mr.schedule`) on the clock: True (all whose workflow is loaded),
    False, or their keys; `schedule_registry`: where they are declared (`@mr.schedule(...,
    registry=...)`; the default one otherwise)."""

    def __init__(self, *, start: dt.datetime | None = None, tz: str | ZoneInfo | None = None,
                 registry: Registry = REGISTRY, schedules: bool | list[str] = True,
                 schedule_registry: ScheduleRegistry | None = None,
                 limits: Limits | None = None) -> None:
        if start is not None and not isinstance(start, dt.datetime):
            raise TypeError(f"Environment(start=...) takes a datetime, not {start!r}")
        self.tz = ZoneInfo(tz) if isinstance(tz, str) else (tz or ZoneInfo("UTC"))
        if start is not None and start.tzinfo is None:
            start = start.replace(tzinfo=self.tz)
        self.engine = MemoryEngine(registry, start_ms=None if start is None else _ms(start),
                                   limits=limits)
        self.registry = registry
        self.faults = Faults()
        self.engine.override_step = self.faults.override
        self._ids = itertools.count(1)
        self._events: dict[str, Any] = {}
        if schedules is False:
            keys: list[str] | None = []
        else:
            keys = None if schedules is True else list(schedules)
        self.schedules = Schedules(self.engine, _schedule_registry(schedule_registry, keys),
                                   keys)
        self.engine.timed.append(self.schedules)

    # -- the clock --------------------------------------------------------------------------

    def now(self) -> dt.datetime:
        """The virtual clock's time, in the environment's zone."""
        return dt.datetime.fromtimestamp(self.engine.now_ms() / 1000, self.tz)

    def advance(self, delta: dt.timedelta | float) -> None:
        """Move the clock by `delta` (a timedelta, or seconds), firing on the way, each at
        its instant and in time order, what comes due (timers, ask/signal/event timeouts,
        run deadlines, schedules) and delivering what that wakes or starts."""
        seconds = delta.total_seconds() if isinstance(delta, dt.timedelta) else float(delta)
        if seconds != seconds or seconds in (float("inf"), float("-inf")):
            raise ValueError(f"cannot advance the clock by {delta!r}: give a finite amount")
        self.engine.advance_to(self._target(self.engine.now_ms() + int(seconds * 1000)))

    def advance_to(self, when: dt.datetime) -> None:
        """Move the clock to `when` (aware), as `advance` does."""
        if not isinstance(when, dt.datetime):
            raise TypeError(f"advance_to takes a datetime, not {when!r}")
        if when.tzinfo is None:
            when = when.replace(tzinfo=self.tz)
        self.engine.advance_to(self._target(_ms(when)))

    def _target(self, target_ms: int) -> int:
        # Refused before anything fires: a clock moved back, or past what a datetime holds
        # (now(), status times), would leave the environment unreadable.
        now_ms = self.engine.now_ms()
        if target_ms < now_ms:
            raise ValueError(f"the clock does not go back (it reads {self.now().isoformat()})")
        if target_ms > _LAST_MS:
            raise ValueError("cannot move the clock past 9999-12-31 (a datetime holds no "
                             "later time)")
        return target_ms

    def run_until_idle(self) -> None:
        """Deliver every run that can run now, and what they start or wake, until none
        can; the clock does not move."""
        self.engine.run_until_idle()

    # -- starting ---------------------------------------------------------------------------

    def start(self, workflow: str | WorkflowDef, input: Any = None, *,
              run_id: str | None = None) -> RunHandle:
        """Record a run of `workflow` (as the client's `start`: input validated, the same id
        again is the same run). Delivered by `run_until_idle`, `advance` or `result`."""
        name = workflow_name(workflow)
        gate = self.registry.workflow(name).gate
        if gate is not None:
            from ..flow.enqueue_gates import GateRefusedError

            raise GateRefusedError(f"workflow {name!r} has a {gate.kind}, which the test kit "
                                   f"does not apply: test it against Redis (a real stack)")
        raw = _input_bytes(self.registry.workflow(name), input, None, "give an input")
        record = prepare(RunRequest(name, raw, run_id or f"run-{next(self._ids)}",
                                    strict=True), self.registry)
        done = self.engine.store.record(record)
        return RunHandle(self, record.id, created=done.created, workflow=done.record.name,
                         queue=done.record.queue, dispatched=True,
                         initial_status=done.status)

    def handle(self, run_id: str) -> RunHandle:
        self._run(run_id)
        return RunHandle(self, run_id)

    # -- failure injection --------------------------------------------------------------------

    def fail_step(self, key: str, times: int = 1,
                  error: BaseException | type[BaseException] | None = None) -> None:
        """The next `times` attempts of the step call at ledger key `key` ("workflow.step#0";
        a step inside a step: "workflow.outer#0.inner#0") raise `error` (a RuntimeError by
        default) instead of running its body: its retries apply."""
        self.faults.fail(_call_key(key, "fail_step"), times, error)

    def mock_step(self, name_or_key: str, replacement: Any) -> None:
        """Replace the body of a step (by its name, or one call by its ledger key) with
        `replacement`: a callable taking the step's arguments, or the value to return. The
        step is still recorded (and replayed) as any other."""
        if isinstance(name_or_key, str) and "#" not in name_or_key:
            # A step runs from its own definition: it may be declared outside `registry`.
            steps = {**REGISTRY.steps, **self.registry.steps}
            if name_or_key not in steps:
                known = ", ".join(sorted(steps)) or "none"
                raise ValueError(f"mock_step: no step named {name_or_key!r} (known: {known}; "
                                 f"or give one call's ledger key, 'workflow.step#0')")
        else:
            _call_key(name_or_key, "mock_step")
        self.faults.mock(name_or_key, replacement)

    def crash_after(self, key: str) -> None:
        """The execution that commits the ledger entry `key` (a step's outcome, a fired
        timer, a received signal) stops right after, as a kill -9 would stop it; the run is
        delivered again and replays from its ledger (the step is not run again)."""
        self.engine.store.crash_after.add(_call_key(key, "crash_after"))

    # -- reading ------------------------------------------------------------------------------

    def _run(self, run_id: str) -> _Run:
        run = self.engine.store.runs.get(check_id(run_id, "run id"))
        if run is None:
            raise RunNotFoundError(f"no run with id {run_id!r}")
        return run

    def status_json(self, run: str | RunHandle) -> dict[str, Any]:
        """`status --json`'s document for the run, as the client's."""
        run_id = _id(run)
        state = self._run(run_id)
        view = self.engine.store.get(run_id)
        assert view is not None
        data = view.to_json()
        now = self.engine.now_ms()
        data["questions"] = [q.to_json(now) for q in
                             self.engine.store.waits().questions(run_id)]
        data["reports"] = [Report(run_id, r).to_json() for r in state.reports.values()]
        data["published"] = dict(sorted(state.published.items()))
        data["signals"] = {name: {"sent": len(box.payloads), "taken": box.taken,
                                  "buffered": len(box.payloads) - box.taken}
                           for name, box in sorted(state.signals.items())}
        return data

    def status(self, run: str | RunHandle) -> RunStatus:
        run_id = _id(run)
        return msgspec.convert(self.status_json(run_id), RunStatus)

    def result(self, run: str | RunHandle, timeout: float | None = None, *,
               type: Any = Any) -> Any:
        """The run's result, after delivering what can run now (the clock does not move):
        RunFailedError, RunCancelledError as the client's; ResultTimeoutError when it has
        not finished then (it waits: advance the clock, answer it, signal it ...)."""
        run_id = _id(run)
        state = self._run(run_id)
        self.run_until_idle()
        if state.status not in TERMINAL:
            raise ResultTimeoutError(
                f"run {run_id} has not finished: it is {state.status}"
                + (f" ({state.wait_reason})" if state.status == "waiting" else "")
                + "; advance the clock or do what it waits for")
        final = next(e.data for e in reversed(state.output) if e.type == "final")
        return settle(run_id, dict(final), type)

    def children(self, run: str | RunHandle) -> list[RunHandle]:
        """The runs `run` started as its children, in the order they were recorded."""
        run_id = _id(run)
        self._run(run_id)
        return [RunHandle(self, cid, workflow=r.record.name, queue=r.record.queue)
                for cid, r in self.engine.store.runs.items() if r.record.parent == run_id]

    def runs(self) -> list[RunHandle]:
        """Every run in the environment, in the order they were recorded."""
        return [RunHandle(self, rid) for rid in self.engine.store.runs]

    def output(self, run: str | RunHandle) -> list[Any]:
        """The run's output events (type, delivery, data), as `watch` shows them."""
        run_id = _id(run)
        return list(self._run(run_id).output)

    def watch(self, run_id: str, *, after: str = "0-0", follow: bool = True
              ) -> Iterator[OutputEntry]:
        """The run's output entries after `after` (following: after delivering what can
        run now; the clock does not move)."""
        if follow:
            self.run_until_idle()
        seen = after == "0-0"
        for event in self.output(run_id):
            if seen:
                yield entry_of(event)
            seen = seen or event.id == after

    def wait_for(self, run_id: str, key: str, timeout: float = 60.0) -> Any:
        """The value the run published under `key`, after delivering what can run now."""
        self._run(run_id)
        self.run_until_idle()
        return self.get(run_id, key)

    def get(self, run_id: str, key: str) -> Any:
        from ..engine.published import NotPublishedError

        run = self._run(run_id)
        if key not in run.published:
            raise NotPublishedError(f"run {run_id} has not published {key!r}")
        return run.published[key]

    def artifact(self, name: str) -> Any:
        """`client.artifact(name)` over this environment's artifacts (kept in memory)."""
        from ..artifacts.handle import ClientArtifact
        from ..artifacts.memory import artifacts_for

        return ClientArtifact(artifacts_for(self.engine.store), name)

    def artifacts(self) -> list[Any]:
        from ..artifacts.memory import artifacts_for

        return artifacts_for(self.engine.store).listing()

    # -- acting, as the client's calls -----------------------------------------------------------

    def cancel(self, run_id: str, *, compensate: bool = False) -> Outcome:
        self._run(run_id)
        outcome, children = self.engine.cancel(run_id, compensate=compensate)
        view = self.engine.store.get(run_id)
        now = view.status if view is not None else "gone"
        return Outcome(run_id, outcome, {
            "cancelled": f"run {run_id} cancelled",
            "compensating": f"run {run_id} compensated; it ended {now}" if now in TERMINAL
            else f"run {run_id} is compensating ({now})",
            "settled": f"run {run_id} has already finished; nothing to cancel"}.get(
                outcome, outcome), children)

    def pause(self, run_id: str) -> Outcome:
        self._run(run_id)
        outcome = self.engine.store.waits().pause(run_id)
        if outcome == "settled":
            raise RunSettledError(f"run {run_id} has already finished; nothing to pause")
        return Outcome(run_id, outcome, {"paused": f"run {run_id} paused",
                                         "already": f"run {run_id} is already paused"}[outcome])

    def resume(self, run_id: str) -> Outcome:
        self._run(run_id)
        outcome = self.engine.store.waits().resume(run_id)
        if outcome == "not_paused":
            raise NotPausedError(f"run {run_id} is not paused; nothing to resume")
        if outcome == "settled":
            raise RunSettledError(f"run {run_id} has already finished; nothing to resume")
        return Outcome(run_id, "woken", f"run {run_id} resumed")

    def retry(self, run: str | RunHandle, input_patch: Any = None) -> Outcome:
        """As the client's retry: run the step the run is paused on (on_exhausted="pause")
        again, `input_patch` merged over its arguments first (engine/input_patch.py)."""
        from ..engine import failed_steps

        run_id = run.id if isinstance(run, RunHandle) else run
        self._run(run_id)
        done = failed_steps.retry(self.engine.store.waits(), self.engine.store.get(run_id),
                                  run_id, input_patch, self.registry)
        return Outcome(run_id, "retried", f"run {run_id}: step {done.step} retried")

    def fail(self, run: str | RunHandle, reason: str | None = None) -> Outcome:
        """As the client's fail: give up the step the run is paused on."""
        from ..engine import failed_steps

        run_id = run.id if isinstance(run, RunHandle) else run
        self._run(run_id)
        done = failed_steps.fail(self.engine.store.waits(), self.engine.store.get(run_id),
                                 run_id, reason)
        return Outcome(run_id, "failed", f"run {run_id}: step {done.step} given up")

    def answer(self, run_id: str, key: str, value: Any) -> Outcome:
        return self._answer(run_id, key, value, "question")

    def approve(self, run_id: str, key: str, note: str | None = None) -> Outcome:
        return self._answer(run_id, key, {"approved": True, "note": _note(note)}, "approval")

    def reject(self, run_id: str, key: str, note: str | None = None) -> Outcome:
        return self._answer(run_id, key, {"approved": False, "note": _note(note)}, "approval")

    def _answer(self, run_id: str, key: str, value: Any, kind: str) -> Outcome:
        """As WaitStore.answer: the same refusals, the first answer wins."""
        run = self._run(run_id)
        waits = self.engine.store.waits()
        found = next((q for q in waits.questions(run_id) if q.key == key), None)
        if found is None:
            known = ", ".join(q.key for q in waits.questions(run_id)) or "it has asked none"
            raise UnknownQuestionError(f"run {run_id} has no question {key!r} ({known})")
        value = answer_of_kind(found, run_id, key, value, kind)
        if run.status in TERMINAL:
            raise AlreadyAnsweredError(f"run {run_id} has already finished ({run.status}); "
                                       f"nothing recorded")
        if found.state != "open":
            state = {"timed_out": "closed (it timed out)"}.get(found.state, found.state)
            raise AlreadyAnsweredError(f"{key!r} of run {run_id} is already {state}")
        woken = waits.answer(run_id, key, value) == "woken"
        tail = "; run woken" if woken else "; the run sees it when it next replays"
        return Outcome(run_id, "answered", f"run {run_id}: {key} answered{tail}")

    def signal(self, run_id: str, name: str, payload: Any = None, *,
               request_id: str | None = None) -> SignalSent:
        """Send signal `name` (as the client's: buffered until the run takes it; a run
        waiting for it is woken)."""
        self._run(run_id)
        check_name(name)
        seq, woken = self.engine.store.send_signal(run_id, name, encode_payload(payload))
        return SignalSent(run_id, name, seq, woken, woken)

    def send_event(self, source: str, type: str | None = None, payload: Any = None, *,
                   id: str | None = None) -> Any:
        """Receive an inbound event (as `client.send_event`): it starts the run of the
        `@mr.on_event` trigger it matches (under the event's key, as in production) and is
        delivered to the runs waiting for it (`wait_for_event`); the same (source, id)
        again is received once. Returns the `Sent` the client returns."""
        from ..triggers.events import TRIGGERS, Sent, prepare_event, run_input

        event_id = id or f"kit-{next(self._ids)}"
        raw = encode_json(payload, "the payload")  # as the client's send_event
        record, trigger = prepare_event(source, event_id, type=type or "", payload=raw,
                                        registry=self.registry, triggers=TRIGGERS)
        if trigger is not None and trigger.batch is not None:
            raise NotImplementedError(
                f"the test kit does not batch events (the trigger of {trigger.label} declares "
                f"batch=); start {trigger.workflow!r} with a list of mr.Event instead")
        record = msgspec.structs.replace(record, received_at_ms=self.engine.now_ms())
        if record.id in self._events:
            return dataclasses.replace(self._events[record.id], created=False,
                                       run_created=False, delivered=())
        run_id, created = "", False
        if trigger is not None:
            run_record = prepare(RunRequest(trigger.workflow, run_input(record), record.id,
                                            origin="event"), self.registry)
            created = self.engine.store.record(run_record).created
            run_id = record.id
        delivered = self.engine.store.offer_event(record, msgspec.json.decode(raw))
        sent = Sent(record.id, True, "started" if trigger is not None else "unmatched",
                    trigger.workflow if trigger is not None else "", run_id, created,
                    tuple(sorted(delivered)))
        self._events[record.id] = sent
        return sent


_CALL_KEY = re.compile(r"\S+#\d+")


def _call_key(key: str, what: str) -> str:
    """`key` if it has the shape of a call's ledger key; else ValueError (a step's bare name
    or a typo would never match, and the injection would silently do nothing)."""
    if not isinstance(key, str) or not _CALL_KEY.fullmatch(key):
        raise ValueError(f"{what}: {key!r} is not a ledger key such as 'workflow.step#0' "
                         f"(the n-th call of the step in that frame; status().steps lists them)")
    return key


def _id(run: str | RunHandle) -> str:
    return run.id if isinstance(run, RunHandle) else run


def _schedule_registry(registry: ScheduleRegistry | None,
                       keys: list[str] | None) -> ScheduleRegistry:
    from ..triggers.schedule_spec import SCHEDULES

    registry = SCHEDULES if registry is None else registry
    for key in keys or []:
        registry.get(key)  # UnknownScheduleError for a key not declared
    return registry


__all__ = ["Environment"]
