"""Durable mutexes in the store: taking, renewing and releasing a lock (one script each, on
the lock's own hash tag), and the listing `locks` shows. `RedisLocks` is the deployment's;
`MemoryLocks` the runs in memory's (the dry run and the test kit): acquire_lock.lua's
decisions on their virtual clock. flow/locks.py explains the mutex.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..store.replies import as_text

if TYPE_CHECKING:
    from ..store.keys import Keyspace
    from ..store.scripts import Scripts

# A head this late to take a free lock is dropped from its queue (its run was cancelled or
# lost), so one run cannot block the rest; it queues again at the tail if it comes back.
STALE_MS = 30_000


def lock_id(name: str) -> str:
    """The id of a lock's keys: a digest, so any name makes a valid, fixed-length hash tag."""
    return hashlib.sha1(f"lock\0{name}".encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Asked:
    """acquire_lock's answer: held until `until`, or queued at `position` of `queued`
    behind `holder` (its hold lapses at `until`; "" and 0: the lock is free and another
    run is the queue's head), or stale (a newer execution of the run holds it)."""

    status: str  # ok | queued | stale
    until: int = 0
    since: int = 0
    position: int = 0
    queued: int = 0
    holder: str = ""


@dataclass(frozen=True)
class LockInfo:
    """One lock as `locks` lists it."""

    name: str
    holder: str  # run id ("" when free)
    epoch: int  # the holding execution's epoch
    since_ms: int
    until_ms: int  # the hold lapses then unless its holder renews it
    waiters: list[str]  # run ids, in order of arrival

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "holder": self.holder or None,
                "epoch": self.epoch or None, "since_ms": self.since_ms or None,
                "until_ms": self.until_ms or None, "waiters": self.waiters}


class Locks(Protocol):
    def acquire(self, name: str, run_id: str, epoch: int, ttl_ms: int) -> Asked: ...

    def renew(self, name: str, run_id: str, epoch: int, ttl_ms: int) -> tuple[str, int]: ...

    def release(self, name: str, run_id: str, epoch: str, drop: str = "") -> tuple[str, str]:
        ...

    def list(self) -> list[LockInfo]: ...

    def status_of(self, run_id: str) -> str | None:
        """A run's status (None: no such run): a waiter frees a finished holder's hold."""
        ...


def _asked(status: str, values: list[Any]) -> Asked:
    if status == "ok":
        return Asked("ok", int(values[0]), int(values[1]))
    if status == "queued":
        return Asked("queued", int(values[3]), position=int(values[0]), queued=int(values[1]),
                     holder=as_text(values[2]))
    return Asked("stale", int(values[0]))


class RedisLocks:
    """The deployment's locks."""

    def __init__(self, client: Any, keys: Keyspace, scripts: Scripts) -> None:
        self.client, self.keys, self.scripts = client, keys, scripts
        self._noted: set[str] = set()

    def _pair(self, name: str) -> dict[str, str]:
        ident = lock_id(name)
        return {"state_key": self.keys.lock_state(ident),
                "queue_key": self.keys.lock_queue(ident)}

    def acquire(self, name: str, run_id: str, epoch: int, ttl_ms: int) -> Asked:
        if name not in self._noted:  # for `locks` (once per process and name)
            self.client.hset(self.keys.lock_names, name, lock_id(name))
            self._noted.add(name)
        reply = self.scripts.acquire_lock(**self._pair(name), run_id=run_id, epoch=epoch,
                                          ttl_ms=ttl_ms, stale_ms=STALE_MS, name=name)
        return _asked(reply.status, list(reply.values))

    def renew(self, name: str, run_id: str, epoch: int, ttl_ms: int) -> tuple[str, int]:
        reply = self.scripts.renew_lock(state_key=self._pair(name)["state_key"],
                                        run_id=run_id, epoch=epoch, ttl_ms=ttl_ms)
        return reply.status, int(reply.values[0]) if reply.status == "ok" else 0

    def release(self, name: str, run_id: str, epoch: str, drop: str = "") -> tuple[str, str]:
        reply = self.scripts.release_lock(**self._pair(name), run_id=run_id, epoch=epoch,
                                          drop=drop)
        return reply.status, as_text(reply.values[0])

    def status_of(self, run_id: str) -> str | None:
        value = self.client.hget(self.keys.run(run_id), "status")
        return None if value is None else as_text(value)

    def list(self) -> list[LockInfo]:
        names = sorted(as_text(n) for n in self.client.hkeys(self.keys.lock_names))
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pair = self._pair(name)
            pipe.hmget(pair["state_key"], "run", "epoch", "since", "until")
            pipe.zrange(pair["queue_key"], 0, -1)
        replies = iter(pipe.execute())
        out = []
        for name in names:
            (run, epoch, since, until), queue = next(replies), next(replies)
            out.append(LockInfo(name, as_text(run) if run else "", int(epoch or 0),
                                int(since or 0), int(until or 0),
                                [as_text(r) for r in queue]))
        return out


