"""The controller's part of debounce (flow/debounce.py): close the windows that came due
and start their runs, each under the id its window was opened with.

A window due is in its bucket's `deb_due` index (scored when it closes); one closed by an
enqueue that found it past its time, or by a controller killed before it recorded the run,
stays there (scored when it closed) until its run is recorded. So recovery is the same pass
as every other: whatever is due, a new leader closes and records, and the insert-if-absent
record of the run makes a repeat a no-op.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..flow import debounce
from ..store.redis_errors import one_line

if TYPE_CHECKING:
    from .context import DutyContext

log = logging.getLogger("marbles_rq.controller")

PER_BUCKET = 100  # windows closed per bucket per pass


class DebounceDuty:
    kind = "debounce"

    def recover(self, ctl: DutyContext) -> int:
        total = 0
        while ctl.lease is not None:
            done = self._close_due(ctl)
            total += done
            if done < PER_BUCKET:
                return total
        return total

    def tick(self, ctl: DutyContext) -> None:
        self._close_due(ctl)

    def _close_due(self, ctl: DutyContext) -> int:
        started = 0
        for bucket, run_id in ctl.due(ctl.keys.debounce_due, ctl.server_ms(), PER_BUCKET):
            if ctl.lease is None:
                break
            try:
                started += debounce.close(ctl.runs, ctl.rq, bucket, run_id) == "started"
            except Exception as exc:  # one window's trouble costs only its turn
                from ..store.redis_errors import is_outage

                if is_outage(exc):
                    raise
                log.warning("debounce window of run %s: %s; tried again next pass", run_id,
                            one_line(exc))
        return started
