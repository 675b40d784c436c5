"""The controller's scrape-time gauges: queue depths and waiting runs, read from Redis when
Prometheus scrapes, on connections of their own with a short timeout (metrics.StoreGauges).
Only the controller serves them: one process per deployment answers for the whole fleet,
whether or not it leads (a standby reads the same keys)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..metrics import StoreGauges, scrape_client
from ..transport import dispatch

if TYPE_CHECKING:
    from .loop import Controller


def store_gauges(ctl: Controller) -> StoreGauges:
    rq = scrape_client(ctl.rq)
    store = scrape_client(ctl.store.client)
    keys = ctl.keys

    def queues() -> dict[str, tuple[int, int]]:
        return dispatch.queue_depths(rq, keys.prefix)

    def waiting() -> tuple[int, int]:
        pipe: Any = store.pipeline(transaction=False)
        for bucket in range(keys.buckets):
            pipe.zcard(keys.run_waits(bucket))
            pipe.zcard(keys.feed(bucket))
        counts = pipe.execute()
        return sum(counts[0::2]), sum(counts[1::2])

    return StoreGauges(queues, waiting)
