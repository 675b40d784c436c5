"""What the leader keeps besides redelivery: schedules, inbound events, monitors.

A duty is handed the controller, seen through controller/context.DutyContext, on every
pass as leader (`tick`) and once when this process wins the lease (`recover`), before any
tick. (Redelivery is the controller's own duties -- reaping, lost workers, dispatch, lost
deliveries, pruning -- which every pass makes first, in that order: see controller/loop.py.)
Recovery finishes what was accepted before it makes anything new (RECOVERY_ORDER): pending
inbound events become runs, then recorded child runs are dispatched, then waiting runs that
are due continue, then schedule occurrences claimed but never started are started; only then
do schedules and monitors resume from their stored cursors.

Every write a duty makes on the controller's behalf is fenced by the controller's lease
epoch (`ctl.epoch`) in the bucket it writes, like reap_run: pass `ctl.keys.controller_fence(
bucket)` and `ctl.epoch` to the script and refuse when a newer epoch wrote there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .context import DutyContext

# Kinds in the order recovery visits them; a duty's `kind` places it.
# The dashboard's rollups come last: they only read what the others settled.
RECOVERY_ORDER = ("events", "batches", "children", "waiting", "occurrences", "debounce",
                  "schedules", "monitors", "rollups", "notices", "blobs")


class Duty(Protocol):
    kind: str  # one of RECOVERY_ORDER

    def recover(self, ctl: DutyContext) -> int:
        """Finish what a previous leader left; returns how many entries it handled."""
        ...

    def tick(self, ctl: DutyContext) -> None:
        """One pass as leader; costs what is due, not what exists."""
        ...


def default_duties() -> list[Duty]:
    """The duties a `marbles-rq controller` keeps, built from what --source declared."""
    from ..triggers.batches import BatchesDuty
    from ..triggers.events import EventsDuty
    from ..triggers.monitors import MonitorsDuty
    from ..triggers.schedules import duties as schedule_duties
    from .blob_gc import BlobCollection
    from .debouncing import DebounceDuty
    from .notices import NoticesDuty
    from .rollups import RollupsDuty
    from .waiting import WaitingDuty

    return [EventsDuty(), WaitingDuty(), *schedule_duties(), MonitorsDuty(), RollupsDuty(),
            BatchesDuty(), NoticesDuty(), DebounceDuty(), BlobCollection()]
