"""The faults the hardening review found in the engine and the controller, each reproduced
against a real redis-server (and, where a process boundary matters, real worker and
controller processes). Numbers refer to the items of the hardening issue."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

import marbles_rq as mr
from marbles_rq.controller import Controller
from marbles_rq.engine import ops
from marbles_rq.engine.authoring import REGISTRY
from marbles_rq.engine.context import Limits
from marbles_rq.engine.execute import execute
from marbles_rq.engine.execution import event
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.store.records import WorkspaceEntry
from marbles_rq.transport.dispatch import rq_connection
from tests.procs import CHAIN_SOURCE, KILL_SOURCE, REPO_ROOT, Procs, wait_for
from tests.redis_procs import RedisServer

H_SOURCE = REPO_ROOT / "tests" / "hardening_workflows.py"
OTHER_SOURCE = REPO_ROOT / "tests" / "sources_h" / "only_chain.py"
Q = "rq:queue:mrq.default"  # RQ's list of queue "default" of the default prefix

CHILD_CALLS: Counter[str] = Counter()
PARENT_TRIES: Counter[str] = Counter()


@mr.step
def hx_child(tag: str) -> str:
    CHILD_CALLS[tag] += 1
    return f"child-{tag}"


@mr.step(retries=1, delay_s=0.01, jitter=False)
def hx_parent(tag: str) -> str:
    value = hx_child(tag)
    PARENT_TRIES[tag] += 1
    if PARENT_TRIES[tag] == 1:
        raise RuntimeError("fails once, after its child committed")
    return str(value)


@mr.workflow("hx_retry_children")
def hx_retry_children(ctx: mr.RunContext, inp: dict[str, str]) -> str:
    return str(hx_parent(inp["tag"]))


@mr.workflow("hx_noop")
def hx_noop(ctx: mr.RunContext) -> str:
    return "ok"


@mr.workflow("hx_slow_step", timeout_s=0.5)
def hx_slow_step(ctx: mr.RunContext) -> str:
    ctx.step(lambda: time.sleep(1.0) or "late")
    return "done"


@mr.workflow("hx_two_deliveries", max_deliveries=2)
def hx_two_deliveries(ctx: mr.RunContext) -> str:
    return "ok"


@mr.workflow("hx_short_lived", retention_s=0)
def hx_short_lived(ctx: mr.RunContext) -> str:
    ctx.stream.write("hello")
    ctx.log.info("a log line")
    ctx.claim_effect("charge-1")
    ctx.step(lambda: 41)
    return "ok"


@mr.workflow("hx_chatty")
def hx_chatty(ctx: mr.RunContext, inp: dict[str, int]) -> str:
    for i in range(inp["lines"]):
        ctx.stream.write(f"line {i}")
    return "ok"


@mr.workflow("hx_big")
def hx_big(ctx: mr.RunContext, inp: dict[str, str]) -> str:
    size = 4000
    if inp["what"] == "write":
        ctx.stream.write("x" * size)
    elif inp["what"] == "log":
        ctx.log.info("x" * size)
    elif inp["what"] == "step":
        ctx.step(lambda: "x" * size)
    return "x" * size if inp["what"] == "result" else "small"


def _runs(url: str) -> RunStore:
    return RunStore(open_store(url))


def _record(runs: RunStore, name: str, raw: bytes, run_id: str) -> None:
    assert runs.record(prepare(RunRequest(name, raw, run_id))).created


def _run(runs: RunStore, run_id: str, attempt: int, *, lease_ms: int = 60_000,
         limits: Limits | None = None) -> str:
    return execute(runs, REGISTRY, run_id, attempt, worker="w", lease_ms=lease_ms,
                   hard_exit=False, limits=limits)


PROCS_SOURCES = (CHAIN_SOURCE, KILL_SOURCE, H_SOURCE)


# -- 1. a pool executor is never ended for a run that already finished ------------------------

def test_pool_timed_out_run_never_kills_the_next_run(procs: Procs) -> None:
    """A run times out between short steps; the same executor takes the next run at once.
    The finished run's watchdog must not end the executor in the middle of that run."""
    worker = procs.worker(pool=1, lease_ms=1500)
    procs.controller()
    procs.enqueue("h_timeout_steps", None, "pool-timeout")
    procs.enqueue("h_marker", None, "pool-next")
    timed_out = procs.observer.wait_status("pool-timeout", "failed", timeout=30)
    assert timed_out.error is not None and timed_out.error.type == "RunTimeout"
    done = procs.observer.wait_status("pool-next", "succeeded", timeout=30)
    marks = [json.loads(m) for m in procs.observer.lrange("h:marker")]
    assert [m["run"] for m in marks] == ["pool-next"], marks  # its effect ran once
    assert done.attempt == 1
    assert "exited with 75" not in worker.text()


