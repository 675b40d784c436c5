"""What the controller's scrape-time collectors share: each reads the store when Prometheus
scrapes (never at registration), and a Redis error costs that scrape its families, counted
by `redis_error`, instead of failing the whole endpoint."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import redis

from ..metrics import bounded, redis_error

if TYPE_CHECKING:
    from ..engine.runs import RunStore


class ScrapeGauges:
    """A collector whose `read` takes what it reports from the store and whose `families`
    turns that into metric families."""

    def __init__(self, runs: RunStore) -> None:
        self.runs = runs

    def describe(self) -> list[Any]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[Any]:
        try:
            found = self.read()
        except redis.RedisError as exc:
            redis_error(exc)
            return
        yield from self.families(found)

    def read(self) -> Any:
        raise NotImplementedError

    def families(self, found: Any) -> Iterator[Any]:
        raise NotImplementedError


def summed_gauge(name: str, doc: str, label: str, counts: Iterable[tuple[str, int]]) -> Any:
    """A gauge with one label whose values come from users (bounded: past the cap they count
    under "other"), each label's counts summed."""
    from prometheus_client.core import GaugeMetricFamily

    totals: dict[str, int] = {}
    for value, count in counts:
        key = bounded(label, value)
        totals[key] = totals.get(key, 0) + count
    gauge = GaugeMetricFamily(name, doc, labels=[label])
    for key, count in sorted(totals.items()):
        gauge.add_metric([key], count)
    return gauge
