"""What a duty is handed on each pass: the leading controller of one lane, seen through the
few things a duty may use (its stores, its buckets, its fencing epoch, the reads every
pass shares). The controller implements these; a duty never imports it, so the triggers'
duties and the controller's own depend on this module only.

`DutyContext` is all a trigger's duty (events, schedules, monitors, waiting runs) needs;
`PassContext` adds what the controller's own duties share (its counters, its warnings, the
script and enqueue calls that cost one run's turn at most).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..engine.runs import RunStore
    from ..store import Lease, RedisStore
    from ..store.keys import Keyspace
    from ..transport.lanes import Lanes


@dataclass
class Stats:
    redelivered: int = 0
    dispatched: int = 0
    settled: int = 0
    pruned: int = 0
    corrupt: int = 0


class DutyContext(Protocol):
    @property
    def runs(self) -> RunStore: ...

    @property
    def store(self) -> RedisStore: ...

    @property
    def keys(self) -> Keyspace: ...

    @property
    def rq(self) -> Lanes: ...

    @property
    def buckets(self) -> range:
        """The buckets of the lane this controller leads: all a duty reads and writes."""
        ...

    @property
    def lease(self) -> Lease | None:
        """None once this controller stopped leading (a duty stops writing then)."""
        ...

    @property
    def epoch(self) -> int:
        """The lease epoch that fences this controller's writes (0 when not leading)."""
        ...

    @property
    def stop_event(self) -> threading.Event: ...

    def server_ms(self) -> int: ...

    def due(self, key_of: Callable[[int], str], now_ms: int, per_bucket: int,
            budget: int | None = None) -> list[tuple[int, str]]: ...

    def due_scored(self, key_of: Callable[[int], str], now_ms: int,
                   per_bucket: int) -> list[tuple[int, str, int]]: ...

    def soonest(self, key_of: Callable[[int], str]) -> int | None: ...

    def leads(self, epoch: int) -> bool: ...

    def step_down(self, why: str) -> None: ...

    def enqueue_many(self, queue_name: str, batch: list[tuple[str, int]]) -> bool: ...


class PassContext(DutyContext, Protocol):
    @property
    def stats(self) -> Stats: ...

    @property
    def lane(self) -> int: ...

    def warn_once(self, key: str, message: str, *args: Any) -> None: ...

    def run_script(self, run_id: str, call: Callable[[], Any]) -> Any: ...

    def handled(self, run_id: str, reply: Any) -> bool: ...

    def fail_corrupt(self, run_id: str, reason: str) -> None: ...

    def enqueue(self, queue_name: str, run_id: str, attempt: int) -> bool: ...

    def restart_grace(self) -> None:
        """A read met a stalled Redis: lost workers are believed again only after a full
        grace in contact (see lost_workers.LIVENESS_GRACE_S)."""
        ...
