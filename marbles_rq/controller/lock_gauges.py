"""The controller's scrape-time gauge of locks (flow/locks.py): runs waiting for each lock,
read from the store when scraped. Lock names come from bodies, so the label is bounded
(past MAX_LABEL_VALUES names, the rest count under "other")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis

from ..metrics import bounded, redis_error

if TYPE_CHECKING:
    from ..engine.runs import RunStore


class LockGauges:
    """``marbles_rq_lock_waiters{lock}``: runs waiting for each lock, now."""

    def __init__(self, runs: RunStore) -> None:
        self.runs = runs

    def describe(self) -> list[Any]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            found = self.runs.locks().list()
        except redis.RedisError as exc:
            redis_error(exc)
            return
        waiting: dict[str, int] = {}
        for info in found:
            label = bounded("lock", info.name)
            waiting[label] = waiting.get(label, 0) + len(info.waiters)
        gauge = GaugeMetricFamily("marbles_rq_lock_waiters", "Runs waiting for a lock now "
                                  "(parked in its queue), by lock.", labels=["lock"])
        for label, count in sorted(waiting.items()):
            gauge.add_metric([label], count)
        yield gauge
