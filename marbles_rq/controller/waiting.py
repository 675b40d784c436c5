"""The controller's duty for waiting runs: wake a run when its timer or a question's
timeout comes due, or when a child it waits for has settled (a finished child's worker
wakes its parent at once; this check is the safety net, for a worker killed in between and
for children settled elsewhere: cancelled, reaped, timed out).

Like the schedules duty it serves from a thread of its own while this process leads, so a
timer's lateness is not bounded by the controller's pass interval. Every wake is fenced by
the controller's epoch in the run's bucket (wake_run).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import redis

from .. import metrics
from ..engine.execution import DISPATCH_GRACE_MS
from ..engine.runs import TERMINAL
from ..errors import MarblesError
from ..store.redis_errors import one_line
from ..store.replies import as_text

if TYPE_CHECKING:
    from .context import DutyContext

log = logging.getLogger("marbles_rq.controller.waiting")

DUE_BATCH = 500       # due waits read per bucket per pass
POLL_MS = 1_000       # the thread looks at least this often
MIN_WAIT_MS = 5       # and takes due waits in batches at least this far apart
RECOVERY_ROUNDS = 10_000
CHILD_RECHECK_MIN_MS = 2_000
CHILD_RECHECK_MAX_MS = 30_000


@dataclass
class WaitingStats:
    woken: int = 0
    lateness_ms: list[int] = field(default_factory=list)  # kept when measuring (bench)


class WaitingDuty:
    kind = "waiting"

    def __init__(self, *, threaded: bool = True, measure: bool = False) -> None:
        self.threaded = threaded
        self.measure = measure
        self.stats = WaitingStats()
        self._thread: threading.Thread | None = None
        self._thread_epoch = 0

    def recover(self, ctl: DutyContext) -> int:
        """Wake everything that came due while no controller led (timers included)."""
        done = 0
        for _ in range(RECOVERY_ROUNDS):
            if ctl.lease is None:
                break
            handled, woken = self.wake_due(ctl)
            done += woken
            if not handled:
                break
        return done

    def tick(self, ctl: DutyContext) -> None:
        if not self.threaded:
            self.wake_due(ctl)
            return
        thread = self._thread
        if thread is None or not thread.is_alive() or self._thread_epoch != ctl.epoch:
            self._thread_epoch = ctl.epoch
            self._thread = threading.Thread(target=self._serve, args=(ctl, ctl.epoch),
                                            name="marbles-waiting", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """The controller stopped leading this lane (its stop event is set): wait for the
        thread to finish what it was doing, so the lease is released after its last write."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _serve(self, ctl: DutyContext, epoch: int) -> None:
        try:
            while ctl.leads(epoch):
                handled, _ = self.wake_due(ctl)
                if handled:
                    # Busy (timers coming due faster than a pass): look again after the
                    # batching pause without reading the soonest entry and the clock first.
                    # Those two round trips made every busy pass longer, and a pass's length
                    # is what a timer due just after its read waits (bench/waits.py: wake
                    # lateness p99 with 10,000 timers due over 60 s).
                    wait = MIN_WAIT_MS
                else:
                    soonest = ctl.soonest(ctl.keys.run_waits)
                    wait = POLL_MS if soonest is None else soonest - ctl.server_ms()
                ctl.stop_event.wait(min(POLL_MS, max(MIN_WAIT_MS, wait)) / 1000)
        except (redis.RedisError, MarblesError, OSError) as exc:
            log.error("waiting runs: %s; the next pass starts again", one_line(exc))

    def wake_due(self, ctl: DutyContext) -> tuple[int, int]:
        """Wake the waiting runs that are due: (entries handled, runs woken)."""
        keys, client = ctl.keys, ctl.store.client
        now_ms = ctl.server_ms()
        due = ctl.due(keys.run_waits, now_ms, DUE_BATCH)
        if not due or ctl.lease is None:
            return 0, 0
        epoch = ctl.epoch
        pipe = client.pipeline(transaction=False)
        for _, run_id in due:
            pipe.hmget(keys.run(run_id), "status", "wait_reason", "wait_for", "wait_since",
                       "wake_at", "epoch")
        states = pipe.execute(raise_on_error=False)
        wakes: list[tuple[str, str]] = []  # (run id, cause)
        timers: dict[str, int] = {}  # run id -> when its timer was due (metrics)
        # (run id, children, waiting since, its questions, its timer's due ms or 0, its epoch
        # as read: the recheck below moves the run's entry only while it is unchanged)
        child_waits: list[tuple[str, list[str], int, list[str], int, str]] = []
        for (_, run_id), st in zip(due, states, strict=True):
            if isinstance(st, Exception) or st[0] != b"waiting" or st[1] == b"paused":
                wakes.append((run_id, "timer"))  # the script sorts out what it is now
                continue
            try:
                wait_for = msgspec.json.decode(st[2] or b"{}")
                children = [str(c) for c in wait_for.get("children", [])]
                questions = [str(q) for q in wait_for.get("questions", [])]
                until = int(wait_for.get("until_ms") or 0)
            except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
                children, questions, until = [], [], 0
            if not children:
                wakes.append((run_id, "child" if st[1] == b"child" else "timer"))
                if st[1] == b"timer" and until:
                    timers[run_id] = until
                continue
            # Whatever its reason: parallel branches may wait for a child and for a question
            # or a timer at once. (Keyed on the reason alone, a run that also asked was woken
            # at every check of its child, and one that also slept not before its child
            # finished.)
            child_waits.append((run_id, children, int(st[3] or now_ms), questions, until,
                                as_text(st[5] or b"")))
        recheck: list[tuple[str, str, int]] = []  # (run id, its epoch read, when)
        if child_waits:
            pipe = client.pipeline(transaction=False)
            for run_id, children, _, questions, _, _ in child_waits:
                for cid in children:
                    pipe.hget(keys.run(cid), "status")
                if questions:
                    pipe.hmget(keys.asks(run_id), [f"{q}|timeout_at" for q in questions])
            replies = iter(pipe.execute(raise_on_error=False))
            for run_id, children, since, questions, until, run_epoch in child_waits:
                found = [next(replies) for _ in children]
                timeouts = next(replies) if questions else []
                if any(not isinstance(s, bytes) or s.decode() in TERMINAL for s in found):
                    wakes.append((run_id, "child"))
                    continue
                # What else it waits for comes due at its own time: its timer, the
                # timeouts of its questions (wake_run closes those that passed).
                try:
                    deadlines = [until] if until else []
                    deadlines += [int(t) for t in timeouts if t]
                except (TypeError, ValueError):  # unreadable: the script sorts it out
                    wakes.append((run_id, "timer"))
                    continue
                if deadlines and min(deadlines) <= now_ms:
                    wakes.append((run_id, "timer"))
                    continue
                waited = now_ms - since
                recheck.append((run_id, run_epoch, min([now_ms + min(CHILD_RECHECK_MAX_MS, max(
                    CHILD_RECHECK_MIN_MS, waited // 4)), *deadlines])))
        if recheck:
            # Fenced by the run's epoch: a run woken and parked again since the read (its
            # child settled, it went on and slept) has its own entry, due at its new timer; a
            # plain ZADD XX pushed that timer up to CHILD_RECHECK_MAX_MS late.
            ctl.runs.scripts.recheck_waits([(keys.run_keys(run_id), run_id, epoch, run_epoch, at)
                                            for run_id, run_epoch, at in recheck])
        woken = self._wake(ctl, wakes, epoch, now_ms, timers)
        return len(due), woken

    def _wake(self, ctl: DutyContext, wakes: list[tuple[str, str]], epoch: int,
              now_ms: int, timers: dict[str, int] | None = None) -> int:
        if not wakes:
            return 0
        keys = ctl.keys
        replies = ctl.runs.scripts.wake_runs([
            (keys.run_keys(rid), rid, epoch, cause, DISPATCH_GRACE_MS,
             msgspec.json.encode({"cause": cause})) for rid, cause in wakes])
        deliveries: dict[str, list[tuple[str, int]]] = defaultdict(list)
        late: list[int] = []  # due times of the timers woken now
        for (run_id, _), reply in zip(wakes, replies, strict=True):
            if reply.status == "fenced":
                ctl.step_down(f"a newer controller (epoch {as_text(reply.values[0])}) acts on run "
                              f"{run_id}")
                return 0
            if reply.status == "woken":
                deliveries[as_text(reply.values[1])].append((run_id, int(reply.values[0])))
                if timers and run_id in timers:
                    late.append(timers[run_id])
        if late and metrics.enabled():
            woken_ms = ctl.server_ms()
            for due_ms in late:
                metrics.timer_late((woken_ms - due_ms) / 1000)
        count = 0
        for queue_name, batch in deliveries.items():
            # Through the controller's enqueue (the one place it reaches RQ); a failure
            # leaves their dispatch checks due: retried.
            ctl.enqueue_many(queue_name, batch)
            count += len(batch)
        if count:
            self.stats.woken += count
            if count > 20:
                log.info("woke %s waiting runs", count)
        return count
