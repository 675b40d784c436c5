"""The controller's reads of what is due cost O(lanes), not O(buckets), when nothing is due
(controller/due_watch.py): real redis-server processes and a real 3-master cluster.

- an idle pass of every lane, with the duties of a `marbles-rq controller`, sends a few
  commands per lane at 1,024 buckets (counted by the server: INFO commandstats);
- an entry coming due in any bucket of any lane is still found, whether a client's ZADD or
  a script's (an enqueue's dispatch check) wrote it, and `soonest` sees it;
- a lost subscription (CLIENT KILL), the flags turned off, or a server refusing CONFIG SET:
  what is due is still found, by reading every bucket again;
- on a cluster, one subscription per master: an entry in a bucket of each master is found;
- a store grown to more buckets: its controller watches the new bucket tags.
"""

from __future__ import annotations

import redis

from marbles_rq.controller.loop import Controller
from marbles_rq.controller.rollups import RollupsDuty
from marbles_rq.controller.waiting import WaitingDuty
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.grow import Grower
from marbles_rq.store.keys import Keyspace
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.triggers.events import EventsDuty
from marbles_rq.triggers.monitors import MonitorsDuty
from marbles_rq.triggers.schedules import OccurrenceDuty, ScheduleDuty, ScheduleRegistry
from tests import flow_workflows  # noqa: F401  (registers fl_timer for the enqueue here)
from tests.redis_procs import RedisServer

FAR_MS = 10 ** 13  # a due time far ahead: not due, but an entry of the index


def _commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items()
               if k not in ("cmdstat_info", "cmdstat_config|resetstat"))


