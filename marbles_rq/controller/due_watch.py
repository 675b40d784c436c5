"""What a lane's due indexes hold, read once and then kept up to date by Redis's keyspace
notifications, so that a pass over an idle lane reads no bucket.

Each per-bucket due index (leases, dispatch checks, finished runs, waits, schedules,
monitors and events due) is a sorted set scored by when its entries come due. Reading
every bucket's index on every pass cost about four commands per bucket per pass with
nothing to do. Instead a lane's controller keeps, per index and bucket, the lowest score it
last read, and reads a bucket again only once that score has come due or the bucket's index
was written since. Redis itself says what was written: with keyspace notifications on
(`notify-keyspace-events` with K and z, set here when missing), a write to a sorted set --
inside whatever script made it, as part of the same atomic call -- publishes the key's name
on ``__keyspace@<db>__:<key>``, and the watch's own connection is subscribed to the names
of the due indexes (one pattern per kind). Why this finds what a read of every bucket finds:

* a bucket's known score is never above its index's lowest score: it was read from the
  index; since then a removal only raised the index's lowest (the bucket is read once more
  than needed), and an addition or a new score was published and forgot the bucket;
* every write that finished before a look began is seen by that look: the look sends PING
  on the subscribed connection and reads up to its reply, and Redis queues a write's
  notification to a subscriber before it answers any later command of any client;
* a notification taken while a look's buckets are being read keeps that read from being
  learnt (every notification and reset has a sequence number);
* whatever can lose notifications (a lost connection, the server's output buffer limit on
  a slow subscriber, the flags turned off, a cluster's primaries changing) forgets
  everything: the next look reads every bucket once, as every pass did before. The flags
  and the primaries are checked every CHECK_S, and every SAFETY_S everything is read again
  anyway (for what no check sees: flags turned off and on again between two checks).

Where notifications cannot be had (CONFIG refused, ...) every look reads every bucket.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from ..store.keys import Keyspace
from ..store.redis_errors import one_line
from ..store.replies import as_text

log = logging.getLogger("marbles_rq.controller")

# The per-bucket due indexes a controller reads (store/keys.py spells them).
WATCHED = frozenset({"leases", "dispatch", "finished", "waits", "mondue", "evidx", "evpending",
                     "evoffer", "sched_due", "occ_open",
                     "bdue", "bsealed", "notices", "deb_due"})
# Writes that can only raise an index's lowest score: a known score stays at or below it.
REMOVALS = frozenset({"zrem", "zremrangebyscore", "zremrangebyrank", "zremrangebylex",
                      "zpopmin", "zpopmax"})
FLAGS = "Kz"        # keyspace events (K) of sorted sets (z)
CHECK_S = 1.0       # check the flags and the primaries this often
SAFETY_S = 600.0    # read everything again this often, whatever the checks say
RETRY_S = 5.0       # after notifications could not be had, try again this much later


class DueWatch:
    """The lowest due score of each bucket of one lane, per index kind (see the module)."""

    def __init__(self, client: Any, keys: Keyspace, buckets: range) -> None:
        self.client = client
        self.keys = keys
        self.buckets = buckets
        self._tags = {keys.tag(b): b for b in buckets}
        self._lock = threading.Lock()
        self._conns: list[tuple[str, Any]] = []  # (node name, subscribed connection)
        self._known: dict[str, dict[int, float]] = {}
        self._forgot: dict[str, dict[int, int]] = {}  # kind -> bucket -> sequence forgotten
        self._seq = 0
        self._reset_seq = 0
        self._fresh_until = 0.0
        self._checked_until = 0.0
        self._retry_at = 0.0
        self._warned = False

    # -- what the controller asks -------------------------------------------------------------

    def kind_of(self, key_of: Callable[[int], str]) -> str | None:
        """The due index kind of per-bucket keys `key_of`, if it is one this watch keeps."""
        first = self.buckets.start
        tag, key = self.keys.tag(first), key_of(first)
        kind = key[len(tag) + 1:]
        return kind if key.startswith(tag + ":") and kind in WATCHED else None

    def look(self, kind: str | None, now_ms: int) -> tuple[list[int], int]:
        """The buckets whose index `kind` may hold something due at `now_ms`, and the
        sequence number to learn their reads under (-1: no notifications, every bucket)."""
        with self._lock:
            if kind is None or not self._sync():
                return list(self.buckets), -1
            known = self._known.setdefault(kind, {})
            return [b for b in self.buckets if known.get(b, -math.inf) <= now_ms], self._seq

    def unknown(self, kind: str | None) -> tuple[list[int], int]:
        """The buckets whose lowest score of `kind` is not known (all when not watching)."""
        with self._lock:
            if kind is None or not self._sync():
                return list(self.buckets), -1
            known = self._known.setdefault(kind, {})
            return [b for b in self.buckets if b not in known], self._seq

    def learn(self, kind: str | None, seq: int, lowest: dict[int, float]) -> None:
        """Buckets' lowest scores (inf: empty) as read after the look numbered `seq`; a
        bucket written since (or a reset since) is not learnt."""
        if kind is None or seq < 0:
            return
        with self._lock:
            if seq < self._reset_seq or not self._conns:
                return
            known = self._known.setdefault(kind, {})
            forgot = self._forgot.get(kind, {})
            for bucket, score in lowest.items():
                if forgot.get(bucket, -1) <= seq:
                    known[bucket] = score

    def lowest(self, kind: str | None) -> tuple[bool, float]:
        """(every bucket known, the lowest known score over the lane's buckets)."""
        with self._lock:
            known = self._known.get(kind or "", {}) if self._conns else {}
            return len(known) == len(self.buckets), min(known.values(), default=math.inf)

    @property
    def watching(self) -> bool:
        return bool(self._conns)

    def close(self) -> None:
        with self._lock:
            self._close()

    # -- the subscription ---------------------------------------------------------------------

    def _sync(self) -> bool:
        """Take every notification of a write that finished before now; False when there
        are no notifications to go by (the caller reads every bucket)."""
        if not self._conns:
            if time.monotonic() < self._retry_at:
                return False
            try:
                self._connect()
            except (redis.RedisError, RedisClusterException, OSError) as exc:
                self._close()
                self._retry_at = time.monotonic() + RETRY_S
                if not self._warned:
                    self._warned = True
                    log.warning("keyspace notifications unavailable (%s): every pass reads "
                                "every bucket", one_line(exc))
                return False
        try:
            now = time.monotonic()
            if now >= self._fresh_until:
                self._forget_all()
            if now >= self._checked_until:
                if not self._still_sound():
                    self._close()
                    return False
                self._checked_until = now + CHECK_S
            for _, conn in self._conns:
                conn.send_command("PING")
            for _, conn in self._conns:
                while True:
                    reply = conn.read_response()
                    if isinstance(reply, list) and reply and as_text(reply[0]) == "pong":
                        break
                    self._note(reply)
        except (redis.RedisError, OSError, IndexError, ValueError) as exc:
            log.info("keyspace notifications lost (%s); reading every bucket again",
                     one_line(exc))
            self._close()
            return False
        return True

    def _nodes(self) -> list[tuple[str, redis.Redis]]:
        if isinstance(self.client, RedisCluster):
            return sorted((node.name, self.client.get_redis_connection(node))
                          for node in self.client.get_primaries())  # type: ignore[no-untyped-call]
        return [("", self.client)]

    def _connect(self) -> None:
        nodes = self._nodes()
        for _, node in nodes:
            flags = as_text(node.config_get("notify-keyspace-events")
                            .get("notify-keyspace-events", ""))
            if not _flags_on(flags):
                node.config_set("notify-keyspace-events",
                                flags + "".join(f for f in FLAGS if f not in flags))
        patterns = [f"__keyspace@*__:{{{self.keys.prefix}:b*}}:{kind}" for kind in sorted(WATCHED)]
        for name, node in nodes:
            pool = node.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
            self._conns.append((name, conn))
            conn.send_command("PSUBSCRIBE", *patterns)
        for _, conn in self._conns:
            for _ in patterns:
                self._note(conn.read_response())
        self._forget_all()
        self._checked_until = time.monotonic() + CHECK_S
        self._warned = False

    def _still_sound(self) -> bool:
        """The flags still on, the primaries unchanged (every CHECK_S)."""
        nodes = self._nodes()
        if [name for name, _ in nodes] != [name for name, _ in self._conns]:
            return False
        return all(_flags_on(as_text(node.config_get("notify-keyspace-events")
                                     .get("notify-keyspace-events", "")))
                   for _, node in nodes)

    def _note(self, message: Any) -> None:
        if not isinstance(message, list) or len(message) != 4:
            return  # a subscription's confirmation
        if as_text(message[0]) != "pmessage" or as_text(message[3]) in REMOVALS:
            return
        key = as_text(message[2]).partition("__:")[2]
        end = key.find("}:")
        bucket = self._tags.get(key[:end + 1]) if end > 0 else None
        kind = key[end + 2:]
        if bucket is None or kind not in WATCHED:
            return
        self._seq += 1
        self._known.get(kind, {}).pop(bucket, None)
        self._forgot.setdefault(kind, {})[bucket] = self._seq

    def _forget_all(self) -> None:
        self._seq += 1
        self._reset_seq = self._seq
        self._known.clear()
        self._forgot.clear()
        self._fresh_until = time.monotonic() + SAFETY_S

    def _close(self) -> None:
        conns, self._conns = self._conns, []
        for _, conn in conns:
            with contextlib.suppress(redis.RedisError, OSError):
                conn.disconnect()
        self._forget_all()


def _flags_on(flags: str) -> bool:
    return ("K" in flags) and ("z" in flags or "A" in flags)