# -- 2. a retried step replays its children at the positions it used before -------------------

def test_retried_step_replays_its_children(redis_url: str) -> None:
    runs = _runs(redis_url)
    CHILD_CALLS.clear()
    PARENT_TRIES.clear()
    _record(runs, "hx_retry_children", b'{"tag": "a"}', "children-1")
    assert _run(runs, "children-1", 1) == "succeeded"
    view = runs.get("children-1")
    assert view is not None
    assert sorted(s.key for s in view.steps) == [
        "hx_retry_children.hx_parent#0", "hx_retry_children.hx_parent#0.hx_child#0"]
    assert CHILD_CALLS["a"] == 1  # committed once, replayed on the parent's retry
    assert msgspec.json.decode(view.result or b"") == "child-a"


# -- 3. deliveries stuck between a worker's pop and its bookkeeping ---------------------------

def test_delivery_stuck_in_the_intermediate_list_is_redelivered(procs: Procs) -> None:
    procs.enqueue("chain", {"steps": 1}, "stuck-1")
    rq = redis.Redis.from_url(procs.url)
    # What a worker SIGKILLed between BLMOVE and its bookkeeping leaves behind.
    assert rq.lmove(Q, f"{Q}:intermediate") == b"mrq-stuck-1-a1"
    procs.controller()
    procs.worker()
    done = procs.observer.wait_status("stuck-1", "succeeded", timeout=20)
    assert done.attempt == 2
    reasons = [e.data["reason"] for e in procs.observer.events("stuck-1")
               if e.type == "redelivered"]
    assert reasons == ["delivery lost before it started"]


def test_delivery_stuck_in_the_started_registry_or_failed_before_start(redis_url: str) -> None:
    runs = _runs(redis_url)
    rq = rq_connection(redis_url)
    for run_id in ("wip-1", "failed-1"):
        assert ops.enqueue(runs, rq, RunRequest("hx_noop", b"null", run_id)).dispatched
        assert rq.lrem(Q, 1, f"mrq-{run_id}-a1") == 1
    # A worker recorded its pop and died before the run started; a horse died before start.
    rq.zadd("rq:wip:mrq.default", {"mrq-wip-1-a1:exec1": time.time() + 60})
    rq.zadd("rq:failed:mrq.default", {"mrq-failed-1-a1": time.time() + 7 * 86400})
    ctl = Controller(runs, rq, lost_after_s=0.0)
    assert ctl.lead()
    assert ctl.find_lost() == 2
    assert sorted(rq.lrange(Q, 0, -1)) == [b"mrq-failed-1-a2", b"mrq-wip-1-a2"]
    assert ctl.find_lost() == 0


# -- 4. a controller pass costs what is due, not what is queued -------------------------------

def _commands(client: redis.Redis) -> int:
    return sum(int(v["calls"]) for k, v in client.info("commandstats").items()
               if k.startswith("cmdstat_"))


