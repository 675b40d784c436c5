"""The controller's dispatch duty: a recorded delivery whose RQ job never came to be (a
crash between recording and enqueueing, a failed enqueue, a deferral) is enqueued once its
dispatch check comes due, after the enqueuer's grace. Each pass makes at most `budget`
checks, so a burst of enqueues never delays what the pass does next; on election every
check due is made at once (`recover`: the recorded child runs among them).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .. import metrics
from ..store.redis_errors import is_outage
from ..store.replies import as_text

if TYPE_CHECKING:
    from .context import PassContext

log = logging.getLogger("marbles_rq.controller")

DISPATCH_BUDGET = 1_000   # dispatch checks per pass, over all buckets
RECOVERY_BATCH = 5_000    # dispatch checks per round while recovering
RECOVERY_ROUNDS = 1_000   # at most 5,000,000 entries; the rest are due in later passes


class Dispatching:
    kind = "children"  # what its recovery finishes (RECOVERY_ORDER)

    def __init__(self, budget: int = DISPATCH_BUDGET) -> None:
        self.budget = budget

    def tick(self, ctl: PassContext, now_ms: int | None = None) -> None:
        self.dispatch(ctl, now_ms=now_ms)

    def recover(self, ctl: PassContext) -> int:
        """Recorded runs (children included) whose delivery never reached RQ: all of them
        now, not one budget per pass."""
        done = 0
        for _ in range(RECOVERY_ROUNDS):
            if ctl.lease is None:
                break
            checked, dispatched = self._dispatch_round(ctl, RECOVERY_BATCH)
            done += dispatched
            if not checked:  # nothing due is left (a round reads a bounded number per bucket)
                break
        return done

    def dispatch(self, ctl: PassContext, budget: int | None = None,
                 now_ms: int | None = None) -> int:
        """One round of dispatch checks (see `_dispatch_round`); returns how many
        deliveries it enqueued."""
        return self._dispatch_round(ctl, budget, now_ms)[1]

    def _dispatch_round(self, ctl: PassContext, budget: int | None = None,
                        now_ms: int | None = None) -> tuple[int, int]:
        """Each recorded delivery is checked once, after the enqueuer's grace: enqueue it if
        RQ has no job for it (a crash between recording and enqueueing, a failed enqueue, a
        deferral), then drop the check. At most `budget` checks per pass; the
        missing deliveries are enqueued in one pipeline per queue. Returns (checks made,
        deliveries enqueued)."""
        budget = budget or self.budget
        per_bucket = 2 * -(-budget // len(ctl.buckets))
        due = ctl.due(ctl.keys.run_dispatch, ctl.server_ms() if now_ms is None else now_ms,
                      per_bucket, budget)
        if not due:
            return 0, 0
        pipe = ctl.store.client.pipeline(transaction=False)
        for _, run_id in due:
            pipe.hmget(ctl.keys.run(run_id), "status", "attempt", "queue")
        states = pipe.execute(raise_on_error=False)
        checked: list[tuple[str, str]] = []  # (run id, attempt seen) whose check is done
        queued: list[tuple[str, int, str]] = []
        for (_, run_id), st in zip(due, states, strict=True):
            if isinstance(st, Exception) or (st[0] == b"queued" and not _is_int(st[1])):
                if isinstance(st, Exception) and is_outage(st):
                    raise st
                ctl.fail_corrupt(run_id, f"{ctl.keys.run(run_id)}: unreadable status/attempt")
            elif st[0] == b"queued":
                queued.append((run_id, int(st[1]), as_text(st[2] or b"default")))
            else:  # missing, running or settled: nothing left to dispatch
                checked.append((run_id, ""))
        exists = ctl.rq.deliveries_exist([(rid, a) for rid, a, _ in queued])
        missing: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for (run_id, attempt, queue_name), present in zip(queued, exists, strict=True):
            if present:
                checked.append((run_id, str(attempt)))
            else:
                missing[queue_name].append((run_id, attempt))
        done = 0
        for queue_name, batch in missing.items():
            if not ctl.enqueue_many(queue_name, batch):
                continue  # the checks stay due; a later pass retries
            for run_id, attempt in batch:
                if len(batch) <= 20:
                    log.info("run %s: dispatched attempt %s (it was not in RQ)", run_id,
                             attempt)
                checked.append((run_id, str(attempt)))
            if len(batch) > 20:
                log.info("dispatched %s deliveries on %s (they were not in RQ)", len(batch),
                         queue_name)
            ctl.stats.dispatched += len(batch)
            metrics.redelivered_many(queue_name, "not_in_rq", len(batch))
            done += len(batch)
        if checked:
            keys, bucket_of = ctl.keys, {run_id: bucket for bucket, run_id in due}
            ctl.runs.scripts.dispatch_done(
                [(keys.run(rid), keys.run_dispatch(bucket_of[rid]), rid, attempt)
                 for rid, attempt in checked])
        return len(due), done


def _is_int(value: Any) -> bool:
    """A delivery number as the scripts write it: digits only (no sign, no 1.5, no inf)."""
    return isinstance(value, bytes) and value.isdigit() and 0 < len(value) <= 15
