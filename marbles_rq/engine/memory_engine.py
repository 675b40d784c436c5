"""An engine in process memory: runs delivered one after the other by the real executor
(engine/execute.py: the same replay, steps, retries, asks, timers, signals, children and
parallel branches as on a worker), over runs kept in memory (engine/memory_store.py), on a
virtual clock that moves only when told to. What the controller does on Redis (wake a run
whose timer or timeout came due, time out a run past its deadline, deliver a queued run) it
does here, each at its exact instant on that clock. The dry run (engine/dryrun.py) and the
test kit (marbles_rq/testing) are both this engine.

    engine = MemoryEngine()
    engine.store.record(record)
    engine.run_until_idle()            # deliver everything that can run now
    engine.advance_to(ms)              # move the clock, firing what comes due in order
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from ..errors import MarblesError
from .authoring import REGISTRY, Registry, StepDef
from .context import Limits
from .execute import execute
from .memory_store import MEMORY_WORKER, Crashed, MemoryRuns, VirtualClock
from .runs import TERMINAL, OutputEvent, RunStore

LEASE_MS = 3_600_000  # no lease to keep: the watchdog renews in memory, rarely
MAX_DELIVERIES = 100_000  # per run_until_idle: a workflow that never stops is an error


class Timed:
    """Something besides runs that comes due on the clock (a schedule: the test kit)."""

    def due_ms(self) -> int | None:
        """When it next comes due (None: never)."""
        raise NotImplementedError

    def fire(self, now_ms: int) -> None:
        """It came due at `now_ms` (the clock reads that now)."""
        raise NotImplementedError


class MemoryEngine:
    def __init__(self, registry: Registry = REGISTRY, *, start_ms: int | None = None,
                 limits: Limits | None = None, worker: str = MEMORY_WORKER,
                 on_event: Callable[[str, OutputEvent], None] | None = None) -> None:
        self.registry = registry
        self.clock = VirtualClock(start_ms)
        self.store = MemoryRuns(self.clock, on_event)
        self.store.worker = worker
        self.limits = limits or Limits()
        # The test kit's overrides of step bodies (Execution.override_step).
        self.override_step: Callable[[str, StepDef], StepDef] | None = None
        self.timed: list[Timed] = []
        self.deliveries = 0

    def now_ms(self) -> int:
        return self.clock.now_ms()

    # -- delivering ---------------------------------------------------------------------------

    def ready(self) -> list[str]:
        """The runs that can be delivered now, oldest queued first."""
        now = self.now_ms()
        runs = [(r.queued_ms, i, rid) for i, (rid, r) in enumerate(self.store.runs.items())
                if r.status == "queued" and r.queued_ms <= now]
        return [rid for _, _, rid in sorted(runs)]

    def deliver(self, run_id: str) -> str:
        """Execute the run's current delivery, as a worker would; the delivery's outcome
        ("crashed" after an injected crash: the run is queued again, a redelivery)."""
        run = self.store.runs[run_id]
        self.deliveries += 1
        self.store.override_step = self.override_step
        try:
            return execute(cast(RunStore, self.store), self.registry, run_id, run.attempt,
                           worker=self.store.worker, lease_ms=LEASE_MS, hard_exit=False,
                           limits=self.limits, deliver=None)
        except Crashed:
            self.store.crashed(run_id)
            return "crashed"
        except BaseException as exc:
            if isinstance(exc, (Exception, KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise  # the engine's own error, or the test process stopping: the caller's
            # What the executor does not take for the body's failure (a step raising a
            # BaseException of its own) ends a worker's work-horse: the run is redelivered.
            self.store.crashed(run_id, exc)
            return "crashed"

    def run_until_idle(self) -> None:
        """Deliver every run that can run now (and what they start or wake) until none
        can; the clock does not move."""
        for _ in range(MAX_DELIVERIES):
            ready = self.ready()
            if not ready:
                return
            self.deliver(ready[0])
        raise MarblesError(f"{MAX_DELIVERIES} deliveries without becoming idle: a run that "
                           f"never waits and never ends?")

    # -- the clock ------------------------------------------------------------------------------

    def next_due_ms(self) -> int | None:
        """When something next comes due: a wait's end, a deadline, a delayed start, or
        something timed (a schedule)."""
        dues: list[int] = []
        for run in self.store.runs.values():
            if run.status in TERMINAL:
                continue
            if run.deadline_ms:
                dues.append(run.deadline_ms)
            if run.status == "waiting" and run.wake_at_ms and not run.paused:
                dues.append(run.wake_at_ms)
            if run.status == "queued" and run.queued_ms > self.now_ms():
                dues.append(run.queued_ms)
        for timed in self.timed:
            due = timed.due_ms()
            if due is not None:
                dues.append(due)
        return min(dues, default=None)

    def fire_due(self) -> None:
        """What is due by now: deadlines first (a run past its deadline does not wake),
        then wakes, then the timed things."""
        now = self.now_ms()
        waits = self.store.waits()
        for run_id, run in list(self.store.runs.items()):
            if run.status in ("queued", "waiting") and run.deadline_ms and \
                    run.deadline_ms <= now:
                self.store.time_out(run_id)
        for run_id, run in list(self.store.runs.items()):
            if run.status == "waiting" and run.wake_at_ms and run.wake_at_ms <= now:
                waits.wake(run_id, "timer")
        for timed in self.timed:
            due = timed.due_ms()
            if due is not None and due <= now:
                timed.fire(now)

    def advance_to(self, target_ms: int) -> None:
        """Move the clock to `target_ms`, stopping at each instant something comes due on
        the way (in time order) to fire it and deliver what it wakes."""
        self.run_until_idle()
        for _ in range(MAX_DELIVERIES):
            due = self.next_due_ms()
            if due is None or due > target_ms:
                break
            self.clock.advance_to(due)
            self.fire_due()
            self.run_until_idle()
        else:
            raise MarblesError("the clock cannot get past a wait that keeps coming due")
        self.clock.advance_to(target_ms)
        self.fire_due()
        self.run_until_idle()

    def cancel(self, run_id: str, reason: str = "cancelled by request", *,
               compensate: bool = False) -> tuple[str, list[str]]:
        """Cancel a run (not running: nothing runs beside the caller) and its children.
        `compensate`: its registered undos run first (a delivery), then it ends cancelled."""
        if compensate:
            done = self.store.cancel_compensate(run_id)[0]
            children = [] if done in ("settled", "missing", "compensating") else (
                self.store.waits().cancel_children(run_id))
            self.run_until_idle()
            return ("compensating" if done in ("woken", "queued", "compensating") else done
                    ), children
        outcome = self.store.cancel(run_id, reason)
        children = [] if outcome != "cancelled" else self.store.waits().cancel_children(run_id)
        return outcome, children


__all__ = ["LEASE_MS", "MemoryEngine", "Timed"]
