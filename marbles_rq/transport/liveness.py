"""Worker liveness: each worker beats once a second, whatever it executes, so a worker that
is killed (kill -9), frozen (SIGSTOP) or cut off is noticed in seconds, without short run
leases that every execution would have to renew often.

A beat is one script call (``beat_worker``: ZADD of the worker's name, scored by when it is
lost, on the server's clock, into ``{P}:workers``). The elected controller reads the names
whose time has passed (what is due, one read per pass), redelivers the runs that the run hash
says were executing on them (``reap_run`` with the worker's name, fenced like any reap), and
takes the names off the index. The run lease stays, renewed every third of it by the
execution, as the fallback for what liveness cannot see: a horse stuck while its worker lives,
or a worker that predates liveness.

The beat runs in a thread of the worker's own process (the RQ worker that forks horses, or a
``--pool`` executor), never in a horse: a worker frozen with SIGSTOP stops beating even though
its horse runs on, and that horse is then fenced out by the redelivery. A horse that dies while
its worker lives is handled by the worker at once (``abandon_attempt``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from ..engine.runs import RunStore
from ..errors import RedisUnavailableError
from ..store.redis_errors import one_line
from ..store.replies import as_text, server_ms

log = logging.getLogger("marbles_rq.transport.liveness")

WORKER_BEAT_S = 1.0    # one beat per worker per second
WORKER_TTL_MS = 3_000  # a worker silent for this long is lost: its runs are redelivered


class WorkerBeat:
    """Beats for one worker name from a daemon thread until stopped."""

    def __init__(self, runs: RunStore, name: str, *, every_s: float = WORKER_BEAT_S,
                 ttl_ms: int = WORKER_TTL_MS, lanes: list[int] | None = None,
                 versions: str | None = None) -> None:
        self.runs, self.name = runs, name
        # The workflow versions it serves (transport/served.py); None: it does not say.
        self.versions = versions
        self.lanes = ",".join(map(str, lanes if lanes is not None
                                  else range(runs.keys.lanes)))
        self.every_s, self.ttl_ms = every_s, ttl_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"beat-{name}", daemon=True)
        self._failing = False

    def start(self) -> WorkerBeat:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.runs.scripts.beat_worker(workers_key=self.runs.keys.workers,
                                              worker=self.name, ttl_ms=self.ttl_ms,
                                              lanes_key=self.runs.keys.worker_lanes,
                                              lanes=self.lanes,
                                              versions_key=None if self.versions is None
                                              else self.runs.keys.worker_versions,
                                              versions=self.versions or "")
                if self._failing:
                    log.info("worker %s: liveness beats reach Redis again", self.name)
                self._failing = False
            except (redis.RedisError, RedisUnavailableError, OSError) as exc:
                if not self._failing:  # one line per outage
                    log.warning("worker %s: cannot beat (%s); its runs may be redelivered",
                                self.name, one_line(exc))
                self._failing = True
            if self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started))):
                return

    def stop(self, *, forget: bool) -> None:
        """Stop beating. `forget`: nothing runs under this name any more (a clean stop), so
        take it off the index; otherwise it lapses and the controller redelivers whatever
        was executing under it."""
        self._stop.set()
        self._thread.join(timeout=5)
        if forget:
            try:
                self.runs.scripts.forget_workers(workers_key=self.runs.keys.workers,
                                                 workers=[self.name], cutoff_ms=None,
                                                 lanes_key=self.runs.keys.worker_lanes,
                                                 versions_key=self.runs.keys.worker_versions)
            except (redis.RedisError, RedisUnavailableError, OSError) as exc:
                log.info("worker %s: could not take it off the liveness index (%s); it lapses",
                         self.name, one_line(exc))


@contextlib.contextmanager
def beating(runs: RunStore, name: str, *, idle: Callable[[], bool],
            lanes: list[int] | None = None,
            versions: str | None = None) -> Iterator[WorkerBeat]:
    """Beat for worker `name` while the block runs (saying it serves `versions`, JSON of
    workflow -> versions). A block that ends normally with the worker `idle` (no horse left)
    takes the name off the index; any other end lets it lapse, so the controller redelivers
    what was executing under it within WORKER_TTL_MS."""
    beat = WorkerBeat(runs, name, lanes=lanes, versions=versions).start()
    try:
        yield beat
    except BaseException:
        beat.stop(forget=False)
        raise
    beat.stop(forget=idle())


def lane_workers(runs: RunStore, client: Any = None) -> dict[int, list[str]]:
    """Lane -> the live workers that serve it (from their liveness beats), for every lane of
    the deployment; an empty list is a lane whose runs wait for a worker. `client`: another
    connection to the store's Redis (the metrics' scrape client, with its short timeout)."""
    client = runs.store.client if client is None else client
    now_ms = server_ms(client)
    pipe = client.pipeline(transaction=False)  # one slot: {<prefix>}
    pipe.zrangebyscore(runs.keys.workers, "-inf", "+inf", withscores=True)
    pipe.hgetall(runs.keys.worker_lanes)
    alive, served = pipe.execute()
    out: dict[int, list[str]] = {k: [] for k in range(runs.keys.lanes)}
    lanes_of = {as_text(k): as_text(v) for k, v in served.items()}
    for name, until in alive:
        if until < now_ms:
            continue  # lapsed: lost
        worker = as_text(name)
        # A worker of an earlier version beats without its lanes: it serves lane 0's keyspace.
        for part in lanes_of.get(worker, "0").split(","):
            if part.isdigit() and int(part) in out:
                out[int(part)].append(worker)
    return out
