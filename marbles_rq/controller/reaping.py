"""The controller's reaping duty: a run whose lease expired had its execution vanish (its
worker killed, frozen or cut off past the lease); it is redelivered as attempt + 1 under the
same run id, or settled when it was cancelled or used up its deliveries. Every reap is
fenced by the controller's epoch in the run's bucket (reap_run). The lost-workers duty
(controller/lost_workers.py) reaps through `reap_runs` too, without waiting for leases.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import redis

from .. import metrics
from ..engine.execution import DISPATCH_GRACE_MS, event
from ..errors import MarblesError
from ..flow.limits import release_vanished
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text

if TYPE_CHECKING:
    from .context import PassContext

log = logging.getLogger("marbles_rq.controller")

REAP_BATCH = 200          # expired leases read per bucket per pass
REAP_CANCELLED = event(status="cancelled", reason="cancel requested; its execution had vanished")
REAP_GAVE_UP = event(status="failed", error={"type": "DeliveriesExhausted",
                                             "message": "executions kept vanishing"})


class Reaping:
    kind = "reaping"

    def tick(self, ctl: PassContext, now_ms: int | None = None) -> None:
        self.reap(ctl, now_ms)

    def reap(self, ctl: PassContext, now_ms: int | None = None) -> int:
        """Redeliver every run whose lease expired (attempt + 1, same run id)."""
        now_ms = ctl.server_ms() if now_ms is None else now_ms
        return reap_runs(ctl, [(run_id, "") for _, run_id in
                               ctl.due(ctl.keys.run_leases, now_ms, REAP_BATCH)])

    def reap_one(self, ctl: PassContext, run_id: str, worker: str = "") -> int:
        """reap_run for one run (worker: a lost worker's name, or "" for an expired lease);
        1 if it was redelivered."""
        return reap_runs(ctl, [(run_id, worker)])


def reap_runs(ctl: PassContext, items: list[tuple[str, str]]) -> int:
    """reap_run for (run id, worker) pairs in one pipeline (one per master on a
    cluster), then their redeliveries enqueued in one round trip per queue; returns how
    many were redelivered. A run whose script fails costs only its own turn (see
    PassContext.run_script); a fenced reply steps this lane down after the batch."""
    if not items:
        return 0
    assert ctl.lease is not None
    epoch = ctl.lease.epoch
    replies = ctl.runs.scripts.reap_runs([
        (ctl.keys.run_keys(run_id), run_id, epoch, DISPATCH_GRACE_MS, REAP_CANCELLED,
         REAP_GAVE_UP, worker) for run_id, worker in items])
    deliveries: dict[str, list[tuple[str, int]]] = defaultdict(list)
    done = 0
    fenced: tuple[str, Any] | None = None
    for (run_id, worker), reply in zip(items, replies, strict=True):
        if isinstance(reply, redis.ResponseError):
            if is_outage(reply):
                raise reply
            ctl.warn_once(f"script:{run_id}", "run %s: a script failed on its keys (%s); "
                          "skipped", run_id, one_line(reply))
            continue
        if reply.status == "fenced":
            fenced = fenced or (run_id, reply.values[0])
            continue
        if reply.status == "corrupt":
            ctl.fail_corrupt(run_id, f"{ctl.keys.run(run_id)}: {as_text(reply.values[0])}")
            continue
        if not worker and reply.status in ("redelivered", "cancelled", "gave_up"):
            metrics.lease_expired(reply.status)
        if reply.status == "redelivered":
            attempt, queue_name = int(reply.values[0]), as_text(reply.values[1])
            log.info("run %s: execution vanished (%s); redelivering as attempt %s", run_id,
                     f"worker {worker} lost" if worker else "lease expired", attempt)
            if len(reply.values) > 2 and reply.values[2]:
                # Flow control: free the vanished execution's concurrency slot now.
                release_vanished(ctl.runs, run_id, attempt - 1, as_text(reply.values[2]))
            deliveries[queue_name].append((run_id, attempt))
            ctl.stats.redelivered += 1
            metrics.redelivered(queue_name, "worker_lost" if worker else "lease_expired")
            done += 1
        elif reply.status in ("cancelled", "gave_up"):
            if len(reply.values) > 1 and reply.values[1]:
                # A settled run executes no more: its slot is free now, not at expiry.
                release_vanished(ctl.runs, run_id, int(reply.values[0]),
                                 as_text(reply.values[1]))
            log.info("run %s: %s", run_id, reply.status)
            if reply.status == "cancelled":
                _cancel_children(ctl, run_id)
            ctl.stats.settled += 1
    for queue_name, batch in deliveries.items():
        if len(batch) == 1:
            ctl.enqueue(queue_name, *batch[0])
        else:
            ctl.enqueue_many(queue_name, batch)
    if fenced is not None:
        ctl.step_down(f"a newer controller (epoch {as_text(fenced[1])}) acts on run "
                      f"{fenced[0]}")
    return done

def _cancel_children(ctl: PassContext, run_id: str) -> None:
    """A run the reaper settled cancelled: its children go with it, as when its execution
    settles it (engine/execute.settle_stopped). Children recorded after a cancel's own
    walk (the body started one before it saw the cancel, then its worker died) are
    reached only here."""
    try:
        children = ctl.runs.waits().cancel_children(run_id)
    except (redis.RedisError, MarblesError) as exc:
        log.warning("run %s: cannot cancel its children (%s)", run_id, one_line(exc))
        return
    if children:
        log.info("run %s: cancelled %s child runs with it", run_id, len(children))
