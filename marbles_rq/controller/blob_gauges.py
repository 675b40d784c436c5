"""The controller's scrape-time metrics of the blob store (payloads/blobs.py), read from
the index's counts when scraped: blobs and bytes indexed now, and blobs collected since the
deployment began (a counter kept in Redis, so it survives a change of leader)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis

from ..metrics import redis_error

if TYPE_CHECKING:
    from ..engine.runs import RunStore


class BlobGauges:
    """``marbles_rq_blobs``, ``marbles_rq_blob_bytes``, ``marbles_rq_blobs_collected_total``."""

    def __init__(self, runs: RunStore) -> None:
        self.runs = runs

    def describe(self) -> list[Any]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            stats: Any = self.runs.store.client.hgetall(self.runs.keys.blobs_stats)
        except redis.RedisError as exc:
            redis_error(exc)
            return
        got = {k.decode(): int(v) for k, v in stats.items()}
        yield GaugeMetricFamily("marbles_rq_blobs", "Blobs in the blob store (offloaded "
                                "payloads, artifact contents), as indexed.",
                                value=got.get("blobs", 0))
        yield GaugeMetricFamily("marbles_rq_blob_bytes", "Bytes of the blobs in the blob "
                                "store, as indexed.", value=got.get("bytes", 0))
        yield CounterMetricFamily("marbles_rq_blobs_collected", "Blobs the controller's "
                                  "collection deleted (no holder referenced them).",
                                  value=got.get("collected", 0))
