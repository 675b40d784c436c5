"""Flow control: concurrency limits enforced in the store, and run priorities.

**Concurrency limits.** ``@mr.workflow(concurrency=N)`` lets at most N runs of the workflow
execute at once across the fleet; with ``concurrency_key="customer"``, at most N per value
of that input field. The limit and its key's value are fixed when the run is recorded
(`prepare`) and kept in the run hash's `limit` field ("<N>|<limit id>|<label>"). A limit's
slots are keys of their own, under their own hash tag (`Keyspace.limit_slots`): a sorted set
run id -> expiry, and the holder of each (attempt and execution token).

A delivery of a limited run:

1. `start_attempt` answers ``needs_slot`` (it writes nothing: a run with a limit starts
   only with a slot; an unlimited run pays nothing, the field is read with the others);
2. `acquire_slot` prunes expired holds, counts the live ones and adds this run if there is
   room (one script on the limit's slot: no cross-slot operation on a cluster);
3. full: `hold_run` hands the run back, not started: queued again as a new delivery (not
   counted against max_deliveries) that the controller's dispatch check enqueues after a
   short delay, jittered, growing 1.5x per hold up to HOLD_CAP_MS; `status` shows why
   ("concurrency limit customer=acme 5/5");
4. else `start_attempt` again, with the slot: the run starts, its lease capped at the
   hold's expiry. The watchdog extends the hold right before each lease renewal
   (`renew_slot`) and caps the lease at the hold's new expiry, so a live lease always lies
   within a live hold, and the scripts refuse the writes of an expired lease: at most N
   executions of a limit commit at once. A lapsed hold is taken again only when a slot is
   free (else the execution is fenced). The execution releases its hold when it ends
   (settled, parked, handed back, stopped). A killed execution's hold expires with its
   lease; a lost worker's runs, and runs the reaper settles, have theirs released by the
   controller.

**Priorities.** A run's priority (``RunRequest(priority=...)``, ``enqueue --priority``, the
workflow's default) is an integer from PRIORITY_MIN to PRIORITY_MAX, higher first. Priority
0 is the queue's own RQ queue; any other is an RQ queue of its own, a *band*:
``<prefix>.<queue>~<priority>`` (``~`` is not allowed in queue names and is not ``.``, so
the prefix is still everything before the last ``.``). The band is recorded with the run
(the run hash's `queue` field, which every redelivery reads), so redeliveries keep it.
Workers learn which bands exist from RQ's queues set (transport/lean.py) and pop a queue's
bands high to low.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import redis

from ..errors import RedisUnavailableError
from ..store.redis_errors import one_line
from ..store.replies import as_text
from .limit_specs import MAX_KEY_VALUE

if TYPE_CHECKING:
    from ..engine.authoring import WorkflowDef
    from ..engine.runs import RunStore, Started
    from ..store.keys import Keyspace

log = logging.getLogger("marbles_rq.flow.limits")

# A held run is looked at again after HOLD_BASE_MS, then 1.5x longer per hold, at most
# HOLD_CAP_MS, each jittered by +-25 %: runs held together do not come back together, and a
# long wait costs a delivery every ~2 s, never a hot loop.
HOLD_BASE_MS = 250
HOLD_CAP_MS = 2_000


# -- definitions and requests ------------------------------------------------------------------


def limit_of(definition: WorkflowDef, recorded_input: bytes) -> tuple[int, str]:
    """(limit, label) of a run of `definition` with this (validated, recorded) input:
    (0, "") without a limit. Raises InputError when the key's field is missing or not a
    string or a whole number."""
    from ..engine.authoring import InputError

    if not definition.concurrency:
        return 0, ""
    key_field = definition.concurrency_key
    if key_field is None:
        return definition.concurrency, ""
    value = msgspec.json.decode(recorded_input)
    if not isinstance(value, dict) or key_field not in value:
        raise InputError(f"workflow {definition.name!r} limits concurrency per input field "
                         f"{key_field!r}, which the input does not have")
    found = value[key_field]
    if isinstance(found, bool) or not isinstance(found, str | int):
        raise InputError(f"input field {key_field!r} (the concurrency key of workflow "
                         f"{definition.name!r}) must be a string or a whole number, not "
                         f"{type(found).__name__}")
    text = str(found)
    if not text or len(text) > MAX_KEY_VALUE:
        raise InputError(f"input field {key_field!r} (the concurrency key of workflow "
                         f"{definition.name!r}) must be 1 to {MAX_KEY_VALUE} characters")
    return definition.concurrency, f"{key_field}={text}"


# -- slots -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    limit: int
    limit_id: str
    label: str

    @classmethod
    def parse(cls, text: str) -> Limit | None:
        parts = text.split("|", 2)
        if len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) < 1 or not parts[1]:
            return None
        return cls(int(parts[0]), parts[1], parts[2])


@dataclass
class Slot:
    """A slot this execution holds (attempt and token identify the holder)."""

    runs: RunStore
    limit: Limit
    run_id: str
    attempt: int
    token: str
    ttl_ms: int
    # The hold's expiry as last set (server ms): the lease is capped there, so a live lease
    # always lies within a live hold and an execution cannot write once its hold lapsed.
    until: int = 0
    # A renewal (the watchdog's thread) in flight when the execution releases its slot
    # would take it again after the release (a renewal re-takes an expired hold): the two
    # go one at a time, and nothing renews once released.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: bool = False

    @property
    def _keys(self) -> dict[str, str]:
        keys: Keyspace = self.runs.keys
        return dict(slots_key=keys.limit_slots(self.limit.limit_id),
                    holders_key=keys.limit_holders(self.limit.limit_id))

    def renew(self) -> int:
        """Before each lease renewal (the watchdog's thread): the cap for the lease, the
        hold's expiry (as last known when the renewal fails: the lease then ends with the
        hold), or 1 when the hold is lost (it lapsed and every slot is taken: the lease
        renewal then fences the execution)."""
        with self._lock:
            if not self._released:
                self._renew()
            return self.until

    def _renew(self) -> None:
        try:
            reply = self.runs.scripts.renew_slot(**self._keys, run_id=self.run_id,
                                                 attempt=self.attempt, token=self.token,
                                                 ttl_ms=self.ttl_ms, limit=self.limit.limit)
        except (redis.RedisError, RedisUnavailableError, OSError) as exc:
            log.warning("run %s: cannot renew its concurrency slot (%s)", self.run_id,
                        one_line(exc))
            return
        if reply.status == "ok":
            self.until = int(reply.values[1])
            if int(reply.values[0]) == 1:
                log.warning("run %s: its concurrency slot (%s) had expired; taken again",
                            self.run_id, self.limit.label)
        else:  # lost, or a newer delivery holds it: this execution must not go on
            self.until = 1
            log.warning("run %s: its concurrency slot (%s) is %s; stopping", self.run_id,
                        self.limit.label, reply.status)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            self._release()

    def _release(self) -> None:
        try:
            self.runs.scripts.release_slot(**self._keys, run_id=self.run_id,
                                           holder=f"{self.attempt}|{self.token}")
        except (redis.RedisError, RedisUnavailableError, OSError) as exc:
            log.warning("run %s: cannot release its concurrency slot (%s); it expires with "
                        "the lease", self.run_id, one_line(exc))


def release_vanished(runs: RunStore, run_id: str, attempt: int, limit_text: str) -> None:
    """The controller redelivered (or settled) a run whose execution vanished: free the slot
    that delivery `attempt` held, so waiting runs need not wait for its expiry."""
    limit = Limit.parse(limit_text)
    if limit is None:
        return
    keys = runs.keys
    try:
        runs.scripts.release_slot(slots_key=keys.limit_slots(limit.limit_id),
                                  holders_key=keys.limit_holders(limit.limit_id),
                                  run_id=run_id, holder=f"{attempt}|*")
    except (redis.RedisError, RedisUnavailableError, OSError) as exc:
        log.warning("run %s: cannot release its concurrency slot (%s); it expires", run_id,
                    one_line(exc))


def start(runs: RunStore, run_id: str, attempt: int, *, ttl_ms: int, worker: str) -> Started:
    """`RunStore.start`, taking the run's concurrency slot first when it has a limit. A run
    whose limit is full is handed back (status "held"); the slot of a started execution is
    `execution.slot`."""
    from ..engine.runs import Started

    started = runs.start(run_id, attempt, ttl_ms=ttl_ms, worker=worker)
    if started.status != "needs_slot":
        return started
    limit = Limit.parse(started.detail)
    if limit is None:
        return Started("corrupt", detail=f"corrupt record at {runs.keys.run(run_id)}: field "
                                         f"limit is {started.detail!r}")
    keys = runs.keys
    token = uuid.uuid4().hex[:12]
    reply = runs.scripts.acquire_slot(
        slots_key=keys.limit_slots(limit.limit_id),
        holders_key=keys.limit_holders(limit.limit_id), run_id=run_id, attempt=attempt,
        token=token, limit=limit.limit, ttl_ms=ttl_ms)
    if reply.status == "stale":
        return Started("stale_attempt", detail=as_text(reply.values[0]))
    if reply.status == "full":
        held = int(reply.values[0])
        note = f"concurrency limit {limit.label} {held}/{limit.limit}"
        hold = runs.scripts.hold_run(
            keys=keys.run_keys(run_id), run_id=run_id, attempt=attempt, base_ms=HOLD_BASE_MS,
            cap_ms=HOLD_CAP_MS, jitter=random.uniform(0.75, 1.25), note=note,
            event=msgspec.json.encode({"reason": note, "previous": attempt}))
        log.info("run %s delivery %s: %s; held (%s)", run_id, attempt, note,
                 hold.status if hold.status != "ok" else f"retry in {as_text(hold.values[1])} ms")
        return Started("held", detail=note)
    slot = Slot(runs, limit, run_id, attempt, token, ttl_ms, until=int(reply.values[1]))
    try:
        started = runs.start(run_id, attempt, ttl_ms=ttl_ms, worker=worker, slot=True,
                             slot_until=slot.until)
    except BaseException:
        slot.release()  # nothing started under it (or the start's outcome is unknown: the
        raise           # run is then redelivered once its lease expires, and takes it again)
    if started.status == "ok" and started.execution is not None:
        started.execution.slot = slot
    elif started.status != "busy":  # busy: another execution of this delivery holds it
        slot.release()
    return started