def _ids_by_bucket(keys: Keyspace, prefix: str = "x") -> dict[int, str]:
    """One id routed to each bucket."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < keys.buckets:
        rid = f"{prefix}{n}"
        found.setdefault(keys.bucket_of(rid), rid)
        n += 1
    return found


def _controllers(url: str, *, buckets: int, lanes: int,
                 rq_url: str | None = None) -> list[Controller]:
    runs = RunStore(open_store(url, buckets=buckets, lanes=lanes))
    rq = rq_connection(rq_url or url)
    ctls = []
    for lane in range(lanes):
        sched = ScheduleDuty(ScheduleRegistry(), threaded=False)
        ctl = Controller(runs, rq, lane=lane, lease_ms=30_000, duties=[
            EventsDuty(), WaitingDuty(threaded=False), OccurrenceDuty(sched), sched,
            MonitorsDuty(), RollupsDuty()])
        assert ctl.lead()
        ctl.recover()
        ctls.append(ctl)
    return ctls


def test_an_idle_pass_costs_commands_per_lane_not_per_bucket(redis_url: str) -> None:
    buckets, lanes = 1024, 2
    ctls = _controllers(redis_url, buckets=buckets, lanes=lanes)
    for ctl in ctls:
        ctl.pass_once()  # the first look reads every bucket once (and the first rollup)
        assert ctl.watch.watching
    client = redis.Redis.from_url(redis_url)
    client.config_resetstat()
    for ctl in ctls:
        ctl.pass_once()
    per_pass = _commands(client)
    print(f"[cost] idle: {per_pass} commands for a pass over {lanes} lanes of "
          f"{buckets // lanes} buckets")
    # Each lane: the server clock, one PING per look at a due index, RQ's in-flight lists.
    # Reading every bucket's indexes cost about four commands per bucket.
    assert per_pass <= 20 * lanes, per_pass


def test_an_entry_due_in_any_bucket_is_found(redis_url: str) -> None:
    ctls = _controllers(redis_url, buckets=1024, lanes=2)
    keys = ctls[0].keys
    client = redis.Redis.from_url(redis_url)
    for ctl in ctls:
        assert ctl.due(keys.run_waits, ctl.server_ms(), 10) == []
        assert ctl.soonest(keys.run_waits) is None
        assert ctl.watch.watching
    ids = _ids_by_bucket(keys)
    for bucket, rid in ids.items():
        ctl = ctls[keys.lane_of_bucket(bucket)]
        now = ctl.server_ms()
        client.zadd(keys.run_waits(bucket), {rid: FAR_MS})
        assert ctl.soonest(keys.run_waits) == FAR_MS
        assert ctl.due(keys.run_waits, now, 10) == []
        client.zadd(keys.run_waits(bucket), {rid: now - 1}, xx=True)  # a new, sooner score
        assert ctl.soonest(keys.run_waits) == now - 1
        assert ctl.due(keys.run_waits, now, 10) == [(bucket, rid)]
        client.zrem(keys.run_waits(bucket), rid)
        assert ctl.due(keys.run_waits, now, 10) == []
    # Written by a script (a recorded run's dispatch check, due after the enqueuer's
    # grace), one run in each bucket: every check is found once its time has come.
    runs = ctls[0].runs
    run_ids = _ids_by_bucket(keys, prefix="r")
    runs.record_many([prepare(RunRequest("fl_timer", b'{"seconds": 0}', rid))
                      for rid in run_ids.values()])
    for ctl in ctls:
        assert ctl.due(keys.run_dispatch, ctl.server_ms() - 60_000, 10) == []
        found = ctl.due(keys.run_dispatch, ctl.server_ms() + 60_000, 10)
        assert sorted(found) == sorted((b, rid) for b, rid in run_ids.items()
                                       if keys.lane_of_bucket(b) == ctl.lane)


def test_what_is_due_is_found_when_notifications_are_lost(redis_server: RedisServer) -> None:
    (ctl,) = _controllers(redis_server.url, buckets=256, lanes=1)
    keys = ctl.keys
    client = redis.Redis.from_url(redis_server.url)
    ids = _ids_by_bucket(keys)
    assert ctl.due(keys.run_leases, ctl.server_ms(), 10) == []
    assert ctl.watch.watching
    # The subscription is cut: the next look reads every bucket again, then subscribes anew.
    client.client_kill_filter(_type="pubsub")
    client.zadd(keys.run_leases(7), {ids[7]: 1})
    assert ctl.due(keys.run_leases, ctl.server_ms(), 10) == [(7, ids[7])]
    assert ctl.due(keys.run_leases, ctl.server_ms(), 10) == [(7, ids[7])]
    assert ctl.watch.watching
    client.zrem(keys.run_leases(7), ids[7])
    assert ctl.due(keys.run_leases, ctl.server_ms(), 10) == []
    # The flags turned off (a write is no longer told): noticed within a second, and then
    # every bucket is read while they stay off.
    client.config_set("notify-keyspace-events", "")
    client.zadd(keys.run_leases(9), {ids[9]: 1})
    found: list[tuple[int, str]] = []
    deadline = ctl.server_ms() + 5_000
    while not found and ctl.server_ms() < deadline:
        found = ctl.due(keys.run_leases, ctl.server_ms(), 10)
    assert found == [(9, ids[9])]
    client.zrem(keys.run_leases(9), ids[9])
    # A server where CONFIG SET is refused: no notifications, every look reads every bucket.
    client.config_set("notify-keyspace-events", "")
    client.execute_command("ACL", "SETUSER", "default", "-config|set")
    try:
        ctl.watch.close()
        ctl.watch._retry_at = 0.0
        client.zadd(keys.run_leases(11), {ids[11]: 1})
        assert ctl.due(keys.run_leases, ctl.server_ms(), 10) == [(11, ids[11])]
        assert not ctl.watch.watching
    finally:
        client.execute_command("ACL", "SETUSER", "default", "+config|set")


def test_on_a_cluster_one_subscription_per_master_finds_what_is_due(
        cluster_url: str, redis_url: str) -> None:
    (ctl,) = _controllers(cluster_url, buckets=1024, lanes=1, rq_url=redis_url)
    keys = ctl.keys
    assert ctl.due(keys.run_dispatch, ctl.server_ms(), 10) == []
    assert ctl.watch.watching and len(ctl.watch._conns) == 3
    client = ctl.store.client
    ids = _ids_by_bucket(keys)
    sample = [0, 1, 341, 342, 683, 684, 1023]  # both ends of each master's third
    for bucket in sample:
        client.zadd(keys.run_dispatch(bucket), {ids[bucket]: 1})
    assert sorted(ctl.due(keys.run_dispatch, ctl.server_ms(), 10)) == [
        (b, ids[b]) for b in sample]
    client.zadd(keys.run_dispatch(500), {ids[500]: FAR_MS})
    for bucket in sample:
        client.zrem(keys.run_dispatch(bucket), ids[bucket])
    assert ctl.due(keys.run_dispatch, ctl.server_ms(), 10) == []
    assert ctl.soonest(keys.run_dispatch) == FAR_MS


def test_a_grown_store_is_watched_under_its_new_buckets(redis_url: str) -> None:
    """`buckets grow` is offline: a controller started after it watches the new bucket tags,
    and finds both an entry the growth moved and one written after."""
    runs = RunStore(open_store(redis_url, buckets=64))
    keys = runs.keys
    old = _ids_by_bucket(keys)
    runs.client.zadd(keys.run_waits(5), {old[5]: FAR_MS})  # not due: recovery leaves it
    Grower(runs.client, keys.prefix, 128, progress=lambda _: None).run()
    (ctl,) = _controllers(redis_url, buckets=128, lanes=1)
    grown = ctl.keys
    assert grown.buckets == 128
    moved_to = grown.bucket_of(old[5])
    assert ctl.due(grown.run_waits, FAR_MS, 10) == [(moved_to, old[5])]
    assert ctl.soonest(grown.run_waits) == FAR_MS
    assert ctl.watch.watching
    new = _ids_by_bucket(grown)
    runs.client.zadd(grown.run_waits(127), {new[127]: FAR_MS - 1})
    assert ctl.soonest(grown.run_waits) == FAR_MS - 1
    assert sorted(ctl.due(grown.run_waits, FAR_MS, 10)) == sorted(
        [(moved_to, old[5]), (127, new[127])])
