"""Controllers that share lanes (issue 10, item 7): real redis-server (and a real 3-master
cluster), real controller and worker processes, real signals.

- three controllers on six lanes split them 2/2/2; after kill -9 of one (and of the worker
  executing a run of one of its lanes) its lanes move to the other two within the lease,
  the run is redelivered exactly once, and every run of every lane ends once with each
  effect once; schedules and durable timers fire once across the kill;
- the same on a 3-master cluster with three lanes;
- lanes and the earlier controller lease: an older controller holding `controller` keeps
  lane-sharing controllers out; a fence left by another epoch counter is stepped over;
- a pass over idle lanes costs a bounded number of commands, and reads what is due only.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import redis

from marbles_rq.controller.loop import Controller
from marbles_rq.controller.share import Sharing
from marbles_rq.engine.ops import RunRequest, enqueue
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import Lease, LeaseHolder, open_store
from marbles_rq.store.keys import Keyspace
from marbles_rq.transport.dispatch import rq_connection
from tests import flow_workflows  # noqa: F401  (registers fl_timer for the enqueue here)
from tests import kill_workflows as zw
from tests.procs import KILL_SOURCE, REPO_ROOT, Proc, Procs, wait_for
from tests.redis_procs import RedisServer

TTL_MS = 2000
FLOW_SOURCE = REPO_ROOT / "tests" / "flow_workflows.py"
SCHED = REPO_ROOT / "tests" / "sched_sources"
FIRED = "sx:fired"        # tests/sched_sources/flows.py: one entry per scheduled run
EFFECTS = "fl:effects"    # tests/flow_workflows.py: one entry per effect step executed


def _pid(token: str | None) -> int | None:
    """The pid in a controller token ``host:pid:random:lanes``."""
    if token is None:
        return None
    pid = token.split(":")[1]
    return int(pid) if pid.isdigit() else None


def holders(client: redis.Redis, keys: Keyspace) -> list[int | None]:
    """The pid of the controller holding each lane's lease, or None."""
    values = [client.get(keys.lease(keys.lane_lease(lane))) for lane in range(keys.lanes)]
    return [None if v is None else _pid((v.decode() if isinstance(v, bytes) else str(v))
                                        .partition("|")[2]) for v in values]


def wait_split(client: redis.Redis, keys: Keyspace, pids: Iterable[int], *, timeout: float,
               procs: Procs) -> list[int | None]:
    """Wait until every lane is held by one of `pids`, evenly: each holds lanes // n or
    lanes // n + 1 of them."""
    pids = sorted(pids)
    low = keys.lanes // len(pids)

    def even() -> list[int | None] | None:
        held = holders(client, keys)
        counts = Counter(held)
        return held if all(h in pids for h in held) and all(
            low <= counts[p] <= low + 1 for p in pids) else None

    return wait_for(even, timeout=timeout, what=f"lanes split evenly over {pids}",
                    context=lambda: f"holders {holders(client, keys)}\n{procs.report()}")


def ids_per_lane(keys: Keyspace, per_lane: int, stem: str) -> dict[int, list[str]]:
    """Run ids, `per_lane` of them in each lane."""
    out: dict[int, list[str]] = {lane: [] for lane in range(keys.lanes)}
    n = 0
    while any(len(v) < per_lane for v in out.values()):
        rid = f"{stem}-{n}"
        n += 1
        lane = keys.lane_of(rid)
        if len(out[lane]) < per_lane:
            out[lane].append(rid)
    return out


def id_in_lane(keys: Keyspace, lane: int, stem: str) -> str:
    """The first of ``<stem>``, ``<stem>-1``, ``<stem>-2``, ... in `lane`."""
    rid, n = stem, 0
    while keys.lane_of(rid) != lane:
        n += 1
        rid = f"{stem}-{n}"
    return rid


