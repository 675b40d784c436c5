"""The controller's lost-deliveries duty: a delivery RQ lost before its run started (popped
by a worker that died before the start, or failed inside RQ) is delivered again as
attempt + 1, fenced by the controller's epoch in the run's bucket (redispatch_run). It reads
only the deliveries in flight of its own lane's RQ keyspace.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from .. import metrics
from ..engine.execution import DISPATCH_GRACE_MS, event
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text
from ..transport import dispatch

if TYPE_CHECKING:
    from .context import PassContext

log = logging.getLogger("marbles_rq.controller")

LOST_AFTER_S = 5.0        # a popped delivery whose run has not started by then was lost


class LostDeliveries:
    kind = "lost_deliveries"

    def __init__(self, in_flight: list[dispatch.InFlight],
                 lost_after_s: float = LOST_AFTER_S) -> None:
        # Its own lane's deliveries in flight only: each lane is its own RQ keyspace, read
        # by that lane's controller.
        self.in_flight = in_flight
        self.lost_after_s = lost_after_s
        self._lost: dict[tuple[str, int], float] = {}  # popped, unstarted -> first seen
        self._failed: set[tuple[str, int]] = set()  # failed in RQ; kept until resolved

    def tick(self, ctl: PassContext) -> None:
        self.find_lost(ctl)

    def find_lost(self, ctl: PassContext) -> int:
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
        assert ctl.lease is not None
        popped_ids: set[str] = set()
        failed_ids: set[str] = set()
        for lane in self.in_flight:
            try:
                popped, failed = lane.job_ids()
            except redis.RedisError as exc:  # one lane's node away: the others go on
                if is_outage(exc) and len(self.in_flight) == 1:
                    raise
                ctl.warn_once(f"in-flight:{lane.rq_prefix}", "cannot read lane %s's "
                              "deliveries in flight (%s)", lane.rq_prefix, one_line(exc))
                continue
            popped_ids |= popped
            failed_ids |= failed
        popped_job: dict[tuple[str, int], str] = {}
        for job_id in popped_ids:
            parsed = self._parse(ctl, job_id)
            if parsed is not None:
                popped_job[parsed] = job_id
        self._failed.update(p for p in (self._parse(ctl, job_id) for job_id in failed_ids)
                            if p is not None)
        candidates = sorted(set(popped_job) | self._failed)
        now = time.monotonic()
        if not candidates:
            self._lost.clear()
            return 0
        pipe = ctl.store.client.pipeline(transaction=False)
        for run_id, _ in candidates:
            pipe.hmget(ctl.keys.run(run_id), "status", "attempt")
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
            if self._redispatch(ctl, run_id, attempt, cause):
                done += 1
        self._lost = still
        if over:
            for lane in self.in_flight:
                lane.forget(over)
        return done

    def _parse(self, ctl: PassContext, job_id: str) -> tuple[str, int] | None:
        """(run id, attempt) of a delivery of this lane's buckets (RQ's keyspace may hold
        other lanes' deliveries: their controllers judge those), else None."""
        parsed = dispatch.parse_delivery_id(ctl.keys.prefix, job_id)
        if parsed is None or ctl.keys.bucket_of(parsed[0]) not in ctl.buckets:
            return None
        return parsed

    def _redispatch(self, ctl: PassContext, run_id: str, attempt: int, cause: str) -> bool:
        assert ctl.lease is not None
        epoch = ctl.lease.epoch
        reply = ctl.run_script(run_id, lambda: ctl.runs.scripts.redispatch_run(
            keys=ctl.keys.run_keys(run_id), run_id=run_id, attempt=attempt, ctl_epoch=epoch,
            grace_ms=DISPATCH_GRACE_MS, final_gave_up=event(status="failed", error={
                "type": "DeliveriesExhausted", "message": "deliveries kept getting lost"})))
        if ctl.handled(run_id, reply):
            return False
        if reply.status == "gave_up":
            log.warning("run %s: deliveries used up (%s); failed", run_id, as_text(reply.values[0]))
            ctl.stats.settled += 1
            return False
        if reply.status != "redelivered":
            return False
        new_attempt, queue_name = int(reply.values[0]), as_text(reply.values[1])
        log.warning("run %s: delivery %s was lost inside RQ before it started; redelivering "
                    "as attempt %s", run_id, attempt, new_attempt)
        ctl.enqueue(queue_name, run_id, new_attempt)
        ctl.stats.redelivered += 1
        metrics.redelivered(queue_name, cause)
        return True
