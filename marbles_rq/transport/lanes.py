"""Lanes: the RQ side of a deployment, split so it grows with a Redis Cluster.

A deployment of L lanes has L RQ keyspaces. Lane k's keyspace is what RQ writes with
``RQ_KEY_PREFIX`` set to ``Keyspace.lane_rq_prefix(k)``, a hash tag: its queues, their
intermediate lists and its jobs all hash to one slot, so RQ's multi-key commands and the
enqueue script work on a cluster, and each lane sits on the master serving that slot. A
run's lane follows from its bucket (``Keyspace.lane_of``), is recorded with the run, and
every delivery of the run goes through it.

A deployment of one lane uses RQ's own keyspace (``RQ_KEY_PREFIX``, ``rq`` by default), on a
standalone Redis exactly as before lanes existed. On a cluster that keyspace must carry a
hash tag (``RQ_KEY_PREFIX='{rq}'``), as must the workers' registration with RQ, which
always lives in RQ's own keyspace.

RQ's workers need a plain ``redis.Redis`` (``RedisCluster`` lacks what they use), so each
lane is reached through a ``redis.Redis`` whose connections go to the master currently
serving the lane's slot (:class:`SlotMaster`): found from the cluster's slot map, and found
again when that master fails over (its connections report MOVED, READONLY, or drop).
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection, SSLConnection
from redis.crc import key_slot
from redis.retry import Retry

from ..errors import ConfigError
from ..store.connection import (
    CLUSTER_SCHEMES,
    NO_CLIENT_INFO,
    check_url,
    redact,
    socket_timeout_from_env,
)
from ..store.keys import Keyspace
from ..store.replies import as_text

log = logging.getLogger("marbles_rq.transport.lanes")

# What a former master (or a node that never served the slot) answers: the lane has moved;
# find its master again. (redis-py strips the first word off the message of the errors it
# has a class for.)
_MOVED_ERRORS = (redis.exceptions.MovedError, redis.exceptions.AskError,
                 redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
                 redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError)
_MOVED_WORDS = ("UNBLOCKED", "MASTERDOWN")


class LaneMovedError(redis.ConnectionError):
    """The node a lane's connection reached no longer serves the lane's slot (a failover or
    a resharding). Nothing was done by the command; the next connection finds the master."""


class ClusterMap:
    """Which master serves which hash slot, read from the cluster's slot map (CLUSTER SLOTS)
    on any node it knows, and read again once forgotten. One per cluster in a process,
    shared by every lane on it (thread-safe): when one lane finds its master moved, every
    lane's idle connections are dropped, so none of them takes a stale node's answer."""

    def __init__(self, seeds: list[tuple[str, int]], options: dict[str, Any]) -> None:
        self.options = options
        self._known = list(dict.fromkeys(seeds))
        self._ranges: list[tuple[int, int, tuple[str, int]]] | None = None
        self._lock = threading.Lock()
        self._pools: weakref.WeakSet[redis.ConnectionPool] = weakref.WeakSet()

    def master(self, slot: int) -> tuple[str, int]:
        with self._lock:
            for _ in range(2):
                if self._ranges is None:
                    self._ranges = self._discover()
                for start, end, address in self._ranges:
                    if start <= slot <= end:
                        return address
                self._ranges = None  # a slot nobody serves: read the map again, once
        raise redis.ConnectionError(f"no node of the cluster serves hash slot {slot}")

    def forget(self) -> None:
        with self._lock:
            self._ranges = None
            pools = list(self._pools)
        for pool in pools:
            pool.disconnect(inuse_connections=False)

    def track(self, pool: redis.ConnectionPool) -> None:
        self._pools.add(pool)

    def _discover(self) -> list[tuple[int, int, tuple[str, int]]]:
        errors: list[str] = []
        for host, port in list(self._known):
            client = redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 0),
                                 protocol=2, **NO_CLIENT_INFO, **self.options)
            try:
                table = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            except redis.RedisError as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            finally:
                client.close()
            ranges: list[tuple[int, int, tuple[str, int]]] = []
            for start, end, master, *replicas in table:
                for node in (master, *replicas):
                    address = (as_text(node[0]) or host, int(node[1]))
                    if address not in self._known:
                        self._known.append(address)
                ranges.append((int(start), int(end), (as_text(master[0]) or host, int(master[1]))))
            if ranges:
                return ranges
            errors.append(f"{host}:{port}: an empty slot map")
        raise redis.ConnectionError(f"cannot read the cluster's slot map "
                                    f"({'; '.join(errors) or 'no nodes'})")


@dataclass(frozen=True)
class SlotMaster:
    """The master serving one hash slot, as the shared ClusterMap knows it."""

    cluster: ClusterMap
    slot: int

    def address(self) -> tuple[str, int]:
        return self.cluster.master(self.slot)

    def forget(self) -> None:
        self.cluster.forget()


class SlotMasterConnection(Connection):
    """A connection to the master of its pool's slot (looked up when it connects). An
    answer that says the node no longer serves the slot drops the connection and raises
    LaneMovedError, so the caller's next command reconnects to the new master."""

    def __init__(self, *, slot_master: SlotMaster, **kwargs: Any) -> None:
        self.slot_master = slot_master
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]

    def connect(self) -> None:
        if self._sock:
            return
        self.host, self.port = self.slot_master.address()
        try:
            super().connect()  # type: ignore[no-untyped-call]
        except redis.ConnectionError:
            self.slot_master.forget()  # the master may be gone: ask the cluster again
            raise

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if isinstance(exc, _MOVED_ERRORS) or str(exc).startswith(_MOVED_WORDS):
                self.slot_master.forget()
                self.disconnect()  # type: ignore[no-untyped-call]
                raise LaneMovedError(f"the lane's node {self.host}:{self.port} no longer "
                                     f"serves slot {self.slot_master.slot} "
                                     f"({type(exc).__name__}: {exc})") from exc
            raise