def _kill_group(proc: Proc) -> None:
    """kill -9 a forking worker and its horse (its process group), and reap it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.popen.wait(timeout=10)


def _scenario(procs: Procs, client: redis.Redis, keys: Keyspace, *, controllers: int,
              per: int) -> None:
    """Controllers share the lanes; kill -9 one with a worker executing a run of its lane;
    everything ends once."""
    ctls = [procs.controller(lease_ms=TTL_MS, ready=False) for _ in range(controllers)]
    victim_worker = procs.worker(lease_ms=TTL_MS)
    procs.worker(lease_ms=TTL_MS, pool=3)
    held = wait_split(client, keys, [c.pid for c in ctls], timeout=30, procs=procs)
    assert sorted(Counter(held).values()) == [per] * controllers, held
    print(f"[lanes] split {held}")

    obs = procs.observer
    runs = ids_per_lane(keys, 2, "ln")
    for ids in runs.values():
        for rid in ids:
            procs.enqueue("zchain", {"steps": 3, "sleep_s": 0.3}, rid)
    # The run to strand: on the forking worker, in a lane of the controller we kill.
    victim = ctls[0]
    lane = next(lane for lane, pid in enumerate(held) if pid == victim.pid)
    steps = {rid: 3 for ids in runs.values() for rid in ids}

    def on_victim_worker(rid: str) -> bool:
        view = obs.view(rid)
        return view is not None and view.status == "running" and view.worker is not None \
            and view.worker.endswith(f".{victim_worker.pid}")

    # Enqueue until the forking worker (not the pool) runs one: each try is another id. On a
    # busy machine the forking worker may take an earlier try only after it was looked at.
    tries: list[str] = []
    for n in range(20):
        tries.append(id_in_lane(keys, lane, f"ln-target-{n}"))
        procs.enqueue("zchain", {"steps": 8, "sleep_s": 0.6}, tries[-1])
        steps[tries[-1]] = 8
        obs.wait_step_started(tries[-1], "zchain.zlink#0", attempt=1)
        target = next((rid for rid in tries if on_victim_worker(rid)), "")
        if target:
            break
    else:
        raise AssertionError("the forking worker never took a run")
    # One durable timer per lane, parked about now and due around the takeover: each fires
    # once, in lanes that keep their leader and in those that move.
    # In this process: six CLI starts would take longer than the run we are about to strand.
    timers = ids_per_lane(keys, 1, "tm")
    rq = rq_connection(procs.env.get("MARBLES_RQ_URL") or procs.url)
    for ids in timers.values():
        timer_input = json.dumps({"seconds": TTL_MS / 1000 + 0.5}).encode()
        enqueue(obs.runs, rq, RunRequest("fl_timer", timer_input, ids[0]))
    obs.wait_step_started(target, "zchain.zlink#1", attempt=1)
    assert obs.status(target) == "running", obs.dump(target)

    killed_at = time.monotonic()
    victim.kill9()
    _kill_group(victim_worker)
    procs.worker(lease_ms=TTL_MS)
    survivors = [c.pid for c in ctls[1:]]
    after = wait_split(client, keys, survivors, timeout=4 * TTL_MS / 1000 + 10, procs=procs)
    moved_s = time.monotonic() - killed_at
    print(f"[lanes] lanes of the killed controller moved in {moved_s:.2f} s "
          f"(lease {TTL_MS} ms): {after}")
    # Its leases lapse within the lease; the others take them at their next look (every
    # pass while a lane is unled). Generous on a shared machine.
    assert moved_s < 2 * TTL_MS / 1000 + 3, moved_s

    obs.wait_final(target, timeout=60)
    view = obs.view(target)
    assert view is not None and view.status == "succeeded", obs.dump(target)
    redelivered = [e for e in obs.events(target) if e.type == "redelivered"]
    assert view.attempt == 2 and len(redelivered) == 1, obs.dump(target)

    receipts: Counter[str] = Counter()
    for rid, n in steps.items():
        obs.wait_final(rid, timeout=60)
        receipts = Counter(obs.lrange(zw.RECEIPTS_KEY))
        view = obs.view(rid)
        assert view is not None and view.status == "succeeded", obs.dump(rid)
        for i in range(n):
            assert receipts[f"{rid}:zchain.zlink#{i}"] == 1, (rid, receipts)
        events = obs.events(rid)
        assert len([e for e in events if e.type == "final"]) == 1, obs.dump(rid)
        assert view.attempt == 1 + len([e for e in events if e.type == "redelivered"])
    assert sum(receipts.values()) == sum(steps.values()), receipts  # no effect twice
    # The redelivery came from the reaper, and no controller script failed on the way (a
    # failed reap still gets a run redelivered, later, by the dispatch check: not enough).
    logs = "".join(p.text() for p in procs.procs if p.role == "controller")
    assert "redelivering as attempt 2" in logs
    assert "script failed" not in logs and "Traceback" not in logs

    for ids in timers.values():
        obs.wait_final(ids[0], timeout=60)
        assert obs.status(ids[0]) == "succeeded", obs.dump(ids[0])
    effects = Counter(obs.lrange(EFFECTS))
    for ids in timers.values():
        # Each effect step once (twice only if its execution vanished mid-step, as any
        # step's): the timer's wake was one delivery, never two.
        lost = len([e for e in obs.events(ids[0]) if e.type == "redelivered"])
        for what in ("before", "after"):
            assert 1 <= effects[f"{ids[0]}:{what}"] <= 1 + lost, (effects, obs.dump(ids[0]))


def _schedules_fired_once(client: redis.Redis, before: int, procs: Procs) -> None:
    """The 20 interval schedules kept firing after the kill, and no occurrence twice."""
    wait_for(lambda: client.llen(FIRED) >= before + 40, timeout=60,
             what="schedules firing after the kill", context=procs.report)
    fired = [x.decode() for x in client.lrange(FIRED, 0, -1)]
    counts = Counter(fired)
    assert max(counts.values()) == 1, counts.most_common(3)
    assert len({rid.split(":")[1] for rid in fired}) == 20


def test_three_controllers_share_six_lanes_and_take_over_a_killed_ones(
        redis_server: RedisServer, tmp_path: Path) -> None:
    procs = Procs(redis_server.url, tmp_path / "procs",
                  sources=(KILL_SOURCE, FLOW_SOURCE, SCHED / "flows.py", SCHED / "many.py"))
    procs.env["MARBLES_LANE_COUNT"] = "6"
    keys = Keyspace(lanes=6)
    client = redis.Redis.from_url(redis_server.url)
    try:
        _scenario(procs, client, keys, controllers=3, per=2)
        _schedules_fired_once(client, client.llen(FIRED), procs)
        # Each of the six lanes was led by one controller at a time: every lane's epoch
        # grew by one per election (a lane moves at most twice here).
        for lane in range(6):
            epoch = int(client.get(keys.lease_epoch(keys.lane_lease(lane))) or 0)
            assert 1 <= epoch <= 4, (lane, epoch)
    finally:
        procs.stop_all()
        print(procs.report(lines=60))


def test_controllers_share_three_lanes_on_a_cluster(
        cluster_url: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """The store on 3 masters (RQ on a standalone Redis, as the README says), three lanes,
    three controllers: one lane each; kill -9 of one moves its lane; nothing lost or
    doubled."""
    procs = Procs(cluster_url, tmp_path / "procs", sources=(KILL_SOURCE, FLOW_SOURCE))
    procs.env["MARBLES_LANE_COUNT"] = "3"
    procs.env["MARBLES_RQ_URL"] = redis_server.url
    procs.env["MARBLES_TEST_EFFECTS_URL"] = redis_server.url  # the workflows' receipts
    keys = Keyspace(lanes=3)
    store = open_store(cluster_url, lanes=3)
    client = store.client
    # The lanes' leases live in their first buckets' slots: spread over the masters.
    nodes = {client.get_node_from_key(keys.lease(keys.lane_lease(lane))).name
             for lane in range(3)}
    print(f"[lanes] lane leases on {len(nodes)} masters")
    try:
        _scenario(procs, client, keys, controllers=3, per=1)
    finally:
        procs.stop_all()
        print(procs.report(lines=60))


# -- in process, against a real Redis ----------------------------------------------------------


def _runs(url: str, *, buckets: int = 64, lanes: int = 1, prefix: str = "mrq") -> RunStore:
    return RunStore(open_store(url, prefix=prefix, buckets=buckets, lanes=lanes))


def test_an_older_controller_holding_the_controller_lease_keeps_lanes_unled(
        redis_url: str) -> None:
    runs = _runs(redis_url, lanes=4)
    rq = rq_connection(redis_url)
    older = runs.store.acquire_lease("controller", "oldhost:42:abcdef12", 10_000)
    assert isinstance(older, Lease)
    share = Sharing(runs, rq, lease_ms=2000)
    share.balance()
    assert share.led == {}  # an earlier version leads every bucket: not one lane here
    runs.store.release_lease(older)
    share.balance()
    assert sorted(share.led) == [0, 1, 2, 3]  # alone: all four
    other = Sharing(runs, rq, lease_ms=2000)
    other.beat()
    share.beat()
    share.balance()  # two controllers: share 2, two lanes handed back
    assert len(share.led) == 2
    other.balance()
    assert len(other.led) == 2 and not set(other.led) & set(share.led)
    share.shutdown()
    other.shutdown()
    assert all(h is None for h in holders(runs.client, runs.keys))


def test_a_fence_from_another_epoch_counter_is_stepped_over_once(redis_url: str) -> None:
    """Lanes split after a single-lane deployment: lane 1's buckets hold fences from the
    `controller` counter (epoch 40); lane 1's own counter starts at 1. Its first leader
    is refused, gives the lease back, and takes an epoch above the fences."""
    runs = _runs(redis_url, lanes=2)
    keys = runs.keys
    for bucket in keys.lane_buckets(1):
        runs.client.hset(keys.controller_fence(bucket), "epoch", 40)
    ctl = Controller(runs, rq_connection(redis_url), lane=1, lease_ms=5000)
    assert ctl.lead() and ctl.epoch == 1
    ctl.recover()
    assert ctl.lease is None  # refused: stepped down and released
    assert isinstance(runs.store.lease_holder(keys.lane_lease(1)), type(None))
    assert ctl.step()  # leads again, above the fence, and recovers
    assert ctl.epoch == 41
    assert all(int(runs.client.hget(keys.controller_fence(b), "epoch") or 0) == 41
               for b in keys.lane_buckets(1))
    # Lane 0's fences were never touched by lane 1.
    assert all(runs.client.hget(keys.controller_fence(b), "epoch") is None
               for b in keys.lane_buckets(0))
    held = runs.store.acquire_lease(keys.lane_lease(1), "someone-else", 5000)
    assert isinstance(held, LeaseHolder) and held.epoch == 41
    ctl.release()

    # An equal epoch from another counter is no better: lane 1 of a fresh prefix, whose
    # fences an older controller (epoch 1 of the `controller` counter) wrote.
    runs = _runs(redis_url, lanes=2, prefix="eq")
    for bucket in runs.keys.lane_buckets(1):
        runs.client.hset(runs.keys.controller_fence(bucket), "epoch", 1)
    ctl = Controller(runs, rq_connection(redis_url), lane=1, lease_ms=5000)
    assert ctl.lead() and ctl.epoch == 1
    ctl.recover()
    assert ctl.lease is None
    assert ctl.step() and ctl.epoch == 2
    ctl.release()


def _commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items()
               if k not in ("cmdstat_info", "cmdstat_config|resetstat"))


def test_a_pass_over_idle_lanes_costs_commands_per_bucket_and_what_is_due(
        redis_url: str) -> None:
    """One pass per lane, nothing due: a bounded number of commands per bucket (one read
    of each due index, one server clock per pass). With runs due in one lane, only that
    lane's pass grows, by what is due."""
    buckets, lanes = 256, 8
    runs = _runs(redis_url, buckets=buckets, lanes=lanes)
    rq = rq_connection(redis_url)
    ctls = [Controller(runs, rq, lane=k, lease_ms=30_000) for k in range(lanes)]
    for ctl in ctls:
        assert ctl.lead()
        ctl.recover()
        ctl.pass_once()  # the first prune pass
    client = redis.Redis.from_url(redis_url)
    client.config_resetstat()
    for ctl in ctls:
        ctl.pass_once()
    per_pass = _commands(client)
    per_bucket = per_pass / buckets
    print(f"[cost] idle: {per_pass} commands for a pass over {lanes} lanes of "
          f"{buckets // lanes} buckets ({per_bucket:.2f} per bucket)")
    # Each lane: one TIME, one ZRANGEBYSCORE of the leases and one of the dispatch checks
    # per bucket; RQ's in-flight lists (a few commands).
    assert per_pass <= 2 * buckets + lanes * 12, per_pass

    # 300 dispatch checks due in lane 3 (of runs that are gone: each check reads the run
    # and drops the entry): that lane's pass grows by what is due, a few commands each.
    keys = runs.keys
    ids = [r for r in (f"due-{n}" for n in range(5000)) if keys.lane_of(r) == 3][:300]
    for rid in ids:
        client.zadd(keys.run_dispatch(keys.bucket_of(rid)), {rid: 0})
    client.config_resetstat()
    ctls[3].pass_once()
    lane3 = _commands(client)
    client.config_resetstat()
    ctls[4].pass_once()
    idle = _commands(client)
    print(f"[cost] lane 3 with 300 due: {lane3} commands; an idle lane: {idle}")
    assert idle <= 2 * buckets // lanes + 12
    # per check: the HMGET of the run, dispatch_done (EVALSHA and what it calls inside)
    assert idle + 300 <= lane3 <= idle + 6 * 300
    assert all(client.zcard(keys.run_dispatch(b)) == 0 for b in keys.lane_buckets(3))


