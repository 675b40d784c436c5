"""A deployment as a process reaches it: its settings (Redis URL, key prefix, bucket and lane
counts, workflow source, RQ's Redis) and what is opened from them on first use (the store, a
read-only store, RQ's lanes, the keyspace). The command line builds one from its options
and environment variables; the dashboard shares one between its threads (web/settings.py).
It sits below both, so neither imports the other for it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .engine.runs import RunStore
from .errors import ConfigError
from .store import RedisStore, open_store
from .store.connection import DEFAULT_URL, URL_ENV, check_url, connect
from .store.keys import DEFAULT_BUCKETS, DEFAULT_PREFIX, Keyspace

if TYPE_CHECKING:
    from .transport.lanes import Lanes

PREFIX_ENV = "MARBLES_PREFIX"
BUCKETS_ENV = "MARBLES_BUCKETS"
LANES_ENV = "MARBLES_LANE_COUNT"
RQ_URL_ENV = "MARBLES_RQ_URL"


def _env_count(name: str) -> int | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, not {raw!r}") from None


@dataclass
class Settings:
    """One deployment's settings; the stores and lanes open on first use, once."""

    redis_url: str = DEFAULT_URL
    prefix: str = DEFAULT_PREFIX
    buckets: int | None = None  # None: the deployment's recorded count (1,024 at creation)
    source: str | None = None
    rq_url: str | None = None
    lanes: int | None = None  # None: recorded (at creation: 1, or one per cluster master)
    _lanes: Lanes | None = field(default=None, repr=False)
    _store: RedisStore | None = field(default=None, repr=False)
    _reader: RedisStore | None = field(default=None, repr=False)
    _loaded: bool = field(default=False, repr=False)

    @classmethod
    def from_env(cls, redis_url: str | None = None, prefix: str | None = None, *,
                 buckets: int | None = None, lanes: int | None = None,
                 source: str | None = None, rq_url: str | None = None) -> Settings:
        """The settings the CLI would use: each argument, else its environment variable
        (MARBLES_REDIS_URL, MARBLES_PREFIX, MARBLES_BUCKETS, MARBLES_LANE_COUNT,
        MARBLES_SOURCE, MARBLES_RQ_URL), else the default."""
        from .engine.authoring import SOURCE_ENV

        settings = cls(redis_url or os.environ.get(URL_ENV) or DEFAULT_URL,
                       prefix or os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX,
                       buckets if buckets is not None else _env_count(BUCKETS_ENV),
                       source or os.environ.get(SOURCE_ENV) or None,
                       rq_url or os.environ.get(RQ_URL_ENV) or None,
                       lanes if lanes is not None else _env_count(LANES_ENV))
        settings.check()
        return settings

    def load_source(self) -> None:
        """Import the workflow definitions named by --source (once)."""
        from .engine.authoring import load_source

        if self.source and not self._loaded:
            for part in self.source.split(os.pathsep):
                load_source(part)
            self._loaded = True

    def runs(self, *, read_only: bool = False) -> RunStore:
        return RunStore(self.reader() if read_only else self.store())

    def rq(self) -> Lanes:
        """The deployment's lanes: RQ's queues, on --rq-url or the store's Redis."""
        from .transport.lanes import open_lanes

        if self._lanes is None:
            url = self.rq_url or self.redis_url
            # One line that hides its password, whichever URL RQ uses (the parser's own
            # message quotes what it could not read: part of a password).
            check_url(url)
            self._lanes = open_lanes(url, self.keys)
        return self._lanes

    def client(self) -> Any:
        return connect(self.redis_url)

    def store(self) -> RedisStore:
        if self._store is None:
            self._store = open_store(self.redis_url, prefix=self.prefix, buckets=self.buckets,
                                     lanes=self.lanes)
        return self._store

    def reader(self) -> RedisStore:
        """The store for commands that only read: it never records the deployment's meta."""
        if self._store is not None:
            return self._store
        if self._reader is None:
            self._reader = open_store(self.redis_url, prefix=self.prefix, buckets=self.buckets,
                                      lanes=self.lanes, read_only=True)
        return self._reader

    def check(self) -> None:
        """A malformed --prefix, --buckets or --lane-count is one line now (exit 2), before
        anything is started; whether they match the deployment is checked on connecting."""
        Keyspace(self.prefix, self.buckets or DEFAULT_BUCKETS, lanes=self.lanes or 1)

    @property
    def keys(self) -> Keyspace:
        """The deployment's keyspace: what it recorded (read, never written here), or, for a
        deployment not created yet, what it will be created with."""
        return self.reader().keys
