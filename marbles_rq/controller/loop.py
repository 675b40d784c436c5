"""`marbles-rq controller`: the controller of a lane redelivers runs whose execution
vanished, dispatches runs that were recorded but never reached RQ, redelivers deliveries
lost inside RQ, and prunes finished runs past their retention, in the buckets of its lane.
With one lane (the default) there is one such controller and a second one waits and takes
over when the first one's lease lapses; with several, controllers share the lanes
(controller/share.py).

Election is a lease per lane with a fencing epoch; correctness comes from the fence: every
write the controller makes to a run (reap_run, redispatch_run) checks, in the bucket it
changes, that no newer controller of that lane has written there.

Every pass costs what is due or in flight, never what is queued: leases that expired,
dispatch checks that came due (each run is checked once, after the enqueuer's grace), the
deliveries RQ holds between a worker's pop and the run's start, and finished runs whose
retention ended. Reaping goes first and dispatch checks are bounded per pass, so a burst of
enqueues never delays a redelivery.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from .. import metrics
from ..engine.execution import DISPATCH_GRACE_MS, event
from ..engine.limits import release_vanished
from ..engine.runs import TERMINAL, RunStore
from ..errors import (
    CorruptRecordError,
    MarblesError,
    RedisUnavailableError,
    UnsupportedRecordVersionError,
)
from ..store import Lease
from ..store.keys import CONTROLLER_LEASE
from ..store.records import RunRecord, decode
from ..store.redis_errors import is_outage, one_line
from ..transport import dispatch
from ..transport.lanes import Lanes, as_lanes
from ..transport.liveness import WORKER_BEAT_S, WORKER_TTL_MS
from .duties import RECOVERY_ORDER, Duty

log = logging.getLogger("marbles_rq.controller")

LEASE_NAME = CONTROLLER_LEASE  # lane 0's lease: the one lease of a single-lane deployment
REAP_BATCH = 200          # expired leases read per bucket per pass
LOST_WORKERS_BATCH = 100  # lost workers handled per pass
# Lost workers are believed only after this long in contact with Redis (since the controller
# started, won the lease, or got through an outage): workers cut off by the same outage beat
# again within a beat once it ends, and must not all be taken for lost.
LIVENESS_GRACE_S = WORKER_TTL_MS / 1000 + WORKER_BEAT_S
STALL_S = 1.0  # a pass this slow to reach the lost workers' read, or that read itself, met a
               # stalled Redis: beats may not have landed either; the grace starts again
DISPATCH_BUDGET = 1_000   # dispatch checks per pass, over all buckets
PRUNE_BUDGET = 200        # finished runs pruned per prune pass
PRUNE_EVERY_S = 5.0
HOLD_MAX_MS = 3_600_000  # a child kept for its parent is looked at again at most this late
RECOVERY_BATCH = 5_000    # dispatch checks per round while recovering
RECOVERY_ROUNDS = 1_000   # at most 5,000,000 entries; the rest are due in later passes
LOST_AFTER_S = 5.0        # a popped delivery whose run has not started by then was lost
# With several lanes, each lane's controller handles a lost worker's runs in its own buckets,
# so nobody may take the worker off the liveness index at once: lane 0's controller does,
# this long after it was lost (every lane's leader has seen it by then; a run in a lane
# nobody led that long is reaped when its lease expires).
FORGET_LOST_AFTER_MS = 30_000
MAX_BACKOFF_S = 30.0
WARN_AGAIN_S = 600.0      # repeat a warning about the same bad key at most this often
REAP_CANCELLED = event(status="cancelled", reason="cancel requested; its execution had vanished")
REAP_GAVE_UP = event(status="failed", error={"type": "DeliveriesExhausted",
                                             "message": "executions kept vanishing"})


@dataclass
class Stats:
    redelivered: int = 0
    dispatched: int = 0
    settled: int = 0
    pruned: int = 0
    corrupt: int = 0


class Controller:
    def __init__(self, runs: RunStore, rq: Lanes | redis.Redis, *, lease_ms: int = 10_000,
                 interval_s: float = 0.5, lost_after_s: float = LOST_AFTER_S,
                 dispatch_budget: int = DISPATCH_BUDGET, duties: Sequence[Duty] = (),
                 lane: int = 0, token: str | None = None) -> None:
        self.runs = runs
        self.store = runs.store
        self.keys = runs.keys
        self.rq = as_lanes(rq, runs.keys)
        self.lease_ms, self.interval_s = lease_ms, interval_s
        self.lost_after_s = lost_after_s
        self.dispatch_budget = dispatch_budget
        # The lane this controller leads: its buckets are all it reads and writes, fenced by
        # its lane's epoch. One lane (the default) is every bucket under the `controller`
        # lease, as before lanes.
        self.lane = lane
        self.buckets: range = self.keys.lane_buckets(lane)
        self.lease_name = self.keys.lane_lease(lane)
        self.token = token or new_token()
        self.lease: Lease | None = None
        self._floor = 0  # a fresh epoch must be above this (see recover)
        self._leading = False
        self._lost_seen: set[tuple[str, int]] = set()  # lost workers handled (lanes > 1)
        self.stats = Stats()
        self.stop_event = threading.Event()
        # Its own lane's deliveries in flight only: each lane is its own RQ keyspace, read
        # by that lane's controller.
        self.in_flight = [dispatch.InFlight(rq_lane.conn, self.keys.prefix, rq_lane.rq_prefix)
                          for rq_lane in self.rq.lanes if rq_lane.index == lane]
        self._lost: dict[tuple[str, int], float] = {}  # popped, unstarted -> first seen
        self._failed: set[tuple[str, int]] = set()  # failed in RQ; kept until resolved
        self._next_prune = 0.0
        self._warned: dict[str, float] = {}
        self._in_contact_since: float | None = None  # monotonic; None after a failed pass
        self.duties = sorted(duties, key=lambda d: RECOVERY_ORDER.index(d.kind))

    # -- election -----------------------------------------------------------------------------

    def lead(self) -> bool:
        """Hold this lane's controller lease; True while this process may act on it."""
        now = time.monotonic()
        if self.lease is not None and now < self.lease.valid_until - self.lease_ms / 3000:
            return True  # renew only every third of the lease
        if self.lease is not None:
            renewed = self.store.renew_lease(self.lease)
            if renewed is None:
                log.warning("lost the controller lease (epoch %s)", self.lease.epoch)
            self.lease = renewed
        if self.lease is None:
            got = self.store.acquire_lease(self.lease_name, self.token, self.lease_ms,
                                           floor=self._floor)
            if isinstance(got, Lease):
                self.lease = got
                if self.keys.lanes == 1:
                    log.info("elected controller, epoch %s", got.epoch)
                else:
                    log.info("elected controller of lane %s (buckets %s-%s), epoch %s",
                             self.lane, self.buckets.start, self.buckets.stop - 1, got.epoch)
        return self.lease is not None and time.monotonic() < self.lease.valid_until

    # -- helpers ------------------------------------------------------------------------------

    def server_ms(self) -> int:
        # Leases are scored in the server's clock; compare in the same clock.
        secs, micros = self.store.client.time()
        return int(secs) * 1000 + int(micros) // 1000

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._warned.get(key, -WARN_AGAIN_S) >= WARN_AGAIN_S:
            self._warned[key] = now
            log.warning(message, *args)

    def due(self, key_of: Callable[[int], str], now_ms: int, per_bucket: int,
            budget: int | None = None) -> list[tuple[int, str]]:
        """(bucket, member) of the per-bucket index `key_of(bucket)` scored <= now_ms, at
        most `per_bucket` from each, one pipelined read: what every pass and duty reads to
        cost what is due. An unreadable index is skipped (one warning); a member that
        belongs to another bucket is removed, since no script would ever touch it."""
        pipe = self.store.client.pipeline(transaction=False)
        buckets = self.buckets
        for bucket in buckets:
            pipe.zrangebyscore(key_of(bucket), "-inf", now_ms, start=0, num=per_bucket)
        due: list[tuple[int, str]] = []
        for bucket, ids in zip(buckets, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(ids, Exception):
                if is_outage(ids):
                    raise ids
                self._warn_once(key_of(bucket), "skipping unreadable index %s: %s",
                                key_of(bucket), one_line(ids))
                continue
            for rid in map(_s, ids):
                if self.keys.bucket_of(rid) == bucket:
                    due.append((bucket, rid))
                else:  # planted or left by a bug: its scripts would never touch this entry
                    self.store.client.zrem(key_of(bucket), rid)
                    self._warn_once(f"stray:{key_of(bucket)}", "removed %r from %s: that id "
                                    "belongs to another bucket", rid, key_of(bucket))
        return due if budget is None else due[:budget]

    def _run_script(self, run_id: str, call: Callable[[], Any]) -> Any:
        """One run's script call. A script error costs only this run's turn: one warning
        (at most every 10 min per run), then the pass goes on. (It is not the run's fault
        for sure -- a shared index key of its bucket may be what is broken -- so the run is
        not failed; a script that finds the run itself corrupt answers "corrupt".)"""
        try:
            return call()
        except redis.ResponseError as exc:
            if is_outage(exc):
                raise
            self._warn_once(f"script:{run_id}", "run %s: a script failed on its keys (%s); "
                            "skipped", run_id, one_line(exc))
            return None

    def leads(self, epoch: int) -> bool:
        """True while this process still leads under `epoch`: what a duty's own thread
        checks before each pass (its writes are fenced regardless)."""
        lease = self.lease
        return (lease is not None and lease.epoch == epoch and not self.stop_event.is_set()
                and time.monotonic() < lease.valid_until)

    def soonest(self, key_of: Callable[[int], str]) -> int | None:
        """The lowest score over the per-bucket index `key_of(bucket)` (one pipelined
        read): when a duty's thread has something due next."""
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in self.buckets:
            pipe.zrange(key_of(bucket), 0, 0, withscores=True)
        scores = [int(found[0][1]) for found in pipe.execute(raise_on_error=False)
                  if isinstance(found, list) and found]
        return min(scores) if scores else None

    def step_down(self, why: str) -> None:
        """A script refused a write because a newer controller was elected: stop acting
        now (the loop waits to take over again, as a standby)."""
        log.warning("%s; stepping down", why)
        self.lease = None

    def _handled(self, run_id: str, reply: Any) -> bool:
        """True when a run script's reply is not about the run's progress: the call failed
        (None), a newer controller fenced this one (it steps down), or the run is corrupt
        (it is failed once)."""
        if reply is None:
            return True
        if reply.status == "fenced":
            self.step_down(f"a newer controller (epoch {_s(reply.values[0])}) acts on run "
                           f"{run_id}")
            return True
        if reply.status == "corrupt":
            self._fail_corrupt(run_id, f"{self.keys.run(run_id)}: {_s(reply.values[0])}")
            return True
        return False

    def _fail_corrupt(self, run_id: str, reason: str) -> None:
        log.warning("run %s: corrupt record (%s); failing it", run_id, reason)
        self.runs.fail_corrupt(run_id, f"corrupt record at {reason}")
        self.stats.corrupt += 1

    def _enqueue(self, queue_name: str, run_id: str, attempt: int) -> bool:
        try:
            return self.rq.enqueue(queue_name, run_id, attempt)
        except redis.RedisError as exc:  # the dispatch entry stays; a later pass retries
            log.warning("run %s attempt %s: enqueue failed (%s); will retry", run_id, attempt,
                        one_line(exc))
            return False

    def _enqueue_many(self, queue_name: str, batch: list[tuple[str, int]]) -> bool:
        """Enqueue deliveries (run id, attempt) of one queue in one round trip; False when
        it failed (their dispatch checks stay due: a later pass retries)."""
        try:
            self.rq.enqueue_many(queue_name, batch)
        except redis.RedisError as exc:
            log.warning("enqueueing %s deliveries on %s failed (%s); will retry", len(batch),
                        queue_name, one_line(exc))
            return False
        return True

    # -- reaping ------------------------------------------------------------------------------

    def reap(self, now_ms: int | None = None) -> int:
        """Redeliver every run whose lease expired (attempt + 1, same run id)."""
        now_ms = self.server_ms() if now_ms is None else now_ms
        return self._reap([(run_id, "") for _, run_id in
                           self.due(self.keys.run_leases, now_ms, REAP_BATCH)])

    def _liveness_trusted(self) -> bool:
        """Lapsed beats mean lost workers only once the controller has been in steady
        contact with Redis for LIVENESS_GRACE_S (see there)."""
        since = self._in_contact_since
        return since is not None and time.monotonic() - since >= LIVENESS_GRACE_S

    def reap_lost_workers(self) -> int:
        """Redeliver the runs of workers that stopped beating (killed, frozen, cut off: see
        transport/liveness.py), without waiting for their leases. One read per pass; a lost
        worker costs one look at the worker of every executing run (rare: a crash)."""
        asked = time.monotonic()
        now = self.server_ms()
        lapsed: Any = self.store.client.zrangebyscore(
            self.keys.workers, "-inf", now, start=0, num=LOST_WORKERS_BATCH, withscores=True)
        found = {(_s(w), int(score)) for w, score in lapsed}
        if not found:
            self._lost_seen.clear()
            return 0
        if time.monotonic() - asked > STALL_S:
            self._in_contact_since = time.monotonic()
            return 0
        # With several lanes a lost worker stays on the index for a while (see
        # FORGET_LOST_AFTER_MS): look at the executing runs once per worker lost.
        lost = {w for w, score in found if (w, score) not in self._lost_seen}
        done = 0
        if lost:
            mine = [(run_id, worker) for run_id, worker in self._executing() if worker in lost]
            for run_id, worker in mine:
                log.warning("run %s: its worker %s is lost (no liveness beat)", run_id, worker)
            done = self._reap(mine)
            if self.lease is None:
                return done
        self._lost_seen = found
        if self.keys.lanes == 1:
            forget, cutoff = sorted(w for w, _ in found), now
        elif self.lane == 0:
            cutoff = now - FORGET_LOST_AFTER_MS
            forget = sorted(w for w, score in found if score <= cutoff)
        else:
            forget = []
        if forget:
            self.runs.scripts.forget_workers(workers_key=self.keys.workers, workers=forget,
                                             cutoff_ms=cutoff, lanes_key=self.keys.worker_lanes)
        return done

    def _executing(self) -> list[tuple[str, str]]:
        """(run id, worker) of every run holding a lease, read in pipelines."""
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in self.buckets:
            pipe.zrange(self.keys.run_leases(bucket), 0, -1)
        ids = [_s(rid) for part in pipe.execute(raise_on_error=False)
               if not isinstance(part, Exception) for rid in part]
        out: list[tuple[str, str]] = []
        for i in range(0, len(ids), 1000):
            chunk = ids[i:i + 1000]
            pipe = self.store.client.pipeline(transaction=False)
            for rid in chunk:
                pipe.hget(self.keys.run(rid), "worker")
            out += [(rid, _s(w)) for rid, w in zip(chunk, pipe.execute(raise_on_error=False),
                                                   strict=True)
                    if isinstance(w, bytes)]
        return out

    def _reap_one(self, run_id: str, worker: str = "") -> int:
        """reap_run for one run (worker: a lost worker's name, or "" for an expired lease);
        1 if it was redelivered."""
        return self._reap([(run_id, worker)])

    def _reap(self, items: list[tuple[str, str]]) -> int:
        """reap_run for (run id, worker) pairs in one pipeline (one per master on a
        cluster), then their redeliveries enqueued in one round trip per queue; returns how
        many were redelivered. A run whose script fails costs only its own turn (see
        _run_script); a fenced reply steps this lane down after the batch."""
        if not items:
            return 0
        assert self.lease is not None
        epoch = self.lease.epoch
        replies = self.runs.scripts.reap_runs([
            (self.keys.run_keys(run_id), run_id, epoch, DISPATCH_GRACE_MS, REAP_CANCELLED,
             REAP_GAVE_UP, worker) for run_id, worker in items])
        deliveries: dict[str, list[tuple[str, int]]] = defaultdict(list)
        done = 0
        fenced: tuple[str, Any] | None = None
        for (run_id, worker), reply in zip(items, replies, strict=True):
            if isinstance(reply, redis.ResponseError):
                if is_outage(reply):
                    raise reply
                self._warn_once(f"script:{run_id}", "run %s: a script failed on its keys (%s); "
                                "skipped", run_id, one_line(reply))
                continue
            if reply.status == "fenced":
                fenced = fenced or (run_id, reply.values[0])
                continue
            if reply.status == "corrupt":
                self._fail_corrupt(run_id, f"{self.keys.run(run_id)}: {_s(reply.values[0])}")
                continue
            if not worker and reply.status in ("redelivered", "cancelled", "gave_up"):
                metrics.lease_expired(reply.status)
            if reply.status == "redelivered":
                attempt, queue_name = int(reply.values[0]), _s(reply.values[1])
                log.info("run %s: execution vanished (%s); redelivering as attempt %s", run_id,
                         f"worker {worker} lost" if worker else "lease expired", attempt)
                if len(reply.values) > 2 and reply.values[2]:
                    # Flow control: free the vanished execution's concurrency slot now.
                    release_vanished(self.runs, run_id, attempt - 1, _s(reply.values[2]))
                deliveries[queue_name].append((run_id, attempt))
                self.stats.redelivered += 1
                metrics.redelivered(queue_name, "worker_lost" if worker else "lease_expired")
                done += 1
            elif reply.status in ("cancelled", "gave_up"):
                if len(reply.values) > 1 and reply.values[1]:
                    # A settled run executes no more: its slot is free now, not at expiry.
                    release_vanished(self.runs, run_id, int(reply.values[0]),
                                     _s(reply.values[1]))
                log.info("run %s: %s", run_id, reply.status)
                if reply.status == "cancelled":
                    self._cancel_children(run_id)
                self.stats.settled += 1
        for queue_name, batch in deliveries.items():
            if len(batch) == 1:
                self._enqueue(queue_name, *batch[0])
            else:
                self._enqueue_many(queue_name, batch)
        if fenced is not None:
            self.step_down(f"a newer controller (epoch {_s(fenced[1])}) acts on run "
                           f"{fenced[0]}")
        return done

    def _cancel_children(self, run_id: str) -> None:
        """A run the reaper settled cancelled: its children go with it, as when its execution
        settles it (engine/execute.settle_stopped). Children recorded after a cancel's own
        walk (the body started one before it saw the cancel, then its worker died) are
        reached only here."""
        try:
            children = self.runs.waits().cancel_children(run_id)
        except (redis.RedisError, MarblesError) as exc:
            log.warning("run %s: cannot cancel its children (%s)", run_id, one_line(exc))
            return
        if children:
            log.info("run %s: cancelled %s child runs with it", run_id, len(children))

    # -- dispatching --------------------------------------------------------------------------

    def dispatch(self, budget: int | None = None, now_ms: int | None = None) -> int:
        """One round of dispatch checks (see `_dispatch_round`); returns how many
        deliveries it enqueued."""
        return self._dispatch_round(budget, now_ms)[1]

    def _dispatch_round(self, budget: int | None = None,
                        now_ms: int | None = None) -> tuple[int, int]:
        """Each recorded delivery is checked once, after the enqueuer's grace: enqueue it if
        RQ has no job for it (a crash between recording and enqueueing, a failed enqueue, a
        deferral), then drop the check. At most `dispatch_budget` checks per pass; the
        missing deliveries are enqueued in one pipeline per queue. Returns (checks made,
        deliveries enqueued)."""
        budget = budget or self.dispatch_budget
        per_bucket = 2 * -(-budget // len(self.buckets))
        due = self.due(self.keys.run_dispatch, self.server_ms() if now_ms is None else now_ms,
                       per_bucket, budget)
        if not due:
            return 0, 0
        pipe = self.store.client.pipeline(transaction=False)
        for _, run_id in due:
            pipe.hmget(self.keys.run(run_id), "status", "attempt", "queue")
        states = pipe.execute(raise_on_error=False)
        checked: list[tuple[str, str]] = []  # (run id, attempt seen) whose check is done
        queued: list[tuple[str, int, str]] = []
        for (_, run_id), st in zip(due, states, strict=True):
            if isinstance(st, Exception) or (st[0] == b"queued" and not _is_int(st[1])):
                if isinstance(st, Exception) and is_outage(st):
                    raise st
                self._fail_corrupt(run_id, f"{self.keys.run(run_id)}: unreadable status/attempt")
            elif st[0] == b"queued":
                queued.append((run_id, int(st[1]), _s(st[2] or b"default")))
            else:  # missing, running or settled: nothing left to dispatch
                checked.append((run_id, ""))
        exists = self.rq.deliveries_exist([(rid, a) for rid, a, _ in queued])
        missing: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for (run_id, attempt, queue_name), present in zip(queued, exists, strict=True):
            if present:
                checked.append((run_id, str(attempt)))
            else:
                missing[queue_name].append((run_id, attempt))
        done = 0
        for queue_name, batch in missing.items():
            if not self._enqueue_many(queue_name, batch):
                continue  # the checks stay due; a later pass retries
            for run_id, attempt in batch:
                if len(batch) <= 20:
                    log.info("run %s: dispatched attempt %s (it was not in RQ)", run_id,
                             attempt)
                checked.append((run_id, str(attempt)))
            if len(batch) > 20:
                log.info("dispatched %s deliveries on %s (they were not in RQ)", len(batch),
                         queue_name)
            self.stats.dispatched += len(batch)
            metrics.redelivered_many(queue_name, "not_in_rq", len(batch))
            done += len(batch)
        if checked:
            self.runs.scripts.dispatch_done(
                [(self.keys.run_keys(rid), rid, attempt) for rid, attempt in checked])
        return len(due), done

    # -- deliveries lost inside RQ ------------------------------------------------------------

    def find_lost(self) -> int:
        """Deliver again, as attempt + 1, a delivery lost before its run started:
        - one a worker popped (intermediate list, or the started registry of a worker of an
          earlier version) whose run is still queued under that attempt after LOST_AFTER_S
          (the worker died between its pop and the run's start, its horse died before the
          start, the store refused the start, or Redis restarted there);
        - one that failed in RQ while its run is still queued under that attempt (a job
          refused by the worker): at once. A failed job is read once from RQ's registry, so
          it is kept here until its run moves on.
        A popped delivery whose run has moved on (started under a newer delivery, settled,
        waiting, gone) is over: what its worker left in the intermediate list is taken out
        (`InFlight.forget`). One still running under that delivery is left alone."""
        assert self.lease is not None
        popped_ids: set[str] = set()
        failed_ids: set[str] = set()
        for lane in self.in_flight:
            try:
                popped, failed = lane.job_ids()
            except redis.RedisError as exc:  # one lane's node away: the others go on
                if is_outage(exc) and len(self.in_flight) == 1:
                    raise
                self._warn_once(f"in-flight:{lane.rq_prefix}", "cannot read lane %s's "
                                "deliveries in flight (%s)", lane.rq_prefix, one_line(exc))
                continue
            popped_ids |= popped
            failed_ids |= failed
        popped_job: dict[tuple[str, int], str] = {}
        for job_id in popped_ids:
            parsed = self._parse(job_id)
            if parsed is not None:
                popped_job[parsed] = job_id
        self._failed.update(p for p in map(self._parse, failed_ids) if p is not None)
        candidates = sorted(set(popped_job) | self._failed)
        now = time.monotonic()
        if not candidates:
            self._lost.clear()
            return 0
        pipe = self.store.client.pipeline(transaction=False)
        for run_id, _ in candidates:
            pipe.hmget(self.keys.run(run_id), "status", "attempt")
        states = pipe.execute(raise_on_error=False)
        still: dict[tuple[str, int], float] = {}
        over: list[str] = []
        done = 0
        for (run_id, attempt), st in zip(candidates, states, strict=True):
            if isinstance(st, Exception):
                self._failed.discard((run_id, attempt))
                continue  # not ours to judge here
            this = st[1] == str(attempt).encode()
            if st[0] != b"queued" or not this:
                self._failed.discard((run_id, attempt))
                if (run_id, attempt) in popped_job and not (st[0] == b"running" and this):
                    over.append(popped_job[(run_id, attempt)])
                continue  # started, settled, moved on
            if (run_id, attempt) not in self._failed:
                first = self._lost.get((run_id, attempt), now)
                if now - first < self.lost_after_s:
                    still[(run_id, attempt)] = first
                    continue
            cause = "delivery_failed" if (run_id, attempt) in self._failed else "delivery_lost"
            if self._redispatch(run_id, attempt, cause):
                done += 1
        self._lost = still
        if over:
            for lane in self.in_flight:
                lane.forget(over)
        return done

    def _parse(self, job_id: str) -> tuple[str, int] | None:
        """(run id, attempt) of a delivery of this lane's buckets (RQ's keyspace may hold
        other lanes' deliveries: their controllers judge those), else None."""
        parsed = dispatch.parse_delivery_id(self.keys.prefix, job_id)
        if parsed is None or self.keys.bucket_of(parsed[0]) not in self.buckets:
            return None
        return parsed

    def _redispatch(self, run_id: str, attempt: int, cause: str) -> bool:
        assert self.lease is not None
        epoch = self.lease.epoch
        reply = self._run_script(run_id, lambda: self.runs.scripts.redispatch_run(
            keys=self.keys.run_keys(run_id), run_id=run_id, attempt=attempt, ctl_epoch=epoch,
            grace_ms=DISPATCH_GRACE_MS, final_gave_up=event(status="failed", error={
                "type": "DeliveriesExhausted", "message": "deliveries kept getting lost"})))
        if self._handled(run_id, reply):
            return False
        if reply.status == "gave_up":
            log.warning("run %s: deliveries used up (%s); failed", run_id, _s(reply.values[0]))
            self.stats.settled += 1
            return False
        if reply.status != "redelivered":
            return False
        new_attempt, queue_name = int(reply.values[0]), _s(reply.values[1])
        log.warning("run %s: delivery %s was lost inside RQ before it started; redelivering "
                    "as attempt %s", run_id, attempt, new_attempt)
        self._enqueue(queue_name, run_id, new_attempt)
        self.stats.redelivered += 1
        metrics.redelivered(queue_name, cause)
        return True

    # -- retention ----------------------------------------------------------------------------

    def prune(self, budget: int = PRUNE_BUDGET) -> int:
        """Remove finished runs whose retention ended, with everything they stored; a child
        run whose parent has not finished is held (see `_held`)."""
        due = self.due(self.keys.run_finished, self.server_ms(),
                       2 * -(-budget // len(self.buckets)), budget)
        if not due:
            return 0
        held = self._held([run_id for _, run_id in due])
        due = [(bucket, run_id) for bucket, run_id in due if run_id not in held]
        pipe = self.store.client.pipeline(transaction=False)
        for _, run_id in due:
            pipe.smembers(self.keys.effect_index(run_id))
        receipts = pipe.execute(raise_on_error=False)
        done = 0
        for (_, run_id), found in zip(due, receipts, strict=True):
            members = [] if isinstance(found, Exception) else sorted(_s(m) for m in found)
            reply = self._run_script(run_id, functools.partial(
                self.runs.scripts.purge_run, keys=self.keys.run_keys(run_id), run_id=run_id,
                receipts=members))
            if reply is not None and reply.status == "ok":
                done += 1
        self.stats.pruned += done
        if done:
            log.info("pruned %s finished runs past their retention", done)
        return done

    def _held(self, run_ids: list[str]) -> set[str]:
        """The children among `run_ids` whose parent has not finished: the parent reads a
        child's outcome when it gathers, however long after the child's retention that is.
        Each is held (lua/hold_finished.lua) and looked at again after its retention (at least
        a prune pass, at most an hour); once its parent has finished (final: it never gathers
        again) or is gone, the child is pruned. Read in two pipelined rounds: the children's
        records (for their parent), then their parents' status."""
        # A child's id is "<parent>.<key>" (engine/flow.child_id): only such ids are read.
        maybe = [rid for rid in run_ids if "." in rid]
        if not maybe:
            return set()
        pipe = self.store.client.pipeline(transaction=False)
        for rid in maybe:
            pipe.hget(self.keys.run(rid), "doc")
        children: dict[str, RunRecord] = {}
        for rid, doc in zip(maybe, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(doc, bytes):
                try:
                    record = decode(RunRecord, doc, self.keys.run(rid))
                except (CorruptRecordError, UnsupportedRecordVersionError):
                    continue  # purge_run judges it as any run
                if record.parent:
                    children[rid] = record
        if not children:
            return set()
        pipe = self.store.client.pipeline(transaction=False)
        for record in children.values():
            pipe.hget(self.keys.run(record.parent), "status")
        held: set[str] = set()
        for (rid, record), status in zip(children.items(),
                                         pipe.execute(raise_on_error=False), strict=True):
            if isinstance(status, Exception):
                if is_outage(status):
                    raise status
                held.add(rid)  # unreadable now: not pruned on a guess
                continue
            if status is None or _s(status) in TERMINAL:
                continue
            hold_ms = min(max(int(record.retention_s * 1000), int(PRUNE_EVERY_S * 1000)),
                          HOLD_MAX_MS)
            self._run_script(rid, functools.partial(
                self.runs.scripts.hold_finished, keys=self.keys.run_keys(rid), run_id=rid,
                hold_ms=hold_ms))
            held.add(rid)
        if held:
            log.debug("kept %s finished child runs whose parent has not finished", len(held))
        return held

    # -- the loop ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The lease epoch that fences this controller's writes (0 when not leading)."""
        return self.lease.epoch if self.lease is not None else 0

    def recover(self) -> None:
        """On winning the lease, before anything new: claim every bucket of the lane (so a
        paused ex-leader that wakes has its writes refused everywhere), then finish what the
        previous leader left, kind by kind in the seed's order (RECOVERY_ORDER); one log line
        per kind with its count and the time it took.

        A bucket whose fence holds a newer epoch was written by a newer leader of this lane
        -- or, after the lanes were split or merged, by a leader whose epoch came from
        another lane's counter (each lane counts its own). One that holds this very epoch
        was written under another counter too, since a fresh epoch was never handed out
        before: equal epochs would let both controllers' writes through. Either way this
        lease is given back and the next acquisition takes an epoch above every fence seen
        (the floor of lua/acquire_lease.lua): a newer leader that still holds the lease
        keeps it, and a stale fence no longer blocks the lane nor shares its epoch."""
        assert self.lease is not None
        epoch = self.lease.epoch
        fences = [self.keys.controller_fence(b) for b in self.buckets]
        seen = [held for _, held in self.runs.scripts.raise_fences(fences, epoch)
                if held >= epoch]
        if seen:
            log.warning("a bucket of lane %s holds controller epoch %s (this one: %s), from "
                        "a newer leader or another epoch counter; stepping down", self.lane,
                        max(seen), epoch)
            self._floor = max(self._floor, *seen)
            self.release()
            return
        steps: list[tuple[str, Callable[[], int]]] = [("children", self._recover_dispatch)]
        steps += [(duty.kind, functools.partial(duty.recover, self)) for duty in self.duties]
        for kind, step in sorted(steps, key=lambda s: RECOVERY_ORDER.index(s[0])):
            if self.lease is None:
                return
            started = time.monotonic()
            try:
                count = step()
            except Exception as exc:
                if _outage(exc):
                    raise
                # A bug or bad data in one kind must not keep the others from recovering,
                # nor end the controller: one line, and the next kind.
                log.error("recovering %s failed (%s); carrying on", kind, one_line(exc))
                continue
            log.info("recovered %s: %s in %.3f s", kind, count, time.monotonic() - started)

    def _recover_dispatch(self) -> int:
        """Recorded runs (children included) whose delivery never reached RQ: all of them
        now, not one budget per pass."""
        done = 0
        for _ in range(RECOVERY_ROUNDS):
            if self.lease is None:
                break
            checked, dispatched = self._dispatch_round(RECOVERY_BATCH)
            done += dispatched
            if not checked:  # nothing due is left (a round reads a bounded number per bucket)
                break
        return done

    def pass_once(self) -> None:
        """One pass as the leader: reaping first, so nothing waits behind dispatch checks.
        One read of the server clock serves the pass's reads of what is due."""
        started = time.monotonic()
        now_ms = self.server_ms()
        self.reap(now_ms)
        if self.lease is None:
            return
        if time.monotonic() - started > STALL_S:
            self._in_contact_since = time.monotonic()
        elif self._liveness_trusted():
            self.reap_lost_workers()
            if self.lease is None:
                return
        self.dispatch(now_ms=now_ms)
        self.find_lost()
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
            self.prune()
        for duty in self.duties:
            if self.lease is None:
                return
            try:
                duty.tick(self)
            except Exception as exc:
                if _outage(exc):
                    raise
                self._warn_once(f"duty:{duty.kind}", "%s failed (%s); carrying on", duty.kind,
                                one_line(exc))

    def step(self) -> bool:
        """Lead (or keep leading) this lane and make one pass; on winning the lease,
        recover first. True while it leads."""
        if not self.lead():
            if self._leading:
                self._leading = False
                log.warning("no longer the controller%s; waiting to take over",
                            f" of lane {self.lane}" if self.keys.lanes > 1 else "")
            return False
        if not self._leading:
            log.info("recovering: dispatching recorded runs, reaping expired leases")
            self._in_contact_since = None  # a new leader: see LIVENESS_GRACE_S
            self.recover()
            if self.lease is None:
                return False
        self._leading = True
        if self._in_contact_since is None:
            self._in_contact_since = time.monotonic()
        began = time.perf_counter()
        self.pass_once()
        metrics.controller_pass(time.perf_counter() - began)
        return self.lease is not None

    def release(self) -> None:
        """Give the lease back (compare-and-delete) so another controller may lead at once;
        a failure only lets it lapse."""
        lease, self.lease = self.lease, None
        self._leading = False
        if lease is None:
            return
        try:
            self.store.release_lease(lease)
        except (redis.RedisError, RedisUnavailableError) as exc:
            log.warning("could not release the controller lease (%s); it lapses",
                        one_line(exc))

    def run(self) -> None:
        log.info("controller %s started (lease %s ms)", self.token, self.lease_ms)
        backoff = 0.0
        while not self.stop_event.is_set():
            try:
                self.step()
                if backoff:
                    log.info("Redis answers again; carrying on")
                backoff = 0.0
            except Exception as exc:
                # Unreachable, refusing writes (OOM, MISCONF, READONLY, LOADING, NOPERM), a
                # script error -- or a bug: one line, back off, carry on. The lease may lapse
                # meanwhile; the fence keeps a successor and this process from acting twice.
                self._in_contact_since = None
                self._leading = self._leading and self.lease is not None
                backoff = backing_off(exc, backoff)
                self.stop_event.wait(backoff)
            self.stop_event.wait(self.interval_s)
        if self.lease is not None:
            try:
                self.store.release_lease(self.lease)
                log.info("released the controller lease")
            except (redis.RedisError, RedisUnavailableError) as exc:
                log.warning("could not release the controller lease (%s); it lapses",
                            one_line(exc))


def new_token() -> str:
    """A controller process's token: ``<host>:<pid>:<random>`` (health and `leader` read the
    host and pid), then ``:lanes``, which tells a controller that shares lanes from one of an
    earlier version (see controller/share.py)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}:lanes"


def backing_off(exc: BaseException, backoff: float) -> float:
    """A pass failed: count and log it in one line; the next backoff (doubling, capped)."""
    if isinstance(exc, redis.RedisError):
        metrics.redis_error(exc)
    backoff = min(MAX_BACKOFF_S, backoff * 2 or 1.0)
    what = "Redis error" if _outage(exc) or isinstance(exc, redis.RedisError) else "error"
    log.error("%s (%s); retrying in %.0f s", what, one_line(exc), backoff)
    return backoff


def _outage(exc: BaseException) -> bool:
    return isinstance(exc, RedisUnavailableError | OSError) or is_outage(exc)


def _is_int(value: Any) -> bool:
    """A delivery number as the scripts write it: digits only (no sign, no 1.5, no inf)."""
    return isinstance(value, bytes) and value.isdigit() and 0 < len(value) <= 15


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