def test_leader_doctor_and_health_show_who_leads_each_lane(
        redis_server: RedisServer, tmp_path: Path) -> None:
    procs = Procs(redis_server.url, tmp_path / "procs", sources=(KILL_SOURCE,))
    procs.env["MARBLES_LANE_COUNT"] = "4"
    keys = Keyspace(lanes=4)
    client = redis.Redis.from_url(redis_server.url)
    try:
        done = procs.cli("leader", "--json")
        assert done.returncode == 1 and json.loads(done.stdout)["unled"] == [0, 1, 2, 3]
        done = procs.cli("doctor", "--json")
        assert done.returncode == 0, done.stderr  # an unled lane is a warning
        lanes = [c for c in json.loads(done.stdout)["checks"] if c["node"] == "controller"]
        assert [c["value"] for c in lanes] == ["no controller leads"] * 4
        assert procs.cli("health", "controller").returncode == 1

        first = procs.controller(lease_ms=TTL_MS, ready=False)
        wait_split(client, keys, [first.pid], timeout=20, procs=procs)
        second = procs.controller(lease_ms=TTL_MS, ready=False)
        held = wait_split(client, keys, [first.pid, second.pid], timeout=20, procs=procs)
        done = procs.cli("leader", "--json")
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        assert data["unled"] == []
        assert [r["holder"].split(":")[1] for r in data["lanes"]] == [str(p) for p in held]
        assert [r["buckets"] for r in data["lanes"]] == [
            [keys.lane_buckets(k).start, keys.lane_buckets(k).stop - 1] for k in range(4)]
        text = procs.cli("doctor").stdout
        assert text.count("led by ") == 4, text
        health = procs.cli("health", "controller")
        # Both controllers run on this host: together they lead all four.
        assert health.returncode == 0 and "leads 4 of 4 lanes" in health.stdout, health
        assert str(first.pid) in health.stdout and str(second.pid) in health.stdout
        # A graceful stop hands the lanes back at once: the other one leads all four.
        second.stop()
        wait_split(client, keys, [first.pid], timeout=4 * TTL_MS / 1000, procs=procs)
    finally:
        procs.stop_all()
        print(procs.report())


