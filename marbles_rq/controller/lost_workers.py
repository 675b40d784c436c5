"""The controller's lost-workers duty: a worker that stopped beating (killed, frozen, cut
off: see transport/liveness.py) has its runs redelivered without waiting for their leases to
expire. The pass runs it only once the controller has been in steady contact with Redis for
LIVENESS_GRACE_S (see there).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..store.replies import as_text
from ..transport.liveness import WORKER_BEAT_S, WORKER_TTL_MS
from .reaping import reap_runs

if TYPE_CHECKING:
    from .context import PassContext

log = logging.getLogger("marbles_rq.controller")

LOST_WORKERS_BATCH = 100  # lost workers handled per pass
# Lost workers are believed only after this long in contact with Redis (since the controller
# started, won the lease, or got through an outage): workers cut off by the same outage beat
# again within a beat once it ends, and must not all be taken for lost.
LIVENESS_GRACE_S = WORKER_TTL_MS / 1000 + WORKER_BEAT_S
STALL_S = 1.0  # a pass this slow to reach the lost workers' read, or that read itself, met a
               # stalled Redis: beats may not have landed either; the grace starts again
# With several lanes, each lane's controller handles a lost worker's runs in its own buckets,
# so nobody may take the worker off the liveness index at once: lane 0's controller does,
# this long after it was lost (every lane's leader has seen it by then; a run in a lane
# nobody led that long is reaped when its lease expires).
FORGET_LOST_AFTER_MS = 30_000


class LostWorkers:
    kind = "lost_workers"

    def __init__(self) -> None:
        self._lost_seen: set[tuple[str, int]] = set()  # lost workers handled (lanes > 1)

    def tick(self, ctl: PassContext) -> None:
        self.reap_lost_workers(ctl)

    def reap_lost_workers(self, ctl: PassContext) -> int:
        """Redeliver the runs of workers that stopped beating (killed, frozen, cut off: see
        transport/liveness.py), without waiting for their leases. One read per pass; a lost
        worker costs one look at the worker of every executing run (rare: a crash)."""
        asked = time.monotonic()
        now = ctl.server_ms()
        lapsed: Any = ctl.store.client.zrangebyscore(
            ctl.keys.workers, "-inf", now, start=0, num=LOST_WORKERS_BATCH, withscores=True)
        found = {(as_text(w), int(score)) for w, score in lapsed}
        if not found:
            self._lost_seen.clear()
            return 0
        if time.monotonic() - asked > STALL_S:
            ctl.restart_grace()
            return 0
        # With several lanes a lost worker stays on the index for a while (see
        # FORGET_LOST_AFTER_MS): look at the executing runs once per worker lost.
        lost = {w for w, score in found if (w, score) not in self._lost_seen}
        done = 0
        if lost:
            mine = [(run_id, worker) for run_id, worker in self._executing(ctl) if worker in lost]
            for run_id, worker in mine:
                log.warning("run %s: its worker %s is lost (no liveness beat)", run_id, worker)
            done = reap_runs(ctl, mine)
            if ctl.lease is None:
                return done
        self._lost_seen = found
        if ctl.keys.lanes == 1:
            forget, cutoff = sorted(w for w, _ in found), now
        elif ctl.lane == 0:
            cutoff = now - FORGET_LOST_AFTER_MS
            forget = sorted(w for w, score in found if score <= cutoff)
        else:
            forget = []
        if forget:
            ctl.runs.scripts.forget_workers(workers_key=ctl.keys.workers, workers=forget,
                                            cutoff_ms=cutoff, lanes_key=ctl.keys.worker_lanes,
                                            versions_key=ctl.keys.worker_versions)
        return done

    def _executing(self, ctl: PassContext) -> list[tuple[str, str]]:
        """(run id, worker) of every run holding a lease, read in pipelines."""
        pipe = ctl.store.client.pipeline(transaction=False)
        for bucket in ctl.buckets:
            pipe.zrange(ctl.keys.run_leases(bucket), 0, -1)
        ids = [as_text(rid) for part in pipe.execute(raise_on_error=False)
               if not isinstance(part, Exception) for rid in part]
        out: list[tuple[str, str]] = []
        for i in range(0, len(ids), 1000):
            chunk = ids[i:i + 1000]
            pipe = ctl.store.client.pipeline(transaction=False)
            for rid in chunk:
                pipe.hget(ctl.keys.run(rid), "worker")
            out += [(rid, as_text(w)) for rid, w in zip(chunk, pipe.execute(raise_on_error=False),
                                                   strict=True)
                    if isinstance(w, bytes)]
        return out
