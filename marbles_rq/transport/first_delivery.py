"""A new run's first delivery: recorded with the run, or right after it. The one place that
chooses how a run the engine records (an enqueue, a batch, a rerun) reaches RQ.

When the store and RQ share one standalone Redis (one lane, in RQ's own keyspace) the
record script enqueues the delivery in the same call: one round trip, and a crash leaves
either nothing or the run recorded and enqueued. Otherwise the run is recorded first (the
journal), then enqueued on its lane; if that fails, or a crash comes between the two, the
run is recorded and queued, and the controller dispatches it after its grace.

The engine hands in how it records (`write`, given the pushes or None); this module never
imports the engine.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import redis

from ..store.keys import Keyspace
from ..store.scripts import JobPush
from . import dispatch
from .lanes import RQLike, as_lanes


class Written(Protocol):
    """What recording one run answered."""

    @property
    def created(self) -> bool:  # False: a run with its id existed, nothing was written
        ...

    @property
    def enqueued(self) -> bool:  # its delivery was enqueued by the same call (a push given)
        ...


W = TypeVar("W", bound=Written)


class FirstDelivery:
    """How new runs of deployment `keys`, recorded through `store_client`, reach RQ (`rq`:
    the deployment's lanes, or one connection holding them all)."""

    def __init__(self, rq: RQLike, keys: Keyspace, store_client: Any) -> None:
        self.prefix = keys.prefix
        self.lanes = as_lanes(rq, keys)
        # The connection one script can record a run and enqueue its delivery on, or None.
        self.shared = self.lanes.same_server(store_client)

    def record(self, write: Callable[[JobPush | None], W], queue_name: str,
               run_id: str) -> tuple[W, bool]:
        """Record run `run_id` with `write` and deliver it on `queue_name`: (what `write`
        answered, whether its delivery is enqueued). A run that existed is not delivered."""
        if self.shared is not None:
            written = write(dispatch.delivery_push(self.shared, self.prefix, queue_name,
                                                   run_id, 1))
            return written, written.enqueued
        written = write(None)
        if not written.created:
            return written, False
        try:
            self.lanes.enqueue(queue_name, run_id, 1)  # on the run's lane
        except redis.RedisError:
            return written, False  # recorded: the controller dispatches it
        return written, True

    def pushes(self, runs: list[tuple[str, str]]) -> list[JobPush] | None:
        """The first deliveries of runs ((queue, run id) each) as the record script writes
        them, or None when the store and RQ do not share one standalone Redis."""
        if self.shared is None:
            return None
        return [dispatch.delivery_push(self.shared, self.prefix, queue_name, run_id, 1)
                for queue_name, run_id in runs]

    def record_chunk(self, write: Callable[[list[JobPush] | None], list[W]],
                     runs: list[tuple[str, str]]) -> list[tuple[W, bool]]:
        """Record a chunk of runs ((queue, run id) each, in the order `write` answers them)
        and deliver the new ones: in the same round trip on a shared Redis, else after it,
        in one round trip per queue and lane."""
        pushes = self.pushes(runs)
        if pushes is not None:
            return [(w, w.enqueued) for w in write(pushes)]
        written = write(None)
        fresh: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for w, (queue_name, run_id) in zip(written, runs, strict=True):
            if w.created:
                fresh[queue_name].append((run_id, 1))
        dispatched = True
        try:
            for queue_name, batch in fresh.items():
                self.lanes.enqueue_many(queue_name, batch)
        except redis.RedisError:
            dispatched = False  # recorded: the controller dispatches them
        return [(w, w.created and dispatched) for w in written]