class SlotMasterSSLConnection(SlotMasterConnection, SSLConnection):
    pass


def slot_client(url: str, slot: int) -> redis.Redis:
    """A ``redis.Redis`` on the master serving `slot` of the cluster at `url`
    (``redis+cluster://`` or ``rediss+cluster://``), following it across failovers."""
    parts = check_url(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ConfigError(f"{redact(url)} is not a redis+cluster:// URL")
    plain = urlsplit(url.replace(parts.scheme, CLUSTER_SCHEMES[parts.scheme], 1))
    options: dict[str, Any] = dict(socket_timeout=socket_timeout_from_env(),
                                   socket_connect_timeout=2.0)
    if plain.username:
        options["username"] = unquote(plain.username)
    if plain.password:
        options["password"] = unquote(plain.password)
    ssl = plain.scheme == "rediss"
    if ssl:
        options["ssl"] = True
    seeds = [(plain.hostname or "127.0.0.1", plain.port or 6379)]
    key = (tuple(seeds), tuple(sorted((k, str(v)) for k, v in options.items())))
    with _MAPS_LOCK:
        cluster = _MAPS.get(key)
        if cluster is None:
            cluster = _MAPS[key] = ClusterMap(seeds, options)
    kwargs = {k: v for k, v in options.items() if k != "ssl"}
    pool = redis.ConnectionPool(
        connection_class=SlotMasterSSLConnection if ssl else SlotMasterConnection,
        slot_master=SlotMaster(cluster, slot), retry=Retry(NoBackoff(), 0), protocol=2,
        **NO_CLIENT_INFO, **kwargs)
    cluster.track(pool)
    return redis.Redis(connection_pool=pool)


_MAPS: dict[tuple[Any, ...], ClusterMap] = {}
_MAPS_LOCK = threading.Lock()


# -- the lanes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lane:
    index: int
    conn: redis.Redis
    rq_prefix: str | None  # None: RQ's own keyspace (RQ_KEY_PREFIX)

    @property
    def queue_class(self) -> type[Any]:
        from .dispatch import lane_classes

        return lane_classes(self.rq_prefix)[0]

    @property
    def job_class(self) -> type[Any]:
        from .dispatch import lane_classes

        return lane_classes(self.rq_prefix)[1]

    def queue(self, prefix: str, name: str) -> Any:
        """The RQ queue carrying marbles queue `name` of deployment `prefix` in this lane."""
        from .dispatch import queue

        return queue(self.conn, prefix, name, self.rq_prefix)


class Lanes:
    """Every lane of a deployment, and where its deliveries go. `registration` is the
    connection of RQ's own keyspace (workers' registration, ``rq info``); with one lane it
    is that lane's connection."""

    def __init__(self, keys: Keyspace, lanes: list[Lane], registration: redis.Redis, *,
                 cluster: bool = False) -> None:
        if len(lanes) != keys.lanes:
            raise ValueError(f"{len(lanes)} lanes given for a keyspace of {keys.lanes}")
        self.keys = keys
        self.lanes = lanes
        self.registration = registration
        self.cluster = cluster

    @property
    def count(self) -> int:
        return len(self.lanes)

    def lane(self, index: int) -> Lane:
        return self.lanes[index]

    def lane_of(self, run_id: str) -> Lane:
        return self.lanes[self.keys.lane_of(run_id)]

    def enqueue(self, queue_name: str, run_id: str, attempt: int,
                lane: int | None = None) -> bool:
        """Enqueue one delivery in one round trip on its lane (the run's, unless given);
        False if RQ already holds a job with its id."""
        from . import dispatch

        target = self.lanes[lane] if lane is not None else self.lane_of(run_id)
        return dispatch.enqueue_delivery(target.conn, self.keys.prefix, queue_name, run_id,
                                         attempt, rq_prefix=target.rq_prefix)

    def enqueue_many(self, queue_name: str, runs: list[tuple[str, int]]) -> None:
        """Enqueue many deliveries, one round trip per lane (a job id RQ holds already is
        left alone)."""
        from . import dispatch

        for lane, batch in self._by_lane(runs).items():
            dispatch.enqueue_deliveries(lane.conn, self.keys.prefix, queue_name, batch,
                                        rq_prefix=lane.rq_prefix)

    def deliveries_exist(self, ids: list[tuple[str, int]]) -> list[bool]:
        from . import dispatch

        found: dict[tuple[str, int], bool] = {}
        for lane, batch in self._by_lane(ids).items():
            for key, there in zip(batch, dispatch.deliveries_exist(
                    lane.conn, self.keys.prefix, batch, rq_prefix=lane.rq_prefix), strict=True):
                found[key] = there
        return [found[key] for key in ids]

    def _by_lane(self, runs: list[tuple[str, int]]) -> dict[Lane, list[tuple[str, int]]]:
        out: dict[Lane, list[tuple[str, int]]] = defaultdict(list)
        for rid, attempt in runs:
            out[self.lane_of(rid)].append((rid, attempt))
        return out

    def same_server(self, store_client: Any) -> redis.Redis | None:
        """The connection one script can use to record a run and enqueue its delivery: only
        with one lane in RQ's own keyspace on the store's standalone server."""
        from .dispatch import same_server

        if self.count == 1 and self.lanes[0].rq_prefix is None \
                and same_server(store_client, self.lanes[0].conn):
            return self.lanes[0].conn
        return None

    def parse_indexes(self, text: str) -> list[int]:
        """The lanes named by `--lanes`: ``all`` or a comma-separated list of indexes."""
        text = text.strip()
        if text.lower() == "all":
            return list(range(self.count))
        parts = [part.strip() for part in text.split(",") if part.strip()]
        # ASCII digits only: int() would also read "0_1" as 1, "+1", "-0" or other scripts'
        # digits, and a typo for "0,1" would silently serve lane 1 alone.
        picked = [int(part) for part in parts if re.fullmatch(r"[0-9]{1,4}", part)]
        if not picked or len(picked) != len(parts) or any(not 0 <= i < self.count
                                                          for i in picked):
            raise ConfigError(f"invalid --lanes {text!r}: expected 'all' or lane numbers "
                              f"from 0 to {self.count - 1}, comma-separated")
        return list(dict.fromkeys(picked))

    def close(self) -> None:
        for conn in {id(x.conn): x.conn for x in self.lanes}.values():
            conn.close()


def open_lanes(url: str, keys: Keyspace) -> Lanes:
    """The lanes of deployment `keys` on the Redis at `url` (standalone: every lane on that
    server; ``redis+cluster://``: each lane on the master serving its slot)."""
    from rq.defaults import RQ_KEY_PREFIX

    from .dispatch import rq_connection

    scheme = url.split("://", 1)[0]
    if scheme not in CLUSTER_SCHEMES:
        conn = rq_connection(url)
        return Lanes(keys, [Lane(k, conn, keys.lane_rq_prefix(k)) for k in range(keys.lanes)],
                     conn)
    if "{" not in RQ_KEY_PREFIX or "}" not in RQ_KEY_PREFIX.split("{", 1)[1]:
        raise ConfigError(
            f"RQ on a Redis Cluster needs RQ's keyspace in one hash slot: set RQ_KEY_PREFIX to "
            f"a hash-tagged prefix such as '{{rq}}' (it is {RQ_KEY_PREFIX!r}) for every "
            f"marbles-rq and rq process of this deployment")
    registration = slot_client(url, key_slot(f"{RQ_KEY_PREFIX}:workers".encode()))
    lanes: list[Lane] = []
    for k in range(keys.lanes):
        rq_prefix = keys.lane_rq_prefix(k)
        slot = key_slot((rq_prefix or RQ_KEY_PREFIX).encode() + b":queues")
        lanes.append(Lane(k, registration if rq_prefix is None else slot_client(url, slot),
                          rq_prefix))
    return Lanes(keys, lanes, registration, cluster=True)


# What callers hand over as "RQ": the deployment's lanes, or one connection holding them all.
RQLike = Lanes | redis.Redis

_WRAPPED: weakref.WeakKeyDictionary[redis.Redis, dict[Keyspace, Lanes]] = (
    weakref.WeakKeyDictionary())


def as_lanes(rq: Lanes | redis.Redis, keys: Keyspace) -> Lanes:
    """`rq` as Lanes: a plain connection is every lane of `keys` on that one server."""
    if isinstance(rq, Lanes):
        return rq
    per = _WRAPPED.setdefault(rq, {})
    found = per.get(keys)
    if found is None:
        found = per[keys] = Lanes(
            keys, [Lane(k, rq, keys.lane_rq_prefix(k)) for k in range(keys.lanes)], rq)
    return found
