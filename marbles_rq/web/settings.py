"""The CLI's Settings, shared by the server's threads: one store, one reader and one RQ
connection for the life of the process (the CLI's Settings opens RQ's connection anew at
each call, which is right for a command that makes one call, not for a server)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import redis

from ..cli import Settings
from ..store import RedisStore


@dataclass
class WebSettings(Settings):
    _lock: Any = field(default_factory=threading.Lock, repr=False)
    _rq: redis.Redis | None = field(default=None, repr=False)

    @classmethod
    def of(cls, settings: Settings) -> WebSettings:
        return cls(settings.redis_url, settings.prefix, settings.buckets, settings.source,
                   settings.rq_url)

    def rq(self) -> redis.Redis:
        with self._lock:
            if self._rq is None:
                self._rq = super().rq()
            return self._rq

    def store(self) -> RedisStore:
        with self._lock:
            return super().store()

    def reader(self) -> RedisStore:
        with self._lock:
            return super().reader()
