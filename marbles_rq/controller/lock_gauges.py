"""The controller's scrape-time gauge of locks (flow/locks.py): runs waiting for each lock,
read from the store when scraped. Lock names come from bodies, so the label is bounded
(past MAX_LABEL_VALUES names, the rest count under "other")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .scrape_gauges import ScrapeGauges, summed_gauge


class LockGauges(ScrapeGauges):
    """``marbles_rq_lock_waiters{lock}``: runs waiting for each lock, now."""

    def read(self) -> Any:
        return self.runs.locks().list()

    def families(self, found: Any) -> Iterator[Any]:
        yield summed_gauge("marbles_rq_lock_waiters", "Runs waiting for a lock now (parked in "
                           "its queue), by lock.", "lock",
                           ((info.name, len(info.waiters)) for info in found))
