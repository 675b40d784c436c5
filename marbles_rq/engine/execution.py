"""One execution of a run's delivery, as every module that writes for it sees it: its fence
(epoch and write numbers), lease, ledger and deferred step starts; and the small values the
run-state modules share (the journal's event payloads, the dispatch grace, a missing run).

Runs in the store (engine/runs.py) and runs that wait (engine/waits.py) both build on this;
it imports neither.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..errors import MarblesError
from ..payloads.fields import run_holder, seal_record
from ..store.keys import RunKeys
from ..store.records import RunRecord, StepRecord, encode

DISPATCH_GRACE_MS = 5_000


def event(**data: Any) -> bytes:
    return msgspec.json.encode(data)


class RunNotFoundError(MarblesError):
    code = "run_not_found"


@dataclass(eq=False)
class StepStart:
    """The start of a step attempt, not written yet. A step with no retries costs one
    round trip: its commit writes this start with the outcome. Any other write of the
    execution writes it first (so the output keeps its order), and so does the watchdog once
    `due` (monotonic) has passed, so a step that runs longer shows as running."""

    key: str
    record: StepRecord  # status running; stamped with its place when it is written
    event: bytes  # data of its step_started event: step, attempt, started_ms (server clock)
    due: float

    def triple(self, ex: Execution, store: Any) -> tuple[str, bytes, bytes]:
        """The start as the scripts write it, under the execution's current write number
        (its user values sealed for `store`: payloads/fields.py)."""
        return self.key, step_doc(store, ex, stamp(self.record, ex)), self.event


@dataclass(eq=False)
class HeldCommit:
    """A step's success, not written yet (RunStore.hold_commit): the execution's next write
    writes it first, its settle in the same round trip, the watchdog once `due` (monotonic)
    has passed. So the last step of a run costs no round trip of its own."""

    record: StepRecord
    event_type: str
    event: bytes
    due: float


@dataclass
class Execution:
    """One execution of one delivery: the epoch fences everything it writes."""

    run_id: str
    attempt: int
    epoch: int
    keys: RunKeys
    ttl_ms: int
    record: RunRecord
    deadline_ms: int
    ledger: dict[str, StepRecord] = field(default_factory=dict)
    # Each fenced write carries the next number; the scripts apply a number once, so a
    # resend after a timeout is a no-op. The lock keeps numbers in send order.
    seq: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    output_capped: bool = False  # the run's output cap was reached: later lines are dropped
    # The server clock when this execution started, and the local monotonic clock then:
    # timers are due on the server clock, and a replayed timer is fired iff its due time is
    # at or before the start (the controller wakes it only once the server clock passed it).
    server_ms: int = 0
    mono_at_start: float = field(default_factory=time.monotonic)
    # Deferred step starts not written yet, oldest first (under `lock`; see StepStart).
    starts: dict[int, StepStart] = field(default_factory=dict)
    # A step's success held for the next write (under `lock`; see HeldCommit), and the reply
    # of one the watchdog wrote that the body has still to act on (paused).
    held: HeldCommit | None = None
    held_reply: str = ""
    # When (monotonic) a reply last said the run was not cancelled, paused or past its
    # deadline: start_attempt, start_step or commit_step (measured before the send).
    flags_at: float = field(default_factory=time.monotonic)
    # The concurrency slot this execution holds (flow/limits.Slot), renewed with its lease.
    slot: Any = None
    # The locks it holds (flow/locks.Hold), renewed with its lease like the slot.
    locks: list[Any] = field(default_factory=list)
    # When (monotonic, before the send) the lease was last set: start_attempt, a renewal, or
    # a commit that extended it. A commit extends it only when the watchdog's renewals
    # (every third of the lease) fell behind: past half the lease.
    lease_at: float = field(default_factory=time.monotonic)
    # What start_attempt counted: 1 + redeliveries, wakes after a park, and what made this
    # execution (first | redelivery | resumption | handback). `attempt` above is the delivery
    # number, which every new delivery moves (a resumption too).
    tries: int = 1
    resumptions: int = 0
    kind: str = "first"
    # The keys of the questions the body's asks looked up (engine/waiting.py), kept by a
    # replay check (engine/replay_check.py) to tell a question no longer asked; None: not kept.
    asks_seen: set[str] | None = None
    # A replay check (engine/replay_check.py): the body runs against its ledger and stops
    # where it would do new work (a step not recorded), so no step body ever runs.
    replay_only: bool = False
    # The ledger keys of the patch decisions this execution read or took (engine/patches.py).
    patches_seen: set[str] = field(default_factory=set)
    # A virtual clock (epoch ms) that replaces the server's for this execution: runs in
    # memory (engine/memory_store.py: the dry run, the test kit) read their time from it.
    clock: Callable[[], int] | None = None
    # A rate limit's admission (server ms) the next step started records as its start
    # (flow/rate_limits.py); 0 when none is pending.
    admitted_ms: int = 0
    # The test kit's overrides of step bodies (marbles_rq/testing: mocks, injected
    # failures): given the step's ledger key and definition, the definition to run.
    override_step: Callable[[str, Any], Any] | None = None
    # The ledger keys of the undos this execution registered, in order (unlike the entries
    # read at the start, its own are not stamped with their place yet: compensation.py).
    undos: list[str] = field(default_factory=list)

    def server_now_ms(self) -> int:
        """The server clock now, as far as this process can tell without asking: never
        behind it (a timer due this far ahead must not end early), so the local clock runs
        from before the start request was sent, and partial milliseconds round up."""
        if self.clock is not None:
            return self.clock()
        return self.server_ms + math.ceil((time.monotonic() - self.mono_at_start) * 1000)


def stamp(record: StepRecord, ex: Execution, after: int = 0) -> StepRecord:
    """`record` with its place in the run's commit order: the execution's epoch and the write
    number it is sent under (`after` more for entries of one write that must keep their
    order, such as a park's). Under ex.lock, after `ex.seq` was raised for the write."""
    return msgspec.structs.replace(record, epoch=ex.epoch, wseq=ex.seq + after)


def step_doc(store: Any, ex: Execution, record: StepRecord) -> bytes:
    """A ledger entry of `ex`'s run as stored: its user values through the codec."""
    return encode(seal_record(store, record, run_holder(ex.run_id)))


def take_due_starts(ex: Execution, now: float) -> list[StepStart]:
    """Under ex.lock: the deferred starts due by `now` (monotonic), taken off the list."""
    due = [s for s in ex.starts.values() if s.due <= now]
    for start in due:
        del ex.starts[id(start)]
    return due
