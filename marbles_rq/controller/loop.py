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
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from .. import metrics
from ..engine.runs import RunStore
from ..errors import RedisUnavailableError
from ..store import Lease
from ..store.keys import CONTROLLER_LEASE
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text, server_ms
from ..transport import dispatch
from ..transport.lanes import Lanes, as_lanes
from .context import Stats
from .dispatching import DISPATCH_BUDGET, Dispatching
from .due_watch import DueWatch
from .duties import RECOVERY_ORDER, Duty
from .lost_deliveries import LOST_AFTER_S, LostDeliveries
from .lost_workers import LIVENESS_GRACE_S, STALL_S, LostWorkers
from .pruning import PRUNE_BUDGET, Pruning
from .reaping import Reaping

log = logging.getLogger("marbles_rq.controller")

LEASE_NAME = CONTROLLER_LEASE  # lane 0's lease: the one lease of a single-lane deployment
MAX_BACKOFF_S = 30.0
WARN_AGAIN_S = 600.0      # repeat a warning about the same bad key at most this often


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
        self.stats = Stats()
        self.stop_event = threading.Event()
        self._warned: dict[str, float] = {}
        self._in_contact_since: float | None = None  # monotonic; None after a failed pass
        self.duties = sorted(duties, key=lambda d: RECOVERY_ORDER.index(d.kind))
        # Its own duties, which every pass makes in this order before the duties above.
        self.reaping = Reaping()
        self.lost_workers = LostWorkers()
        self.dispatching = Dispatching(dispatch_budget)
        self.lost_deliveries = LostDeliveries(
            [dispatch.InFlight(rq_lane.conn, self.keys.prefix, rq_lane.rq_prefix)
             for rq_lane in self.rq.lanes if rq_lane.index == lane], lost_after_s)
        self.pruning = Pruning()
        self.watch = DueWatch(self.store.client, self.keys, self.buckets)

    # -- election -----------------------------------------------------------------------------

    def lead(self) -> bool:
        """Hold this lane's controller lease; True while this process may act on it."""
        now = time.monotonic()
        if self.lease is not None and now < self.lease.valid_until - self.lease_ms / 3000:
            return True  # renew only every third of the lease
        if self.lease is not None:
            renewed = self.store.renew_lease(self.lease)
            if renewed is None:
                log.warning("lost the controller lease (epoch %s); stepping down", self.lease.epoch)
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
        return server_ms(self.store.client)

    def warn_once(self, key: str, message: str, *args: Any) -> None:
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
        due: list[tuple[int, str]] = []
        for bucket, rid, _ in self.due_scored(key_of, now_ms, per_bucket):
            if self.keys.bucket_of(rid) == bucket:
                due.append((bucket, rid))
            else:  # planted or left by a bug: its scripts would never touch this entry
                self.store.client.zrem(key_of(bucket), rid)
                self.warn_once(f"stray:{key_of(bucket)}", "removed %r from %s: that id "
                               "belongs to another bucket", rid, key_of(bucket))
        return due if budget is None else due[:budget]

    def due_scored(self, key_of: Callable[[int], str], now_ms: int,
                   per_bucket: int) -> list[tuple[int, str, int]]:
        """(bucket, member, score) of the per-bucket index `key_of(bucket)` scored <=
        now_ms, at most `per_bucket` from each, in one pipelined read of only the buckets
        whose index may hold something due (controller/due_watch.py): a lane with nothing
        due costs a few commands, not a few per bucket. An unreadable index is skipped
        (one warning)."""
        kind = self.watch.kind_of(key_of)
        buckets, seq = self.watch.look(kind, now_ms)
        if not buckets:
            return []
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in buckets:
            pipe.zrangebyscore(key_of(bucket), "-inf", now_ms, start=0, num=per_bucket,
                               withscores=True)
            if seq >= 0:
                pipe.zrange(key_of(bucket), 0, 0, withscores=True)
        replies = pipe.execute(raise_on_error=False)
        found, lowest = (replies[0::2], replies[1::2]) if seq >= 0 else (replies, [])
        self.watch.learn(kind, seq, _lowest(buckets, lowest))
        due: list[tuple[int, str, int]] = []
        for bucket, rows in zip(buckets, found, strict=True):
            if isinstance(rows, Exception):
                if is_outage(rows):
                    raise rows
                self.warn_once(key_of(bucket), "skipping unreadable index %s: %s",
                               key_of(bucket), one_line(rows))
                continue
            due += [(bucket, as_text(member), int(score)) for member, score in rows]
        return due

    def run_script(self, run_id: str, call: Callable[[], Any]) -> Any:
        """One run's script call. A script error costs only this run's turn: one warning
        (at most every 10 min per run), then the pass goes on. (It is not the run's fault
        for sure -- a shared index key of its bucket may be what is broken -- so the run is
        not failed; a script that finds the run itself corrupt answers "corrupt".)"""
        try:
            return call()
        except redis.ResponseError as exc:
            if is_outage(exc):
                raise
            self.warn_once(f"script:{run_id}", "run %s: a script failed on its keys (%s); "
                           "skipped", run_id, one_line(exc))
            return None

    def leads(self, epoch: int) -> bool:
        """True while this process still leads under `epoch`: what a duty's own thread
        checks before each pass (its writes are fenced regardless)."""
        lease = self.lease
        return (lease is not None and lease.epoch == epoch and not self.stop_event.is_set()
                and time.monotonic() < lease.valid_until)

    def soonest(self, key_of: Callable[[int], str]) -> int | None:
        """The lowest score over the per-bucket index `key_of(bucket)`: when a duty's
        thread has something due next (only the buckets not known already are read)."""
        kind = self.watch.kind_of(key_of)
        buckets, seq = self.watch.unknown(kind)
        pipe = self.store.client.pipeline(transaction=False)
        for bucket in buckets:
            pipe.zrange(key_of(bucket), 0, 0, withscores=True)
        read = _lowest(buckets, pipe.execute(raise_on_error=False) if buckets else [])
        self.watch.learn(kind, seq, read)
        if seq >= 0:
            complete, low = self.watch.lowest(kind)
            if complete:
                return None if low == math.inf else int(low)
        low = min(read.values(), default=math.inf)
        if seq >= 0:  # a bucket written while it was read: take what is known besides
            low = min(low, self.watch.lowest(kind)[1])
        return None if low == math.inf else int(low)

    def step_down(self, why: str) -> None:
        """A script refused a write because a newer controller was elected: stop acting
        now (the loop waits to take over again, as a standby)."""
        log.warning("%s; stepping down", why)
        self.lease = None

    def handled(self, run_id: str, reply: Any) -> bool:
        """True when a run script's reply is not about the run's progress: the call failed
        (None), a newer controller fenced this one (it steps down), or the run is corrupt
        (it is failed once)."""
        if reply is None:
            return True
        if reply.status == "fenced":
            self.step_down(f"a newer controller (epoch {as_text(reply.values[0])}) acts on run "
                           f"{run_id}")
            return True
        if reply.status == "corrupt":
            self.fail_corrupt(run_id, f"{self.keys.run(run_id)}: {as_text(reply.values[0])}")
            return True
        return False

    def fail_corrupt(self, run_id: str, reason: str) -> None:
        log.warning("run %s: corrupt record (%s); failing it", run_id, reason)
        self.runs.fail_corrupt(run_id, f"corrupt record at {reason}")
        self.stats.corrupt += 1

    def enqueue(self, queue_name: str, run_id: str, attempt: int) -> bool:
        try:
            return self.rq.enqueue(queue_name, run_id, attempt)
        except redis.RedisError as exc:  # the dispatch entry stays; a later pass retries
            log.warning("run %s attempt %s: enqueue failed (%s); will retry", run_id, attempt,
                        one_line(exc))
            return False

    def enqueue_many(self, queue_name: str, batch: list[tuple[str, int]]) -> bool:
        """Enqueue deliveries (run id, attempt) of one queue in one round trip; False when
        it failed (their dispatch checks stay due: a later pass retries)."""
        try:
            self.rq.enqueue_many(queue_name, batch)
        except redis.RedisError as exc:
            log.warning("enqueueing %s deliveries on %s failed (%s); will retry", len(batch),
                        queue_name, one_line(exc))
            return False
        return True

    def restart_grace(self) -> None:
        self._in_contact_since = time.monotonic()

    def _liveness_trusted(self) -> bool:
        """Lapsed beats mean lost workers only once the controller has been in steady
        contact with Redis for LIVENESS_GRACE_S (see there)."""
        since = self._in_contact_since
        return since is not None and time.monotonic() - since >= LIVENESS_GRACE_S

    # -- the controller's own duties, one at a time (tests, benches, tools) --------------

    def reap(self, now_ms: int | None = None) -> int:
        return self.reaping.reap(self, now_ms)

    def _reap_one(self, run_id: str, worker: str = "") -> int:
        return self.reaping.reap_one(self, run_id, worker)

    def reap_lost_workers(self) -> int:
        return self.lost_workers.reap_lost_workers(self)

    def dispatch(self, budget: int | None = None, now_ms: int | None = None) -> int:
        return self.dispatching.dispatch(self, budget, now_ms)

    def find_lost(self) -> int:
        return self.lost_deliveries.find_lost(self)

    def prune(self, budget: int = PRUNE_BUDGET) -> int:
        return self.pruning.prune(self, budget)

    # -- the loop ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The lease epoch that fences this controller's writes (0 when not leading)."""
        return self.lease.epoch if self.lease is not None else 0

    def recover(self) -> None:
        """On winning the lease, before anything new: claim every bucket of the lane (so a
        paused ex-leader that wakes has its writes refused everywhere), then finish what the
        previous leader left, kind by kind in RECOVERY_ORDER (controller/duties.py); one log
        line per kind with its count and the time it took.

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
        steps: list[tuple[str, Callable[[], int]]] = [
            (self.dispatching.kind, functools.partial(self.dispatching.recover, self))]
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

    def pass_once(self) -> None:
        """One pass as the leader: reaping first, so nothing waits behind dispatch checks.
        One read of the server clock serves the pass's reads of what is due."""
        started = time.monotonic()
        now_ms = self.server_ms()
        self.reaping.tick(self, now_ms)
        if self.lease is None:
            return
        if time.monotonic() - started > STALL_S:
            self._in_contact_since = time.monotonic()
        elif self._liveness_trusted():
            self.lost_workers.tick(self)
            if self.lease is None:
                return
        self.dispatching.tick(self, now_ms)
        self.lost_deliveries.tick(self)
        self.pruning.tick(self)
        for duty in self.duties:
            if self.lease is None:
                return
            try:
                duty.tick(self)
            except Exception as exc:
                if _outage(exc):
                    raise
                self.warn_once(f"duty:{duty.kind}", "%s failed (%s); carrying on", duty.kind,
                               one_line(exc))

    def step(self) -> bool:
        """Lead (or keep leading) this lane and make one pass; on winning the lease,
        recover first. True while it leads."""
        if not self.lead():
            if self._leading:
                self._leading = False
                self.watch.close()  # what it knew goes stale while another leads
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
        self.watch.close()
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
        self.watch.close()
        if self.lease is not None:
            try:
                self.store.release_lease(self.lease)
                log.info("released the controller lease")
            except (redis.RedisError, RedisUnavailableError) as exc:
                log.warning("could not release the controller lease (%s); it lapses",
                            one_line(exc))


def _lowest(buckets: list[int], replies: list[Any]) -> dict[int, float]:
    """Bucket -> the lowest score its index held (inf: empty), of the readable replies of
    ZRANGE 0 0 WITHSCORES."""
    out: dict[int, float] = {}
    for bucket, found in zip(buckets, replies, strict=False):
        if isinstance(found, list):
            out[bucket] = float(found[0][1]) if found else math.inf
    return out


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
