"""The controller's scrape-time gauge of rate limits: runs each limit holds (engine/
rate_limits.py), read from the store when scraped. Limits per key are summed under their
family (the workflow's name), so the label stays low-cardinality."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .scrape_gauges import ScrapeGauges, summed_gauge


class RateGauges(ScrapeGauges):
    """``marbles_rq_rate_held{limit}``: runs held by each rate limit, now."""

    def read(self) -> Any:
        from ..flow.rate_store import catalog_rates

        return self.runs.rates().list(catalog_rates(self.runs.client, self.runs.keys))

    def families(self, found: Any) -> Iterator[Any]:
        yield summed_gauge("marbles_rq_rate_held", "Runs a rate limit holds now (parked until "
                           "their turn), by limit (a workflow's limit per key summed under the "
                           "workflow's name).", "limit",
                           ((info.family, info.held) for info in found))
