"""One thread per process that keeps every execution's lease: it ticks each execution's
watchdog when its renewal or a deferred step start is due (engine/execute.Watchdog).

A process executing many runs at once (`worker --concurrency N`) renews them all from here,
not from a thread per run. The thread starts with the first execution and ends after
IDLE_EXIT_S without any, so a process that executes nothing has no such thread.
"""

from __future__ import annotations

import _thread
import logging
import math
import os
import threading
import time
from typing import Any, Protocol

import redis

from ..errors import RedisUnavailableError
from ..store.redis_errors import one_line

log = logging.getLogger("marbles_rq.engine.watchdog")

IDLE_EXIT_S = 30.0
MAX_SLEEP_S = 5.0  # a tick that raised is retried within this long


class Ticking(Protocol):
    runs: Any
    ex: Any

    def tick(self, now: float) -> float:
        """Do what is due at `now` (monotonic); when to be ticked next (inf: never)."""
        ...

    def renewal_due(self, now: float, early: bool = False) -> bool:
        """Whether its lease renewal is due (`early`: soon) and may go in a batch."""
        ...

    def renewed(self, status: str | None, now: float) -> None:
        """Its renewal was sent in a batch: its status (None: not sent)."""
        ...


class Hub:
    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A forked child (a work-horse) starts with no thread and no executions of its own.
        self._lock = threading.Lock()
        self._dogs: dict[int, Ticking] = {}
        self._wake = threading.Event()
        self._running = False

    def add(self, dog: Ticking) -> None:
        with self._lock:
            self._dogs[id(dog)] = dog
            start = not self._running
            self._running = True
        if start:
            # A bare thread: threading.Thread's start waits until the thread has run, a
            # handshake that costs a busy machine milliseconds of the run.
            _thread.start_new_thread(self._loop, ())
        self._wake.set()

    def remove(self, dog: Ticking) -> None:
        with self._lock:
            self._dogs.pop(id(dog), None)

    def poke(self) -> None:
        """Something is due sooner than the thread's next wake: look again now."""
        self._wake.set()

    def _loop(self) -> None:
        idle_since: float | None = None
        while True:
            self._wake.clear()
            with self._lock:
                dogs = list(self._dogs.values())
                if not dogs:
                    now = time.monotonic()
                    idle_since = idle_since if idle_since is not None else now
                    if now - idle_since >= IDLE_EXIT_S:
                        self._running = False
                        return
            if not dogs:
                self._wake.wait(IDLE_EXIT_S)
                continue
            idle_since = None
            self._renew_together(dogs)
            wake_at = math.inf
            for dog in dogs:
                try:
                    due = dog.tick(time.monotonic())
                except Exception:
                    log.exception("an execution's watchdog failed; retrying")
                    due = time.monotonic() + 1.0
                if math.isinf(due):
                    self.remove(dog)
                wake_at = min(wake_at, due)
            delay = min(wake_at - time.monotonic(), MAX_SLEEP_S)
            if delay > 0:
                self._wake.wait(delay)


    @staticmethod
    def _renew_together(dogs: list[Ticking]) -> None:
        """The renewals due now, in one round trip per store (and master), not one each:
        many runs in one process (and a slow disk) would otherwise outlast their leases."""
        now = time.monotonic()
        if not any(dog.renewal_due(now) for dog in dogs):
            return
        # Those due soon go too: renewals started at different times fall into step, one
        # round trip for all of them every so often rather than one each, staggered.
        groups: dict[int, list[Ticking]] = {}
        for dog in dogs:
            if dog.renewal_due(now, early=True):
                groups.setdefault(id(dog.runs), []).append(dog)
        for group in groups.values():
            statuses: list[str | None]
            try:
                statuses = group[0].runs.renew_many([d.ex for d in group])
            except (redis.RedisError, RedisUnavailableError, OSError) as exc:
                log.warning("cannot renew %s leases (%s); retrying", len(group), one_line(exc))
                statuses = [None] * len(group)
            for dog, status in zip(group, statuses, strict=True):
                try:
                    dog.renewed(status, now)
                except Exception:
                    log.exception("an execution's watchdog failed")


HUB = Hub()
