"""Durable mutexes (flow/locks.py): the lock scripts on a server and on a 3-master cluster
(FIFO, fencing by epoch, lapses); 20 runs on 3 worker processes contending for one key with
kill -9 of the holder's process, checked from a log the critical sections append to; order
of arrival; an async body; release on an exception and at a park; bad input; `locks` from
the CLI, both clients and the HTTP API."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import load_source
from marbles_rq.flow.lock_store import RedisLocks
from marbles_rq.flow.locks import LockError
from marbles_rq.store import open_store
from tests.procs import Procs, pid_alive, wait_for

LOCK_SOURCE = Path(__file__).with_name("lock_workflows.py")
PROCS_SOURCES = (LOCK_SOURCE,)


@pytest.fixture(autouse=True)
def _registry() -> None:
    load_source(str(LOCK_SOURCE))  # the test process enqueues these workflows itself


def _enqueue(url: str, workflow: str, jobs: dict[str, dict[str, Any]]) -> None:
    with mr.connect(url) as client:
        handles = client.start_many([mr.StartRequest(workflow, input_json=json.dumps(job),
                                                     id=rid) for rid, job in jobs.items()])
    assert all(h.created for h in handles)


def _log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _check_never_two_inside(lines: list[dict[str, Any]]) -> None:
    """Walk the log in its order (O_APPEND: one total order): an execution is inside from
    its enter to its exit, or to the test's `killed` line for it; nobody enters while
    another execution is inside."""
    inside: tuple[str, int] | None = None
    for line in lines:
        who = (line["run"], line["epoch"])
        if line["ev"] == "enter":
            assert inside is None, f"{who} entered while {inside} was inside"
            inside = who
        else:  # exit or killed
            assert inside == who, f"{line['ev']} of {who}, but {inside} was inside"
            inside = None


# --------------------------------------------------------------------------------------------
# the scripts


def _locks(url: str) -> RedisLocks:
    store = open_store(url)
    from marbles_rq.engine.runs import RunStore

    return RunStore(store).locks()


def _scripts_fifo_and_fencing(locks: RedisLocks) -> None:
    a = locks.acquire("k", "A", 5, 60_000)
    assert a.status == "ok" and a.until > 0
    assert locks.acquire("k", "A", 5, 60_000).status == "ok"  # a resend: its own again
    b, c = locks.acquire("k", "B", 1, 60_000), locks.acquire("k", "C", 1, 60_000)
    assert (b.status, b.position, b.queued, b.holder) == ("queued", 0, 1, "A")
    assert (c.status, c.position, c.queued) == ("queued", 1, 2)
    assert locks.acquire("k", "B", 1, 60_000).position == 0  # asking again keeps its place
    # an older execution of A is fenced: it can neither renew nor release, nor take it
    assert locks.renew("k", "A", 4, 60_000)[0] == "stale"
    assert locks.release("k", "A", "4")[0] == "not_held"
    assert locks.acquire("k", "A", 4, 60_000).status == "stale"
    assert locks.release("k", "B", "1")[0] == "not_held"  # not B's to release
    # a newer execution of A (redelivered inside the block) takes the hold over at once
    again = locks.acquire("k", "A", 7, 60_000)
    assert again.status == "ok" and again.since == a.since
    assert locks.renew("k", "A", 5, 60_000)[0] == "stale"
    assert locks.renew("k", "A", 7, 60_000)[0] == "ok"
    assert locks.release("k", "A", "7") == ("ok", "B")  # the head, to wake
    assert locks.release("k", "A", "7")[0] == "not_held"  # a resend: nothing twice
    # free, B's turn: a newcomer D and C (behind B) wait; B takes it
    assert locks.acquire("k", "D", 1, 60_000).position == 2
    assert locks.acquire("k", "C", 1, 60_000).status == "queued"
    assert locks.acquire("k", "B", 1, 60_000).status == "ok"
    assert locks.renew("k", "A", 7, 60_000)[0] == "lost"
    [info] = locks.list()
    assert (info.name, info.holder, info.waiters) == ("k", "B", ["C", "D"])
    # a holder whose run finished is freed by "<= epoch"; a waiter dropped from the queue
    assert locks.release("k", "B", "<= 9", drop="C") == ("ok", "D")
    assert locks.acquire("k", "D", 1, 60_000).status == "ok"
    # a hold that lapses (its holder vanished) goes to the head when it asks
    assert locks.release("k", "D", "1")[0] == "ok"
    assert locks.acquire("k2", "E", 1, 150).status == "ok"
    assert locks.acquire("k2", "F", 1, 60_000).status == "queued"
    wait_for(lambda: locks.acquire("k2", "F", 1, 60_000).status == "ok" or None, timeout=10,
             what="E's hold lapsed and F took it")
    assert locks.renew("k2", "E", 1, 150)[0] == "lost"


def test_lock_scripts(redis_url: str) -> None:
    _scripts_fifo_and_fencing(_locks(redis_url))


def test_lock_scripts_on_a_cluster(cluster_url: str) -> None:
    _scripts_fifo_and_fencing(_locks(cluster_url))


# --------------------------------------------------------------------------------------------
# runs in real processes


def test_twenty_runs_contend_with_kill9_of_the_holder(procs: Procs, tmp_path: Path) -> None:
    procs.start(workers=3)
    log = tmp_path / "critical.log"
    ids = [f"c{i:02d}" for i in range(20)]
    _enqueue(procs.url, "lk_contend",
             {rid: {"log": str(log), "hold_s": 0.3, "lease_s": 3.0} for rid in ids})
    # kill -9 the process executing the critical section, while inside (after 3 were done)
    victim = wait_for(lambda: next((x for x in [_log(log)] if len(x) >= 7 and
                                    x[-1]["ev"] == "enter"), None) and _log(log)[-1],
                      timeout=60, what="a fourth run inside its critical section")
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim["pid"]) or None, timeout=10, what="the holder died")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.write(fd, (json.dumps({**victim, "ev": "killed"}) + "\n").encode())
    os.close(fd)
    for rid in ids:
        procs.observer.wait_status(rid, "succeeded", timeout=180)
    lines = _log(log)
    _check_never_two_inside(lines)
    done = {line["run"] for line in lines if line["ev"] == "exit"}
    assert done == set(ids)  # each completed its critical section
    killed_at = next(i for i, line in enumerate(lines) if line["ev"] == "killed")
    after = lines[killed_at + 1]
    assert after["ev"] == "enter"  # the lock went on: to the killed run's redelivery or
    if after["run"] == victim["run"]:  # the next waiter, after its lapse
        assert after["epoch"] > victim["epoch"]
    # the killed execution's run completed its section in a later execution
    assert any(x["run"] == victim["run"] and x["ev"] == "exit" and x["epoch"] > victim["epoch"]
               for x in lines)
    with mr.connect(procs.url) as client:
        [info] = client.locks()
    assert (info.name, info.holder, info.waiters) == ("shared", "", [])


def test_waiters_in_order_of_arrival_status_and_every_face(procs: Procs,
                                                          tmp_path: Path) -> None:
    """A holder that waits for the test's gate; three runs queue behind it one by one (each
    parked, no worker held: one worker with a pool of 2 serves them all); `status`, `watch`,
    `locks` (CLI, both clients, HTTP, the dashboard) show the holder and the queue; opening
    the gate lets them through in order of arrival."""
    import asyncio

    import redis

    from tests.lock_workflows import GATE_PREFIX
    from tests.test_web_api import API_TOKEN, curl
    from tests.web_stack import start_web

    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    procs.start(workers=1, pool=2)
    log = tmp_path / "critical.log"
    obs = procs.observer
    _enqueue(procs.url, "lk_gated", {"g0": {"log": str(log)}})
    wait_for(lambda: _log(log) or None, timeout=60, what="g0 inside")
    waiters = ["w1", "w2", "w3"]
    for rid in waiters:
        _enqueue(procs.url, "lk_contend", {rid: {"log": str(log), "hold_s": 0.05}})
        obs.wait_status(rid, "waiting", timeout=60)
    done = procs.cli("status", "w3")
    assert "lock; lock shared, place 3 of 3, held by g0" in done.stdout, done.stdout
    watched = procs.cli("watch", "w3", "--no-follow")
    assert "waiting for lock shared (place 3 of 3, held by g0)" in watched.stdout, \
        watched.stdout
    listed = procs.cli("locks", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["name"], row["holder"], row["waiters"]) == ("shared", "g0", waiters)
    assert row["until_ms"] > row["since_ms"] > 0
    text = procs.cli("locks")
    assert "shared  held by g0" in text.stdout and "waiters 3: w1, w2, w3" in text.stdout
    got = curl(web, "GET", "/api/locks")
    assert got.status == 200, got.body
    assert got.json()["locks"][0]["waiters"] == waiters
    page = web.signed_in().get("/system")
    assert "Locks" in page.text and 'href="/runs/w2"' in page.text

    async def from_asyncio() -> list[Any]:
        async with mr.connect_async(procs.url) as client:
            return await client.locks()

    [info] = asyncio.run(from_asyncio())
    assert (info.holder, info.waiters) == ("g0", waiters)
    redis.Redis.from_url(procs.url).set(GATE_PREFIX + "g0", 1)
    for rid in ["g0", *waiters]:
        obs.wait_status(rid, "succeeded", timeout=60)
    lines = _log(log)
    _check_never_two_inside(lines)
    assert [x["run"] for x in lines if x["ev"] == "enter"] == ["g0", *waiters]
    for rid in waiters:  # each parked for the lock once, woken by the release before it
        events = obs.events(rid)
        assert sum(e.type == "parked" for e in events) == 1
        assert any(e.type == "woken" and e.data.get("cause") == "lock" for e in events)
        assert [e.type for e in events].count("lock_acquired") == 1
    with mr.connect(procs.url) as client:
        assert [(i.holder, i.waiters) for i in client.locks()] == [("", [])]


def test_async_body_exception_and_park_inside(procs: Procs, tmp_path: Path) -> None:
    """`async with` in an async body; an exception inside the block releases the lock (the
    run fails); a body that sleeps inside the block parks holding it, and its resumed
    execution takes it back before the runs queued meanwhile."""
    procs.start(workers=2)
    log = tmp_path / "critical.log"
    job = {"log": str(log), "hold_s": 0.1}
    _enqueue(procs.url, "lk_async", {f"a{i}": job for i in range(4)})
    _enqueue(procs.url, "lk_raises", {"x1": job})
    for rid in ["a0", "a1", "a2", "a3"]:
        procs.observer.wait_status(rid, "succeeded", timeout=60)
    failed = procs.observer.wait_status("x1", "failed", timeout=60)
    assert "inside the lock" in str(failed.error)
    _enqueue(procs.url, "lk_sleeps", {"s1": {**job, "hold_s": 1.0}})
    wait_for(lambda: any(x["run"] == "s1" for x in _log(log)) or None, timeout=60,
             what="s1 inside")
    _enqueue(procs.url, "lk_contend", {"c1": job})
    procs.observer.wait_status("s1", "succeeded", timeout=60)
    procs.observer.wait_status("c1", "succeeded", timeout=60)
    lines = _log(log)
    _check_never_two_inside(lines)
    assert [x["run"] for x in lines if x["ev"] == "enter"][-3:] == ["s1", "s1", "c1"]
    replayed = [e.type for e in procs.observer.events("s1")]
    assert replayed.count("lock_acquired") == 1 and replayed.count("lock_released") == 1
    with mr.connect(procs.url) as client:
        assert [(i.holder, i.waiters) for i in client.locks()] == [("", [])]


def test_bad_key_or_lease_is_one_line(procs: Procs) -> None:
    for key, lease in [("", 5), ("a|b", 5), ("x" * 201, 5), ("ok", 0), ("ok", -1),
                       ("ok", float("nan")), ("ok", "5"), (7, 5)]:
        with pytest.raises(LockError) as refused:
            mr.lock(key, lease_s=lease)  # type: ignore[arg-type]
        assert "\n" not in str(refused.value) and "invalid lock" in str(refused.value)
    with pytest.raises(mr.MarblesError, match="not inside a marbles-rq run"), mr.lock("ok"):
        pass
    procs.start(workers=1)
    _enqueue(procs.url, "lk_bad", {"b1": {"key": "a|b"}})
    failed = procs.observer.wait_status("b1", "failed", timeout=60)
    assert "invalid lock key 'a|b'" in str(failed.error)
    done = procs.cli("locks")
    assert done.returncode == 0 and "no locks" in done.stdout, done.stdout
