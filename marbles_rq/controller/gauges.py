"""The controller's scrape-time gauges: queue depths (per queue and lane), waiting runs, open
questions and the oldest one's age, live workers per lane, read from Redis when Prometheus
scrapes, on connections of their own with a short timeout (metrics.StoreGauges); and which
lanes this controller process leads, from its own memory. Only controllers serve them. The
ones read from Redis say the same from every controller of a deployment, whether or not it
leads (aggregate them with max); the lane leader gauge is each process's own (sum it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import redis

from ..metrics import StoreGauges, scrape_client
from ..transport import dispatch
from ..transport.lanes import as_lanes
from ..transport.liveness import lane_workers

if TYPE_CHECKING:
    from ..engine.runs import RunStore
    from ..transport.lanes import RQLike


def store_gauges(runs: RunStore, rq: RQLike,
                 leading: Callable[[], Collection[int]] | None = None) -> StoreGauges:
    """Gauges read from the store and RQ at scrape time, over every lane (any controller
    process may serve them, whichever lanes it leads); `leading`: the lanes this process
    leads now."""
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

    def waiting() -> tuple[int, int, float]:
        pipe: Any = store.pipeline(transaction=False)
        for bucket in range(keys.buckets):
            pipe.zcard(keys.run_waits(bucket))
            pipe.zcard(keys.feed(bucket))
            pipe.zrange(keys.feed(bucket), 0, 0, withscores=True)  # scored by when asked
        replies = pipe.execute()
        asked = [first[0][1] for first in replies[2::3] if first]
        oldest_s = max(0.0, now_ms(store) - min(asked)) / 1000 if asked else 0.0
        return sum(replies[0::3]), sum(replies[1::3]), oldest_s

    def workers() -> dict[int, int]:
        return {lane: len(names) for lane, names in lane_workers(runs, store).items()}

    def led() -> tuple[int, Collection[int]]:
        return keys.lanes, leading() if leading is not None else ()

    def memory() -> list[tuple[str, int, int]]:
        info = store.info("memory")
        # A cluster client answers per node: {"host:port": {...}}.
        per_node = {"": info} if "used_memory" in info else info
        out = []
        for node, fields in sorted(per_node.items()):
            name = node or _address(store)
            limit = int(fields.get("maxmemory") or 0) or int(fields.get("total_system_memory")
                                                              or 0)
            out.append((name, int(fields.get("used_memory") or 0), limit))
        return out

    return StoreGauges(queues, waiting, workers, led if leading is not None else None,
                       memory)


def _address(client: Any) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}")


def now_ms(client: Any) -> float:
    """The server's clock (questions are stamped with it); a cluster's first node's."""
    if isinstance(client, redis.Redis):
        secs, micros = client.time()
        return int(secs) * 1000 + int(micros) / 1000
    return time.time() * 1000
