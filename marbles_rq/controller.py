"""`marbles-rq controller`: one elected controller redelivers runs whose execution vanished
and dispatches runs that were recorded but never reached RQ. A second controller waits and
takes over when the first one's lease lapses.

Election is a lease with a fencing epoch; correctness comes from the fence: every write the
controller makes (reap_run) checks, in the bucket it changes, that no newer controller has
written there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from . import dispatch
from .errors import RedisUnavailableError
from .runs import DISPATCH_GRACE_MS, TERMINAL, RunStore, event
from .store import Lease

log = logging.getLogger("marbles_rq.controller")

LEASE_NAME = "controller"
BATCH = 200
LOST_AFTER_S = 5.0


@dataclass
class Stats:
    redelivered: int = 0
    dispatched: int = 0
    settled: int = 0


class Controller:
    def __init__(self, runs: RunStore, rq: redis.Redis, *, lease_ms: int = 10_000,
                 interval_s: float = 0.5, recheck_ms: int = 30_000,
                 lost_after_s: float = LOST_AFTER_S) -> None:
        self.runs, self.rq = runs, rq
        self.store = runs.store
        self.keys = runs.keys
        self.lease_ms, self.interval_s, self.recheck_ms = lease_ms, interval_s, recheck_ms
        self.lost_after_s = lost_after_s
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease: Lease | None = None
        self.stats = Stats()
        self.stop_event = threading.Event()
        self._missing: dict[tuple[str, int], float] = {}  # (run, attempt) -> first seen lost

    # -- election -----------------------------------------------------------------------------

    def lead(self) -> bool:
        """Hold the controller lease; True while this process may act."""
        now = time.monotonic()
        if self.lease is not None and now < self.lease.valid_until - self.lease_ms / 3000:
            return True  # renew only every third of the lease
        if self.lease is not None:
            renewed = self.store.renew_lease(self.lease)
            if renewed is None:
                log.warning("lost the controller lease (epoch %s)", self.lease.epoch)
            self.lease = renewed
        if self.lease is None:
            got = self.store.acquire_lease(LEASE_NAME, self.token, self.lease_ms)
            if isinstance(got, Lease):
                self.lease = got
                log.info("elected controller, epoch %s", got.epoch)
        return self.lease is not None and time.monotonic() < self.lease.valid_until

    # -- one pass ---------------------------------------------------------------------------

    def server_ms(self) -> int:
        # Leases are scored in the server's clock; compare in the same clock.
        secs, micros = self.store.client.time()
        return int(secs) * 1000 + int(micros) // 1000

    def _due(self, key_of: Any, now_ms: int) -> list[tuple[int, str]]:
        pipe = self.store.client.pipeline(transaction=False)
        buckets = range(self.keys.buckets)
        for bucket in buckets:
            pipe.zrangebyscore(key_of(bucket), "-inf", now_ms, start=0, num=BATCH)
        return [(b, _s(rid)) for b, ids in zip(buckets, pipe.execute(), strict=True)
                for rid in ids]

    def reap(self) -> int:
        """Redeliver every run whose lease expired (attempt + 1, same run id)."""
        assert self.lease is not None
        done = 0
        for _, run_id in self._due(self.keys.run_leases, self.server_ms()):
            reply = self.runs.scripts.reap_run(
                keys=self.keys.run_keys(run_id), run_id=run_id, ctl_epoch=self.lease.epoch,
                grace_ms=DISPATCH_GRACE_MS,
                final_cancel=event(status="cancelled", reason="cancel requested; its "
                                   "execution had vanished"),
                final_gave_up=event(status="failed", error={
                    "type": "DeliveriesExhausted", "message": "executions kept vanishing"}))
            if reply.status == "fenced":
                log.warning("a newer controller (epoch %s) acts on run %s; stepping down",
                            _s(reply.values[0]), run_id)
                self.lease = None
                return done
            if reply.status == "redelivered":
                attempt, queue_name = int(reply.values[0]), _s(reply.values[1])
                log.info("run %s: execution vanished; redelivering as attempt %s", run_id,
                         attempt)
                self._enqueue(queue_name, run_id, attempt)
                self.stats.redelivered += 1
                done += 1
            elif reply.status in ("cancelled", "gave_up"):
                log.info("run %s: %s", run_id, reply.status)
                self.stats.settled += 1
        return done

    def dispatch(self) -> int:
        """Enqueue recorded deliveries that never reached RQ (a crash between recording and
        enqueueing, or an enqueue that failed)."""
        due = self._due(self.keys.run_dispatch, self.server_ms())
        if not due:
            return 0
        pipe = self.store.client.pipeline(transaction=False)
        for _, run_id in due:
            pipe.hmget(self.keys.run(run_id), "status", "attempt", "queue")
        states = pipe.execute()
        debris = [(b, rid) for (b, rid), st in zip(due, states, strict=True)
                  if st[0] is None or _s(st[0]) in TERMINAL]
        if debris:  # purged or settled runs: nothing left to dispatch
            pipe = self.store.client.pipeline(transaction=False)
            for bucket, run_id in debris:
                pipe.zrem(self.keys.run_dispatch(bucket), run_id)
            pipe.execute()
        queued = [(b, rid, int(st[1]), _s(st[2])) for (b, rid), st in zip(due, states, strict=True)
                  if st[0] == b"queued"]
        present = dispatch.deliveries_exist(self.rq, self.keys.prefix,
                                            [(rid, a) for _, rid, a, _ in queued])
        done = 0
        for (_, run_id, attempt, queue_name), exists in zip(queued, present, strict=True):
            if not exists and self._enqueue(queue_name, run_id, attempt):
                log.info("run %s: dispatched attempt %s (it never reached RQ)", run_id, attempt)
                self.stats.dispatched += 1
                done += 1
        done += self._find_lost([q for q, e in zip(queued, present, strict=True) if e])
        # Check again later: a delivery waiting in a long queue is normal.
        later = self.server_ms() + self.recheck_ms
        pipe = self.store.client.pipeline(transaction=False)
        for bucket, run_id in due:
            pipe.zadd(self.keys.run_dispatch(bucket), {run_id: later}, xx=True)
        pipe.execute()
        return done

    def _find_lost(self, queued: list[tuple[int, str, int, str]]) -> int:
        """A delivery whose job exists but is in no queue list, on two checks LOST_AFTER_S
        apart, while its run has not started, was lost inside RQ: deliver attempt + 1."""
        assert self.lease is not None
        waiting = dispatch.deliveries_waiting(self.rq, self.keys.prefix,
                                              [(q, rid, a) for _, rid, a, q in queued])
        now, done = time.monotonic(), 0
        for (_, run_id, attempt, _q), is_waiting in zip(queued, waiting, strict=True):
            if is_waiting:
                self._missing.pop((run_id, attempt), None)
                continue
            first = self._missing.setdefault((run_id, attempt), now)
            if now - first < self.lost_after_s:
                continue
            reply = self.runs.scripts.redispatch_run(
                keys=self.keys.run_keys(run_id), run_id=run_id, attempt=attempt,
                ctl_epoch=self.lease.epoch, grace_ms=DISPATCH_GRACE_MS)
            if reply.status == "redelivered":
                new_attempt, queue_name = int(reply.values[0]), _s(reply.values[1])
                log.warning("run %s: delivery %s was lost inside RQ; redelivering as "
                            "attempt %s", run_id, attempt, new_attempt)
                self._enqueue(queue_name, run_id, new_attempt)
                self.stats.redelivered += 1
                done += 1
            self._missing.pop((run_id, attempt), None)
        for key in [k for k, t in self._missing.items() if now - t > 3600]:
            del self._missing[key]  # runs that started or settled meanwhile
        return done

    def _enqueue(self, queue_name: str, run_id: str, attempt: int) -> bool:
        try:
            return dispatch.enqueue_delivery(self.rq, self.keys.prefix, queue_name, run_id,
                                             attempt)
        except redis.RedisError as exc:  # the dispatch pass retries it
            log.warning("run %s attempt %s: enqueue failed (%s); will retry", run_id, attempt,
                        exc)
            return False

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        log.info("controller %s started (lease %s ms)", self.token, self.lease_ms)
        leading = False
        while not self.stop_event.is_set():
            try:
                if self.lead():
                    if not leading:
                        log.info("recovering: dispatching recorded runs, reaping expired leases")
                    leading = True
                    self.dispatch()
                    self.reap()
                elif leading:
                    leading = False
                    log.warning("no longer the controller; waiting to take over")
            except (redis.ConnectionError, redis.TimeoutError, RedisUnavailableError) as exc:
                log.error("Redis unavailable (%s); retrying", exc)
                self.stop_event.wait(1.0)
            self.stop_event.wait(self.interval_s)
        if self.lease is not None:
            self.store.release_lease(self.lease)
            log.info("released the controller lease")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