@dataclass
class _MemoryLock:
    holder: str = ""
    epoch: int = 0
    since: int = 0
    until: int = 0
    free: int = 0
    queue: list[str] = field(default_factory=list)


class MemoryLocks:
    """Locks of runs in memory, on their virtual clock: acquire_lock.lua's decisions."""

    def __init__(self, now_ms: Callable[[], int],
                 status_of: Callable[[str], str | None]) -> None:
        self.now_ms, self.status_of = now_ms, status_of
        self.locks: dict[str, _MemoryLock] = {}
        self._lock = threading.Lock()

    def acquire(self, name: str, run_id: str, epoch: int, ttl_ms: int) -> Asked:
        with self._lock:
            lk = self.locks.setdefault(name, _MemoryLock())
            now = self.now_ms()

            def take(since: int) -> Asked:
                if run_id in lk.queue:
                    lk.queue.remove(run_id)
                lk.holder, lk.epoch, lk.since, lk.until, lk.free = (run_id, epoch, since,
                                                                    now + ttl_ms, 0)
                return Asked("ok", lk.until, since)

            if lk.holder == run_id:
                return Asked("stale", lk.epoch) if lk.epoch > epoch else take(lk.since)
            if lk.holder and lk.until > now:
                if run_id not in lk.queue:
                    lk.queue.append(run_id)
                return Asked("queued", lk.until, position=lk.queue.index(run_id),
                             queued=len(lk.queue), holder=lk.holder)
            free = lk.until if lk.holder else (lk.free or now)
            lk.holder = ""
            while lk.queue and lk.queue[0] != run_id and now > free + STALE_MS:
                lk.queue.pop(0)
                free = now
            if not lk.queue or lk.queue[0] == run_id:
                return take(now)
            lk.free = free
            if run_id not in lk.queue:
                lk.queue.append(run_id)
            return Asked("queued", 0, position=lk.queue.index(run_id), queued=len(lk.queue))

    def renew(self, name: str, run_id: str, epoch: int, ttl_ms: int) -> tuple[str, int]:
        with self._lock:
            lk = self.locks.setdefault(name, _MemoryLock())
            if lk.holder != run_id or lk.epoch < epoch:
                return "lost", 0
            if lk.epoch > epoch:
                return "stale", 0
            lk.until = self.now_ms() + ttl_ms
            return "ok", lk.until

    def release(self, name: str, run_id: str, epoch: str, drop: str = "") -> tuple[str, str]:
        with self._lock:
            lk = self.locks.setdefault(name, _MemoryLock())
            if drop in lk.queue:
                lk.queue.remove(drop)
            head = lk.queue[0] if lk.queue else ""
            upto = int(epoch[3:]) if epoch.startswith("<= ") else -1
            if not run_id or lk.holder != run_id or not (str(lk.epoch) == epoch
                                                         or lk.epoch <= upto):
                return "not_held", head
            lk.holder, lk.epoch, lk.since, lk.until = "", 0, 0, 0
            lk.free = self.now_ms() if head else 0
            return "ok", head

    def list(self) -> list[LockInfo]:
        return [LockInfo(name, lk.holder, lk.epoch, lk.since, lk.until, list(lk.queue))
                for name, lk in sorted(self.locks.items())]


__all__ = ["STALE_MS", "Asked", "LockInfo", "Locks", "MemoryLocks", "RedisLocks", "lock_id"]