def test_batched_scripts_go_in_one_pipeline_per_master_on_a_cluster(cluster_url: str) -> None:
    """call_many on a cluster: grouped by master, pipelined there; a call that fails on its
    keys comes back as its own error (errors=True), the others are applied."""
    runs = RunStore(open_store(cluster_url, lanes=3))
    keys, scripts = runs.keys, runs.scripts
    fences = [keys.controller_fence(b) for b in range(keys.buckets)]
    runs.client.hset(fences[7], "epoch", 9)
    replies = scripts.raise_fences(fences, 5)
    assert replies[7] == ("fenced", 9)
    assert all(r == ("ok", 0) for i, r in enumerate(replies) if i != 7)
    assert all(int(runs.client.hget(f, "epoch")) == (9 if i == 7 else 5)
               for i, f in enumerate(fences))
    assert scripts.raise_fences(fences[:2], 6) == [("ok", 5), ("ok", 5)]
    # Every master got its share of the calls (the fences spread over all three).
    calls = {node.name: int(node.redis_connection.info("commandstats").get(
        "cmdstat_evalsha", {}).get("calls", 0)) for node in runs.client.get_primaries()}
    assert len(calls) == 3 and all(n > 0 for n in calls.values()), calls
    runs.client.set(fences[3], "not a hash")
    out = scripts.call_many("raise_fence", [([f], [6]) for f in fences[:5]], errors=True)
    assert isinstance(out[3], redis.ResponseError) and "WRONGTYPE" in str(out[3])
    assert [o[0] for i, o in enumerate(out) if i != 3] == [b"ok"] * 4
    assert [int(o[1]) for i, o in enumerate(out) if i != 3] == [6, 6, 5, 5]