def test_a_controller_pass_costs_what_is_due_not_what_is_queued(redis_url: str) -> None:
    runs = _runs(redis_url)
    rq = rq_connection(redis_url)
    n = 6_000
    results = ops.enqueue_many(runs, rq, [RunRequest("hx_noop", b"null", f"q-{i}")
                                          for i in range(n)])
    assert all(r.dispatched for r in results)
    # Every dispatch check is due (the enqueuer's grace has passed), and one lease expired.
    pipe = runs.client.pipeline(transaction=False)
    for i in range(n):
        pipe.zadd(runs.keys.run_keys(f"q-{i}").dispatch, {f"q-{i}": 0})
    pipe.execute()
    _record(runs, "hx_noop", b"null", "expired-1")
    assert runs.start("expired-1", 1, ttl_ms=60_000, worker="w").status == "ok"
    assert runs.abandon("expired-1", 1, "w") == "ok"

    ctl = Controller(runs, rq, dispatch_budget=500)
    assert ctl.lead()
    runs.client.config_resetstat()
    ctl.pass_once()
    first = _commands(runs.client)
    assert ctl.stats.redelivered == 1  # reaping did not wait behind the dispatch checks
    assert first < 6 * 500 + 10 * runs.keys.buckets, first
    for _ in range(n // 500 + 2):
        ctl.pass_once()
    runs.client.config_resetstat()
    ctl.pass_once()
    idle = _commands(runs.client)
    assert idle < 10 * runs.keys.buckets, idle  # nothing due: independent of 6,000 queued
    assert rq.llen(Q) == n + 1  # each delivery once (plus the redelivery)


# -- 5. a worker that lacks a workflow hands the run back -------------------------------------

def test_a_run_waits_for_a_worker_that_knows_its_workflow(procs: Procs, tmp_path: Path) -> None:
    other = Procs(procs.url, tmp_path / "other", sources=(OTHER_SOURCE,))
    try:
        other.worker()
        procs.controller()
        procs.enqueue("h_marker", None, "unknown-1")
        procs.observer.wait_event("unknown-1", lambda e: e.type == "deferred",
                                  what="a deferral", timeout=20)
        status = json.loads(procs.cli("status", "unknown-1", "--json").stdout)
        assert status["status"] in ("queued", "running")
        assert status["status"] == "running" or "h_marker" in (status["note"] or "")
        procs.worker()
        done = procs.observer.wait_status("unknown-1", "succeeded", timeout=60)
        assert done.error is None
        assert not any(e.type == "final" and e.data.get("status") == "failed"
                       for e in procs.observer.events("unknown-1"))
    finally:
        other.stop_all()


# -- 6. settling at start fences a zombie -----------------------------------------------------

def test_settling_at_start_fences_the_old_execution(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "hx_noop", b"null", "zombie-1")
    old = runs.start("zombie-1", 1, ttl_ms=60_000, worker="w1").execution
    assert old is not None
    assert runs.abandon("zombie-1", 1, "w1") == "ok"  # its lease reads as expired
    assert runs.cancel("zombie-1") == "requested"
    assert runs.start("zombie-1", 1, ttl_ms=60_000, worker="w2").status == "cancelled"
    assert runs.claim_effect(old, "charge") == "stale_epoch"


# -- 7. the deadline holds even when the watchdog is gone -------------------------------------

def test_a_step_that_ends_after_the_deadline_fails_the_run(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "hx_slow_step", b"null", "late-1")
    # A 60 s lease: the watchdog renews every 20 s, so it never sees the deadline here.
    assert _run(runs, "late-1", 1, lease_ms=60_000) == "timed_out"
    view = runs.get("late-1")
    assert view is not None and view.status == "failed"
    assert view.error is not None and view.error.type == "RunTimeout"
    assert [s.status for s in view.steps] == ["running"]  # the late result was not recorded


# -- 8. lost deliveries count against max_deliveries ------------------------------------------

def test_lost_deliveries_count_against_max_deliveries(redis_url: str) -> None:
    runs = _runs(redis_url)
    rq = rq_connection(redis_url)
    assert ops.enqueue(runs, rq, RunRequest("hx_two_deliveries", b"null", "poison-1")).dispatched
    ctl = Controller(runs, rq, lost_after_s=0.0)
    assert ctl.lead()
    for attempt in (1, 2):
        assert rq.lmove(Q, f"{Q}:intermediate") == f"mrq-poison-1-a{attempt}".encode()
        ctl.find_lost()
    view = runs.get("poison-1")
    assert view is not None and view.status == "failed" and view.attempt == 2
    assert view.error is not None and view.error.type == "DeliveriesExhausted"
    assert rq.llen(Q) == 0


# -- 9. a resend is answered with the first send's outcome ------------------------------------

def test_resends_answer_with_the_first_sends_outcome(redis_url: str) -> None:
    store = open_store(redis_url)
    runs = RunStore(store)
    scripts, keys = store.scripts, store.keys

    def cas(updated_at: str, expected: str, request_id: str) -> bool:
        entry = WorkspaceEntry(version=1, workspace_id="ws", key="k", updated_at=updated_at)
        return scripts.cas_entry(
            entry_key=keys.entry("ws", "k"), listing_key=keys.entries("ws"),
            owned_key=keys.owned("", keys.bucket_of("ws")),
            marker_key=keys.request_marker("ws", request_id), expected=expected,
            updated_at=updated_at, doc=msgspec.json.encode(entry), request_id=request_id,
            owner="", key="k").ok

    assert cas("t1", "", "req-a")
    assert cas("t2", "t1", "req-b")  # another writer moves the entry on
    assert cas("t1", "", "req-a")  # the resend of the first: ok, as the first send was

    from marbles_rq.store.records import EventRecord, encode

    record = EventRecord(version=1, id="ev-1", source="s")
    rkey, lkey, okey = keys.claim_keys("event", "ev-1", "agent-1")

    def claim() -> bool:
        return scripts.claim_record(
            record_key=rkey, listing_key=lkey, owned_key=okey,
            marker_key=keys.request_marker("ev-1", "req-c"), record_id="ev-1",
            doc=encode(record), request_id="req-c", owner="agent-1").won

    assert claim()
    store.purge("agent-1")
    assert store.get(EventRecord, "ev-1") is None
    assert claim()  # the resend answers as the first send did ...
    assert store.get(EventRecord, "ev-1") is None  # ... and does not create it again

    _record(runs, "hx_noop", b"null", "cancel-1")
    run_keys = keys.run_keys("cancel-1")

    def cancel() -> str:
        return scripts.cancel_run(keys=run_keys, run_id="cancel-1", event=event(x=1),
                                  request_id="req-d").status

    assert cancel() == "cancelled"
    assert cancel() == "cancelled"  # not "already finished"


# -- 10. enqueue_many enqueues each chunk right after recording it ----------------------------

def test_enqueue_many_enqueues_each_chunk_right_after_recording_it(redis_url: str) -> None:
    runs = _runs(redis_url)
    rq = rq_connection(redis_url)
    # One claim_runs call per chunk on this shared Redis (claim_run: one call per run).
    claim_shas = tuple(f"EVALSHA {runs.client.script_load(runs.scripts.scripts[name].source)}"
                       for name in ("claim_run", "claim_runs"))
    seen: list[str] = []
    monitor_client = redis.Redis.from_url(redis_url)

    def watch() -> None:
        with monitor_client.monitor() as m:
            for cmd in m.listen():
                text = cmd["command"]
                if "monitor-stop" in text:
                    return
                if text.startswith(claim_shas):
                    seen.append("claim")
                elif text.startswith((f"LPUSH {Q}", f"RPUSH {Q}")):
                    seen.append("push")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    wait_for(lambda: any(c.get("cmd") == "monitor" for c in runs.client.client_list()) or None,
             timeout=10, what="MONITOR to start")
    results = ops.enqueue_many(runs, rq, [RunRequest("hx_noop", b"null", f"m-{i}")
                                          for i in range(1_200)])
    runs.client.echo("monitor-stop")
    thread.join(10)
    assert all(r.dispatched for r in results)
    assert seen.count("claim") == 3  # 1,200 runs in chunks of 500
    first_push, last_claim = seen.index("push"), len(seen) - 1 - seen[::-1].index("claim")
    assert first_push < last_claim  # the first chunk was in RQ before the last was recorded
    assert sorted(rq.lrange(Q, 0, -1)) == sorted(f"mrq-m-{i}-a1".encode() for i in range(1_200))


# -- 11. a corrupt record costs only itself ---------------------------------------------------

def test_corrupt_records_cost_only_themselves(procs: Procs) -> None:
    store = open_store(procs.url)
    keys = store.keys
    client = store.client
    procs.enqueue("chain", {"steps": 1}, "c-bad-attempt")
    procs.enqueue("chain", {"steps": 1}, "c-bad-doc")
    # A run whose attempt is garbage and whose lease expired; a run document that is not
    # JSON; an index key of the wrong type in a third bucket.
    client.hset(keys.run("c-bad-attempt"), mapping={"attempt": "abc", "status": "running"})
    client.zadd(keys.run_keys("c-bad-attempt").leases, {"c-bad-attempt": 0})
    rq = redis.Redis.from_url(procs.url)
    rq.lrem(Q, 0, "mrq-c-bad-attempt-a1")
    client.hset(keys.run("c-bad-doc"), "doc", b"{not json")
    used = {keys.bucket_of(r) for r in ("c-bad-attempt", "c-bad-doc", "c-good")}
    spare = next(b for b in range(keys.buckets) if b not in used)
    client.set(keys.run_leases(spare), "not a sorted set")

    controller = procs.controller()
    procs.worker()
    procs.enqueue("chain", {"steps": 1}, "c-good")
    assert procs.observer.wait_status("c-good", "succeeded", timeout=30)
    for run_id in ("c-bad-attempt", "c-bad-doc"):
        final = procs.observer.wait_event(run_id, lambda e: e.type == "final",
                                          what="its final event", timeout=30)
        assert final.data["status"] == "failed"
        assert final.data["error"]["type"] == "CorruptRecord"
        assert keys.run(run_id) in final.data["error"]["message"]
        assert len([e for e in procs.observer.events(run_id) if e.type == "final"]) == 1
    assert controller.alive()
    controller.wait_log(keys.run_leases(spare))
    assert "Traceback" not in controller.text()
    listed = procs.cli("runs", "--json")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert "c-good" in {r["id"] for r in json.loads(listed.stdout)}
    shown = procs.cli("status", "c-bad-doc")
    assert shown.returncode == 1 and "Traceback" not in shown.stderr
    assert keys.run("c-bad-doc") in shown.stderr and len(shown.stderr.splitlines()) == 1


# -- 12. the controller rides out refused writes ----------------------------------------------

def test_the_controller_rides_out_an_out_of_memory_redis(procs: Procs) -> None:
    controller = procs.controller(lease_ms=2000)
    client = redis.Redis.from_url(procs.url)
    client.config_set("maxmemory", 1)  # noeviction: every write is refused with OOM
    controller.wait_log("OutOfMemoryError", timeout=20)
    assert controller.alive()
    client.config_set("maxmemory", 0)
    controller.wait_log("Redis answers again", timeout=40)
    procs.worker()
    procs.enqueue("chain", {"steps": 1}, "after-oom")
    assert procs.observer.wait_status("after-oom", "succeeded", timeout=30)
    assert "Traceback" not in controller.text()
    assert controller.text().count("OutOfMemoryError") < 20  # backed off, not a flood


# -- 19. retention: a finished run leaves nothing behind --------------------------------------

def _all_keys(client: redis.Redis) -> set[bytes]:
    return set(client.scan_iter(count=1000))


def test_retention_prunes_everything_a_run_stored(redis_url: str) -> None:
    runs = _runs(redis_url)
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead()
    _record(runs, "hx_noop", b"null", "kept-1")
    assert _run(runs, "kept-1", 1) == "succeeded"
    before = _all_keys(runs.client)
    _record(runs, "hx_short_lived", b"null", "short-1")
    assert _run(runs, "short-1", 1) == "succeeded"
    assert _all_keys(runs.client) > before
    assert ctl.prune() == 1
    assert _all_keys(runs.client) == before
    assert not any(b"short-1" in k for k in _all_keys(runs.client))
    assert all(b"short-1" not in m for k in runs.client.scan_iter(match="*:idx:run")
               for m in runs.client.zrange(k, 0, -1))
    assert runs.get("short-1") is None
    assert runs.get("kept-1") is not None and ctl.prune() == 0  # 7 days by default


def test_output_is_capped_per_run(redis_url: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "hx_chatty", b'{"lines": 10}', "chatty-1")
    assert _run(runs, "chatty-1", 1, limits=Limits(output_lines=3)) == "succeeded"
    events = runs.output("chatty-1")
    assert [e.data["text"] for e in events if e.type == "output"] == [
        "line 0", "line 1", "line 2"]
    marks = [e for e in events if e.type == "truncated"]
    assert len(marks) == 1 and marks[0].data["max_lines"] == 3


# -- 20. size limits on what a run writes -----------------------------------------------------

@pytest.mark.parametrize("what", ["write", "log", "step", "result"])
def test_oversized_values_fail_the_run_and_write_nothing(redis_url: str, what: str) -> None:
    runs = _runs(redis_url)
    run_id = f"big-{what}"
    _record(runs, "hx_big", json.dumps({"what": what}).encode(), run_id)
    limits = Limits(write_bytes=1000, log_bytes=1000, step_result_bytes=1000, result_bytes=1000)
    assert _run(runs, run_id, 1, limits=limits) == "failed"
    view = runs.get(run_id)
    assert view is not None and view.error is not None
    assert view.error.type in ("ValueTooLargeError", "StepFailedError")
    assert "over the limit of 1,000" in view.error.message
    stored = sum(len(v) for v in runs.client.hgetall(runs.keys.run(run_id)).values())
    assert stored < 4000
    assert all(len(json.dumps(e.data)) < 4000 for e in runs.output(run_id))


def test_limits_from_the_environment_refuse_garbage(monkeypatch: Any) -> None:
    from marbles_rq.errors import ConfigError

    monkeypatch.setenv("MARBLES_MAX_WRITE", "lots")
    with pytest.raises(ConfigError, match="MARBLES_MAX_WRITE"):
        Limits.from_env()
    monkeypatch.setenv("MARBLES_MAX_WRITE", "2048")
    assert Limits.from_env().write_bytes == 2048


def test_a_multi_queue_worker_pops_where_a_lost_delivery_can_be_seen(procs: Procs) -> None:
    """RQ pops for several queues with BLPOP, which leaves no trace of a job between the pop
    and the bookkeeping; marbles-rq's worker moves it into the queue's intermediate list,
    and takes it out once the delivery completed (with its next pop)."""
    client = redis.Redis.from_url(procs.url)
    procs.controller()
    procs.worker(extra=["--queues", "hi,lo"])
    client.config_resetstat()
    procs.enqueue("chain", {"steps": 1}, "mq-lo", "--queue", "lo")
    procs.enqueue("chain", {"steps": 1}, "mq-hi", "--queue", "hi")
    for run_id in ("mq-lo", "mq-hi"):
        assert procs.observer.wait_status(run_id, "succeeded", timeout=30).attempt == 1
    stats = client.info("commandstats")
    assert "cmdstat_blpop" not in stats and "cmdstat_lmove" in stats
    wait_for(lambda: client.llen("rq:queue:mrq.lo:intermediate") == 0
             and client.llen("rq:queue:mrq.hi:intermediate") == 0, timeout=10,
             what="the completed deliveries to leave the intermediate lists",
             context=procs.report)


# -- 22: the chain example's effect is exactly once, also when killed next to it ---------------

class Killed(BaseException):
    """Stands in for the process dying at that point: nothing more runs, nothing settles."""


def test_the_chain_example_applies_its_effect_once_across_a_kill_at_the_effect(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed right before the effect reaches its target, then redelivered: the effect
    happens once. (Reserving with claim_effect first, as the example did, skipped it.)"""
    from marbles_rq.engine.authoring import load_source

    modname = load_source(str(CHAIN_SOURCE))[0]
    import sys

    chain = sys.modules[modname]
    monkeypatch.setenv("MARBLES_REDIS_URL", redis_url)
    real = redis.Redis.from_url(redis_url)
    runs = _runs(redis_url)
    _record(runs, "chain", b'{"steps": 2}', "fx-1")

    class DiesBeforeTheEffect:
        def eval(self, *args: Any) -> Any:
            raise Killed

        def rpush(self, *args: Any) -> Any:
            raise Killed

    target = "_target" if hasattr(chain, "_target") else "_receipts"
    monkeypatch.setattr(chain, target, lambda: DiesBeforeTheEffect())
    with pytest.raises(Killed):
        _run(runs, "fx-1", 1)
    monkeypatch.setattr(chain, target, lambda: real)
    assert runs.abandon("fx-1", 1, "w") == "ok"
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead() and ctl.reap() == 1
    assert _run(runs, "fx-1", 2) == "succeeded"
    receipts = [k.decode() for k in real.lrange(chain.RECEIPTS_KEY, 0, -1)]
    assert sorted(receipts) == ["fx-1:chain.link#0", "fx-1:chain.link#1"]


# -- found by trying it as a hostile user ----------------------------------------------------

def test_a_start_refused_by_the_store_is_redelivered_with_rq_on_its_own_redis(
        procs: Procs, tmp_path: Path) -> None:
    """The store refuses the worker's start (OOM) while RQ's Redis is fine: RQ records the
    delivery as failed, once; the controller must still deliver the run again."""
    rq_server = RedisServer.start(dir=tmp_path / "rq-redis")
    try:
        procs.env["MARBLES_RQ_URL"] = rq_server.url
        (worker,) = procs.start(workers=1)
        worker.signal(signal.SIGSTOP)
        procs.enqueue("chain", {"steps": 1}, "oom-start")
        store = redis.Redis.from_url(procs.url)
        store.config_set("maxmemory", 1)
        try:
            worker.signal(signal.SIGCONT)
            worker.wait_log("stopped on a Redis error", timeout=30)
        finally:
            store.config_set("maxmemory", 0)
        done = procs.observer.wait_status("oom-start", "succeeded", timeout=40)
        assert done.attempt == 2
    finally:
        rq_server.stop()


def test_watch_no_follow_prints_the_whole_output(procs: Procs) -> None:
    procs.worker()
    procs.enqueue("h_many_lines", {"lines": 1_500}, "many-lines")
    procs.observer.wait_status("many-lines", "succeeded", timeout=60)
    shown = procs.cli("watch", "many-lines", "--no-follow")
    assert shown.returncode == 0
    lines = shown.stdout.splitlines()
    assert sum(1 for ln in lines if " line " in ln) == 1_500
    assert "run succeeded: 1500" in lines[-1]


def test_sys_exit_in_a_step_fails_the_run_once(procs: Procs) -> None:
    procs.start(workers=1, pool=1)
    procs.enqueue("h_sys_exit", None, "exits")
    view = procs.observer.wait_status("exits", "failed", timeout=30)
    assert view.attempt == 1 and view.error is not None and view.error.type == "SystemExit"


@pytest.mark.parametrize("field,value", [("epoch", "inf"), ("epoch", "1.5"), ("attempt", "-1"),
                                         ("attempt", "99999999999999999999"),
                                         ("status", "bogus")])
def test_a_run_field_that_is_not_a_whole_number_fails_the_run_once(
        redis_url: str, field: str, value: str) -> None:
    runs = _runs(redis_url)
    _record(runs, "hx_noop", b"null", "odd-1")
    runs.client.hset(runs.keys.run("odd-1"), field, value)
    attempt = 1
    assert _run(runs, "odd-1", attempt) == "failed"
    view = runs.client.hgetall(runs.keys.run("odd-1"))
    assert view[b"status"] == b"failed"
    assert b"CorruptRecord" in view[b"error"] and runs.keys.run("odd-1").encode() in view[b"error"]


def test_a_broken_index_key_records_nothing_and_costs_only_its_bucket(redis_url: str) -> None:
    runs = _runs(redis_url)
    rq = rq_connection(redis_url)
    keys = runs.keys
    broken = keys.bucket_of("victim-1")
    runs.client.set(keys.run_dispatch(broken), "not a sorted set")
    from marbles_rq.errors import CorruptRecordError

    # Recorded without its delivery (RQ elsewhere): the dispatch check is written, and fails.
    with pytest.raises(CorruptRecordError, match="dispatch holds a string"):
        runs.record(prepare(RunRequest("hx_noop", b"null", "victim-1")))
    assert not runs.client.exists(keys.run("victim-1"))  # nothing recorded, nothing stranded
    assert not runs.client.exists(keys.output("victim-1"))
    # Enqueued with its record (one Redis), a run needs no dispatch check; the run listing
    # is written on every path.
    runs.client.set(keys.listing("run", broken), "not a sorted set")
    with pytest.raises(CorruptRecordError, match="idx:run holds a string"):
        ops.enqueue(runs, rq, RunRequest("hx_noop", b"null", "victim-1"))
    assert not runs.client.exists(keys.run("victim-1"))  # nothing recorded, nothing stranded
    assert not runs.client.exists(keys.output("victim-1"))
    assert rq.llen("rq:queue:mrq.default") == 0
    # A garbage controller fence in another bucket does not make a healthy run "corrupt".
    healthy = next(f"h-{i}" for i in range(1000) if keys.bucket_of(f"h-{i}") != broken)
    runs.client.hset(keys.controller_fence(keys.bucket_of(healthy)), "epoch", "not a number")
    _record(runs, "hx_noop", b"null", healthy)
    assert runs.start(healthy, 1, ttl_ms=60_000, worker="gone").status == "ok"
    assert runs.abandon(healthy, 1, "gone") == "ok"
    ctl = Controller(runs, rq)
    assert ctl.lead()
    assert ctl.reap() == 1
    view = runs.get(healthy)
    assert view is not None and view.status == "queued" and view.attempt == 2


def test_a_stray_entry_of_another_bucket_is_removed_not_retried_forever(redis_url: str) -> None:
    runs = _runs(redis_url)
    keys = runs.keys
    stray = next(f"g-{i}" for i in range(1000) if keys.bucket_of(f"g-{i}") != 1)
    runs.client.zadd(keys.run_leases(1), {stray: 1})
    runs.client.zadd(keys.run_dispatch(1), {stray: 1})
    ctl = Controller(runs, rq_connection(redis_url))
    assert ctl.lead()
    ctl.pass_once()
    assert runs.client.zcard(keys.run_leases(1)) == 0
    assert runs.client.zcard(keys.run_dispatch(1)) == 0
