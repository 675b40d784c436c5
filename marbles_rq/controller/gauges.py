"""The controller's scrape-time gauges: queue depths (per queue and lane) and waiting runs,
read from Redis when Prometheus scrapes, on connections of their own with a short timeout
(metrics.StoreGauges). Only the controller serves them: one process per deployment answers
for the whole fleet, whether or not it leads (a standby reads the same keys)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..metrics import StoreGauges, scrape_client
from ..transport import dispatch
from ..transport.lanes import as_lanes

if TYPE_CHECKING:
    from ..engine.runs import RunStore
    from ..transport.lanes import RQLike


def store_gauges(runs: RunStore, rq: RQLike) -> StoreGauges:
    """Gauges read from the store and RQ at scrape time, over every lane (any controller
    process may serve them, whichever lanes it leads)."""
    keys = runs.keys
    lanes_all = as_lanes(rq, keys)
    # One scrape client per distinct connection: every lane of a standalone Redis shares one.
    clients: dict[int, Any] = {}
    lanes = [(lane.index, lane.rq_prefix,
              clients.setdefault(id(lane.conn), scrape_client(lane.conn)))
             for lane in lanes_all.lanes]
    store = scrape_client(runs.store.client)

    def queues() -> dict[tuple[str, str], tuple[int, int]]:
        depths: dict[tuple[str, str], tuple[int, int]] = {}
        for index, rq_prefix, conn in lanes:
            for name, counts in dispatch.queue_depths(conn, keys.prefix, rq_prefix).items():
                depths[(name, str(index))] = counts
        return depths

    def waiting() -> tuple[int, int]:
        pipe: Any = store.pipeline(transaction=False)
        for bucket in range(keys.buckets):
            pipe.zcard(keys.run_waits(bucket))
            pipe.zcard(keys.feed(bucket))
        counts = pipe.execute()
        return sum(counts[0::2]), sum(counts[1::2])

    return StoreGauges(queues, waiting)
