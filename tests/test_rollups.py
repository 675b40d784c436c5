"""The dashboard's per-minute rollups, kept by a real `marbles-rq controller` against a real
redis-server: runs that finished (counted from the store's finished index, whatever worker
ran them) land in their minute by status with their workflow's durations; minutes older than
the window are trimmed; the write is fenced by the lane's epoch."""

from __future__ import annotations

import time

import msgspec
import redis

from marbles_rq.controller.rollups import percentile
from marbles_rq.store.keys import Keyspace
from marbles_rq.store.rollups import KEEP_MINUTES, MINUTE_MS, MinuteRollup, read_minutes
from marbles_rq.store.scripts import Scripts
from tests.procs import Procs, wait_for
from tests.web_stack import WEB_SOURCE

PROCS_SOURCES = [WEB_SOURCE]
PROCS_REPORT_LINES = 300
KEYS = Keyspace()


def _now_minute(client: redis.Redis) -> int:
    secs, micros = client.time()
    return (int(secs) * 1000 + int(micros) // 1000) // MINUTE_MS


def _totals(client: redis.Redis) -> tuple[int, int, int, dict[str, int]]:
    now = _now_minute(client)
    minutes = read_minutes(client, KEYS, now - 5, now)
    timed: dict[str, int] = {}
    for m in minutes.values():
        for name, d in m.durations.items():
            timed[name] = timed.get(name, 0) + d.n
    return (sum(m.succeeded for m in minutes.values()),
            sum(m.failed for m in minutes.values()),
            sum(m.cancelled for m in minutes.values()), timed)


def test_finished_runs_land_in_their_minute_by_status(procs: Procs) -> None:
    procs.start(workers=1)
    ids = []
    for n in range(3):
        done = procs.cli("enqueue", "web_noop", "--input", str(n), "--id", f"noop-{n}")
        assert done.returncode == 0, done.stderr
        ids.append(f"noop-{n}")
    done = procs.cli("enqueue", "web_approve", "--id", "appr-1")
    assert done.returncode == 0, done.stderr
    for run_id in ids:
        procs.observer.wait_status(run_id, "succeeded")
    procs.observer.wait_status("appr-1", "waiting")
    assert procs.cli("cancel", "appr-1").returncode == 0
    procs.observer.wait_status("appr-1", "cancelled")
    client = redis.Redis.from_url(procs.url)
    totals = wait_for(lambda: ((t := _totals(client))[0] == 3 and t[2] == 1 and t) or None,
                      timeout=60, what="the rollups to count 3 succeeded and 1 cancelled",
                      context=lambda: repr(_totals(client)))
    _, failed, _, timed = totals
    assert failed == 0
    # Durations are kept for runs that started: the cancelled approval started too.
    assert timed.get("web_noop") == 3
    assert timed.get("web_approve") == 1
    # The current minute carries a sample of the lane's queues and waiting runs.
    now = _now_minute(client)
    sampled = wait_for(lambda: ((m := read_minutes(client, KEYS, now, now + 1)) and
                        any(r.queued >= 0 for r in m.values()) and m) or None,
                       timeout=30, what="a queue sample in the current minute")
    assert all(r.waiting == 0 for r in sampled.values() if r.waiting >= 0)
    # Counted once, however often the controller recomputes: after another write (each one
    # sets the keys' expiry afresh), the same.
    # Without a write the expiry only runs down: a write shows as an expiry that is later
    # than the first reading minus the time since (by more than the polls' jitter).
    began, ttl = time.monotonic(), client.pttl(KEYS.rollups(0))

    def rewritten() -> bool:
        elapsed_ms = (time.monotonic() - began) * 1000
        return client.pttl(KEYS.rollups(0)) > ttl - elapsed_ms + 500

    wait_for(rewritten, timeout=40, what="another rollup write")
    assert _totals(client)[:3] == (3, 0, 1)


def test_old_minutes_are_trimmed_and_a_newer_epoch_fences(procs: Procs) -> None:
    client = redis.Redis.from_url(procs.url)
    now = _now_minute(client)
    stale = now - KEEP_MINUTES - 5
    old = MinuteRollup(version=1, minute=stale, succeeded=7)
    client.hset(KEYS.rollups(0), str(stale), msgspec.json.encode(old))
    client.zadd(KEYS.rollup_minutes(0), {str(stale): stale})
    procs.start(workers=1)
    wait_for(lambda: client.hget(KEYS.rollups(0), str(stale)) is None or None, timeout=40,
             what="the minute older than a day to be dropped")
    assert client.zscore(KEYS.rollup_minutes(0), str(stale)) is None
    # Bounded: the keys expire after a day and an hour without writes (a lane that is gone).
    assert 0 < client.pttl(KEYS.rollups(0)) <= (KEEP_MINUTES + 60) * MINUTE_MS
    # An ex-leader whose epoch is behind the lane's fence writes nothing.
    scripts = Scripts(client)
    reply = scripts.put_rollup(
        rollups_key=KEYS.rollups(0), minutes_key=KEYS.rollup_minutes(0),
        fence_key=KEYS.controller_fence(0), ctl_epoch=0, keep_from=now,
        keep_ms=60_000, minutes=[(now, msgspec.json.encode(old))])
    assert reply.status == "fenced"
    assert client.hget(KEYS.rollups(0), str(now)) != msgspec.json.encode(old)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5], 50) == 5
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([10, 1000], 95) == 1000


def test_a_new_leader_recounts_the_same_minutes(procs: Procs) -> None:
    """kill -9 the leader, a second controller takes over and backfills the last hour: the
    minutes it rewrites hold the same counts (written whole, never added to)."""
    procs.worker()
    first = procs.controller(lease_ms=2000)
    for n in range(3):
        procs.enqueue("web_noop", n, f"noop-{n}")
    for n in range(3):
        procs.observer.wait_status(f"noop-{n}", "succeeded")
    client = redis.Redis.from_url(procs.url)
    wait_for(lambda: _totals(client)[0] == 3 or None, timeout=60,
             what="the first leader's rollups to count 3 runs",
             context=lambda: repr(_totals(client)))
    first.kill9()
    second = procs.controller(lease_ms=2000)
    second.wait_log("recovered rollups: 3")
    assert _totals(client)[:3] == (3, 0, 0)
