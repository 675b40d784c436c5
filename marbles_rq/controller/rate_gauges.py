"""The controller's scrape-time gauge of rate limits: runs each limit holds (engine/
rate_limits.py), read from the store when scraped. Limits per key are summed under their
family (the workflow's name), so the label stays low-cardinality."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis

from ..metrics import bounded, redis_error

if TYPE_CHECKING:
    from ..engine.runs import RunStore


class RateGauges:
    """``marbles_rq_rate_held{limit}``: runs held by each rate limit, now."""

    def __init__(self, runs: RunStore) -> None:
        self.runs = runs

    def describe(self) -> list[Any]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from ..flow.rate_store import catalog_rates

        try:
            found = self.runs.rates().list(catalog_rates(self.runs.client, self.runs.keys))
        except redis.RedisError as exc:
            redis_error(exc)
            return
        held: dict[str, int] = {}
        for info in found:
            label = bounded("limit", info.family)
            held[label] = held.get(label, 0) + info.held
        gauge = GaugeMetricFamily("marbles_rq_rate_held", "Runs a rate limit holds now "
                                  "(parked until their turn), by limit (a workflow's limit "
                                  "per key summed under the workflow's name).",
                                  labels=["limit"])
        for label, count in sorted(held.items()):
            gauge.add_metric([label], count)
        yield gauge
