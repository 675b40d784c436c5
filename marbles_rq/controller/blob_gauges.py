"""The controller's scrape-time metrics of the blob store (payloads/blobs.py), read from
the index's counts when scraped: blobs and bytes indexed now, and blobs collected since the
deployment began (a counter kept in Redis, so it survives a change of leader)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .scrape_gauges import ScrapeGauges


class BlobGauges(ScrapeGauges):
    """``marbles_rq_blobs``, ``marbles_rq_blob_bytes``, ``marbles_rq_blobs_collected_total``."""

    def read(self) -> Any:
        stats: Any = self.runs.store.client.hgetall(self.runs.keys.blobs_stats)
        return {k.decode(): int(v) for k, v in stats.items()}

    def families(self, found: Any) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("marbles_rq_blobs", "Blobs in the blob store (offloaded "
                                "payloads, artifact contents), as indexed.",
                                value=found.get("blobs", 0))
        yield GaugeMetricFamily("marbles_rq_blob_bytes", "Bytes of the blobs in the blob "
                                "store, as indexed.", value=found.get("bytes", 0))
        yield CounterMetricFamily("marbles_rq_blobs_collected", "Blobs the controller's "
                                  "collection deleted (no holder referenced them).",
                                  value=found.get("collected", 0))