OLD_CONTROLLER = """
import os, signal, socket, sys, uuid, logging
from marbles_rq.controller.loop import Controller
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
url = sys.argv[1]
# A controller as every version before lanes ran it: one Controller over every bucket,
# under the `controller` lease, with a token of host:pid:random (no lane mark).
ctl = Controller(RunStore(open_store(url)), rq_connection(url), lease_ms=2000, interval_s=0.2,
                 token=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
signal.signal(signal.SIGTERM, lambda *_: ctl.stop_event.set())
ctl.run()
"""


def test_an_older_controller_process_and_lane_sharing_ones_never_both_lead(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """During an upgrade to lanes, an older controller (one lease, every bucket) still runs:
    the new ones lead no lane while it leads; once it stops, they take every lane."""
    import subprocess
    import sys

    procs = Procs(redis_server.url, tmp_path / "procs", sources=(KILL_SOURCE,))
    procs.env["MARBLES_LANE_COUNT"] = "4"
    keys = Keyspace(lanes=4)
    # The deployment's lane count is fixed when it is created (the meta hash): 4 here, as
    # the new controllers are configured; the older one adopts what is recorded.
    open_store(redis_server.url, lanes=4)
    client = redis.Redis.from_url(redis_server.url)
    log = (tmp_path / "old.log").open("wb")
    old = subprocess.Popen([sys.executable, "-c", OLD_CONTROLLER, redis_server.url],
                           env=procs.env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: holders(client, keys)[0] == old.pid, timeout=20,
                 what="the older controller to lead")
        new = procs.controller(lease_ms=TTL_MS, ready=False)
        new.wait_log("a controller of an earlier version", timeout=20)
        # For a few of its looks it leads nothing, and the older one keeps the lease.
        deadline = time.monotonic() + 3 * TTL_MS / 1000
        while time.monotonic() < deadline:
            assert holders(client, keys) == [old.pid, None, None, None]
            time.sleep(0.1)
        old.send_signal(signal.SIGTERM)  # it releases the lease as it stops
        old.wait(timeout=20)
        wait_split(client, keys, [new.pid], timeout=4 * TTL_MS / 1000, procs=procs)
        procs.enqueue("zchain", {"steps": 1}, "after-upgrade")
        procs.worker(lease_ms=TTL_MS)
        assert procs.observer.wait_status("after-upgrade", "succeeded", timeout=30)
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()
        log.close()
        procs.stop_all()
        print((tmp_path / "old.log").read_text(errors="replace")[-3000:])
        print(procs.report())
