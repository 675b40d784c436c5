"""The deployment's Settings (marbles_rq/deployment.py), shared by the server's threads: the
store, the reader and RQ's lanes are each opened once, under a lock, for the life of the
process."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ..deployment import Settings
from ..store import RedisStore
from ..transport.lanes import Lanes


@dataclass
class WebSettings(Settings):
    # Reentrant: rq() reads the deployment's recorded keyspace through reader().
    _lock: Any = field(default_factory=threading.RLock, repr=False)

    @classmethod
    def of(cls, settings: Settings) -> WebSettings:
        return cls(settings.redis_url, settings.prefix, settings.buckets, settings.source,
                   settings.rq_url, settings.lanes)

    def rq(self) -> Lanes:
        with self._lock:
            return super().rq()

    def store(self) -> RedisStore:
        with self._lock:
            return super().store()

    def reader(self) -> RedisStore:
        with self._lock:
            return super().reader()
