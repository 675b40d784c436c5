"""Durable mutexes: ``with mr.lock("invoices", lease_s=30):`` in a body (``async with`` in an
async one) lets one run at a time hold ``"invoices"`` across the deployment.

**The lock.** Each key is a hash and a queue under a hash tag of its own
(`Keyspace.lock_state`, `lock_queue`): one script per transition (lua/acquire_lock.lua,
renew_lock.lua, release_lock.lua), on one slot of a cluster whatever the runs' buckets. The
holder is the run and the epoch of the execution that took it (the run's fence: every new
execution of a run has a higher one).

**Waiting parks the run.** A run that finds the lock held joins its queue (in the same
script: one FIFO per lock, in order of arrival) and parks, reason ``lock``: no worker is held.
Only the queue's head may take a free lock, and a newcomer never passes a waiting queue, so
runs get it in order of arrival. Who wakes a waiting run:

* *the release*: the holder's release answers the queue's head, and its worker wakes it
  at once (wake_run, cause ``lock``; a head that is executing is marked, and requeues itself
  when it parks); a head whose run is gone is dropped and the next one woken;
* *its own timer*, the safety net for a holder killed with the lock: the head wakes
  HEAD_GRACE_MS after the hold would lapse, the others a lease later. The controller fires
  timers like any other (after a restart too): a kill -9 anywhere strands no waiter.

**Fencing.** The holding execution renews its hold right before each renewal of its run's
lease (the watchdog's, every third of the lease), and its lease is capped at the hold's
expiry: a live lease always lies within a live hold, and the scripts refuse the writes of an
expired lease. A hold lapses ``max(lease_s, the worker's run lease)`` after its last renewal.
A hold whose execution vanished (kill -9) is taken over by the run's next execution at once
(a redelivery replays to the ``with`` and takes its own hold again), or taken by the queue's
head once it lapses; a waiter that finds the holder's run finished (reaped, cancelled while
parked) releases it at once. An older execution of the holder's run can neither renew nor
release the hold of a newer one (renew_lock answers stale or lost, and its lease renewal then
fences the execution).

**Recorded once.** Taking and giving back are ledger entries of their own
(``<frame>.|lock:<key>#<n>`` and ``<frame>.|unlock:<key>#<n>``, outside the frame's
positions, like a rate limit's admission), each held for the execution's next write. A replay
past a critical section that ended (its release recorded) takes nothing; a run redelivered
inside one (taken, not released) takes the lock again before it goes on, at once if nobody
else took it meanwhile, else in the queue. A lock added to code under running runs is not
taken by a replay that recorded calls past it without it.

A body that waits inside a critical section (``mr.sleep``, a question) keeps its hold while
parked only until it lapses; its resumed execution takes it again (waiting its turn if
another run took it meanwhile).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from ..engine.context import (
    Run,
    StopExecution,
    check_branch,
    check_not_in_foreign_thread,
    current,
)
from ..engine.waiting import ParkRun, Wait, deliver_now
from ..errors import MarblesError, RedisUnavailableError
from ..store.records import StepRecord
from ..store.redis_errors import one_line
from .lock_store import STALE_MS, Locks

if TYPE_CHECKING:
    from ..engine.execution import Execution
    from ..engine.runs import RunStore

log = logging.getLogger("marbles_rq.flow.locks")

LOCK_PREFIX = "|lock:"
UNLOCK_PREFIX = "|unlock:"
DEFAULT_LEASE_S = 60.0
MAX_LEASE_S = 86_400.0
MAX_KEY = 200
# The queue's head wakes this long after the holder's hold would lapse (a holder killed
# with the lock: nobody releases it); the others one lease later than that.
HEAD_GRACE_MS = 250
TERMINAL = ("succeeded", "failed", "cancelled")
_STORE_ERRORS = (redis.RedisError, RedisUnavailableError, OSError)


class LockError(MarblesError):
    """A lock key or lease that is not valid, or a lock taken again inside itself."""

    code = "invalid_lock"


def check_key(key: Any) -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY or "|" in key or any(
            ord(c) < 0x20 for c in key):
        raise LockError(f"invalid lock key {key!r}: 1 to {MAX_KEY} printable characters, "
                        f"no '|'")
    return key


def check_lease(lease_s: Any) -> float:
    if isinstance(lease_s, bool) or not isinstance(lease_s, int | float) or \
            not math.isfinite(lease_s) or not 0 < lease_s <= MAX_LEASE_S:
        raise LockError(f"invalid lock lease_s {lease_s!r}: a number of seconds above 0, "
                        f"at most {MAX_LEASE_S:g}")
    return float(lease_s)


def lock(key: str, *, lease_s: float = DEFAULT_LEASE_S) -> Lock:
    """A durable mutex on `key`: ``with mr.lock("invoices", lease_s=30):`` (``async with``
    in an async body). One run at a time holds it across the deployment; waiting for it
    parks the run (no worker held), and waiters get it in order of arrival. `lease_s`: how
    long the hold outlives its holder's last renewal (never less than the worker's run
    lease) when the holder vanished. Recorded: a replay past the block does not take it
    again."""
    return Lock(check_key(key), check_lease(lease_s))


@dataclass
class Hold:
    """A lock this execution holds, renewed with its lease."""

    locks: Locks
    name: str
    run_id: str
    epoch: int
    ttl_ms: int
    until: int
    # A renewal (the watchdog's thread) in flight when the body releases would take a
    # released hold's place: the two go one at a time, and nothing renews once released.
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: bool = False

    def renew(self) -> int:
        """Before each lease renewal: the cap for the lease, the hold's expiry (as last
        known when the renewal fails: the lease then ends with the hold), or 1 when the
        hold is lost (the lease renewal then fences the execution)."""
        with self._guard:
            if self._released:
                return 0
            try:
                status, until = self.locks.renew(self.name, self.run_id, self.epoch,
                                                 self.ttl_ms)
            except _STORE_ERRORS as exc:
                log.warning("run %s: cannot renew its lock %r (%s)", self.run_id, self.name,
                            one_line(exc))
                return self.until
            if status == "ok":
                self.until = until
            else:
                self.until = 1
                log.warning("run %s: its lock %r is %s; stopping", self.run_id, self.name,
                            status)
            return self.until

    def release(self) -> str:
        """Give it back (only this execution's hold): the queue's head to wake, or ""."""
        with self._guard:
            if self._released:
                return ""
            self._released = True
            try:
                status, head = self.locks.release(self.name, self.run_id, str(self.epoch))
            except _STORE_ERRORS as exc:
                log.warning("run %s: cannot release its lock %r (%s); it lapses", self.run_id,
                            self.name, one_line(exc))
                return ""
            return head if status == "ok" else ""


def wake_next(runs: RunStore, name: str, head: str, deliver: Any) -> None:
    """Wake the queue's head after a release; a head whose run is gone is dropped and the
    next one woken (a few at most: the others' timers do the rest)."""
    waits = runs.waits()
    for _ in range(5):
        if not head:
            return
        try:
            status, attempt, queue = waits.wake(head, "lock", detail={"lock": name})
            if status == "woken":
                deliver_now(deliver, queue, head, attempt)
                return
            if status != "idle" or runs.locks().status_of(head) not in (*TERMINAL, None):
                return
            _, head = runs.locks().release(name, "", "", drop=head)
        except (*_STORE_ERRORS, MarblesError) as exc:
            log.warning("cannot wake run %s for its lock %r (%s); its timer will", head, name,
                        one_line(exc))
            return


def release_held(runs: RunStore, ex: Execution, deliver: Any) -> None:
    """The execution ended holding locks (settled, stopped): give them back."""
    while ex.locks:
        hold = ex.locks.pop()
        head = hold.release()
        if head:
            wake_next(runs, hold.name, head, deliver)


class Lock:
    """What ``mr.lock(...)`` returns: a context manager, sync and async."""

    def __init__(self, key: str, lease_s: float) -> None:
        self.key, self.lease_s = key, lease_s
        self._run: Run | None = None
        self._hold: Hold | None = None
        self._release_key = ""

    def __repr__(self) -> str:
        return f"mr.lock({self.key!r}, lease_s={self.lease_s:g})"

    def __enter__(self) -> Lock:
        run = current("mr.lock")
        check_not_in_foreign_thread("mr.lock")
        check_branch()
        frame = run.frame
        marker = LOCK_PREFIX + self.key
        n = frame.counters[marker]
        frame.counters[marker] += 1
        take_key = f"{frame.path}.{marker}#{n}"
        self._release_key = f"{frame.path}.{UNLOCK_PREFIX}{self.key}#{n}"
        if self._release_key in run.ex.ledger:
            return self  # a critical section that ended: a replay takes nothing
        if take_key not in run.ex.ledger:
            from ..engine.patches import _passed

            if _passed(run):  # recorded past here before the lock was in the code
                return self
        if any(h.name == self.key for h in run.ex.locks):
            raise LockError(f"lock {self.key!r} is already held by this run (a lock is not "
                            f"re-entrant)")
        self._run = run
        self._hold = self._take(run, take_key)
        return self

    def _take(self, run: Run, take_key: str) -> Hold:
        ex = run.ex
        locks: Locks = run.runs.locks()
        ttl = max(int(self.lease_s * 1000), ex.ttl_ms)
        asked = run.call_store(locks.acquire, self.key, run.run_id, ex.epoch, ttl)
        if asked.status == "queued" and asked.holder and \
                run.call_store(locks.status_of, asked.holder) in (*TERMINAL, None):
            # The holder's run finished (reaped, cancelled while parked inside): free it.
            status, _ = run.call_store(locks.release, self.key, asked.holder,
                                          f"<= {2 ** 53}")
            log.info("run %s: lock %r held by finished run %s; released (%s)", run.run_id,
                     self.key, asked.holder, status)
            asked = run.call_store(locks.acquire, self.key, run.run_id, ex.epoch, ttl)
        if asked.status == "stale":
            raise StopExecution("stale")
        if asked.status == "queued":
            self._park(run, asked, ttl)
        hold = Hold(locks, self.key, run.run_id, ex.epoch, ttl, asked.until)
        ex.locks.append(hold)
        if take_key not in ex.ledger:
            data = {"lock": self.key, "since_ms": asked.since}
            run.hold_entry(StepRecord(version=1, key=take_key, name=LOCK_PREFIX + self.key,
                                      status="succeeded", attempts=0,
                                      result=msgspec.Raw(msgspec.json.encode(data)),
                                      at_ms=asked.since),
                           "lock_acquired", {"step": take_key, **data})
        return hold

    def _park(self, run: Run, asked: Any, ttl: int) -> None:
        now = run.ex.server_now_ms()
        if asked.until:  # held: the safety net for a holder that vanished with it
            wake = asked.until + HEAD_GRACE_MS + (ttl if asked.position else 0)
        else:  # free, another run's turn: drop it if it never comes
            wake = now + STALE_MS + HEAD_GRACE_MS
        raise ParkRun([Wait("lock", wake_at_ms=max(wake, now + 1), detail={"lock": {
            "name": self.key, "position": asked.position, "queued": asked.queued,
            "holder": asked.holder, "until_ms": asked.until}})])

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        run, hold = self._run, self._hold
        self._run = self._hold = None
        if run is None or hold is None:
            return
        if hold in run.ex.locks:
            run.ex.locks.remove(hold)
        if isinstance(exc, ParkRun):
            return  # waiting inside the critical section: the hold stays until it lapses
        head = hold.release()
        if head:
            wake_next(run.runs, self.key, head, run.deliver)
        if exc is not None and not isinstance(exc, Exception):
            return  # stopped (fenced, cancelled, the store gone): nothing more written
        at = run.ex.server_now_ms()
        data = {"lock": self.key, "released_ms": at}
        record = StepRecord(version=1, key=self._release_key, name=UNLOCK_PREFIX + self.key,
                            status="succeeded", attempts=0,
                            result=msgspec.Raw(msgspec.json.encode(data)), at_ms=at)
        if exc is None:
            run.hold_entry(record, "lock_released", {"step": self._release_key, **data})
            return
        try:  # the body's own error goes on; a refusal here must not hide it
            run.hold_entry(record, "lock_released", {"step": self._release_key, **data})
        except (StopExecution, *_STORE_ERRORS, MarblesError) as failed:
            log.warning("run %s: lock %r released; not recorded (%s)", run.run_id, self.key,
                        failed)

    async def __aenter__(self) -> Lock:
        return self.__enter__()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(kind, exc, tb)


__all__ = ["LOCK_PREFIX", "UNLOCK_PREFIX", "Hold", "Lock", "LockError", "lock",
           "release_held"]
