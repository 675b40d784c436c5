"""The controller as a visible leader: `leader`, takeover after SIGKILL and SIGSTOP, fencing
of a paused ex-leader, a hung Redis, startup recovery; and `roll` and `list`. Real
redis-server, real controller and worker processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from marbles_rq.controller import Controller
from marbles_rq.controller.loop import LEASE_NAME
from marbles_rq.engine.ops import RunRequest, prepare
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import LeaseInfo, open_store
from marbles_rq.transport.dispatch import rq_connection
from tests.procs import HOSTNAME, Proc, Procs, wait_for
from tests.redis_procs import RedisServer

TTL_MS = 2000




def _holder(procs: Procs) -> LeaseInfo | None:
    return procs.observer.runs.store.lease_holder(LEASE_NAME)


def _leads(procs: Procs, proc: Proc, *, timeout: float) -> LeaseInfo:
    def check() -> LeaseInfo | None:
        info = _holder(procs)
        return info if info is not None and info.token.startswith(
            f"{HOSTNAME}:{proc.pid}:") else None

    return wait_for(check, timeout=timeout, what=f"controller {proc.pid} to lead")


def _leader_json(procs: Procs) -> tuple[int, object]:
    done = procs.cli("leader", "--json")
    return done.returncode, json.loads(done.stdout)


def test_leader_is_null_until_a_controller_leads_then_names_it(procs: Procs) -> None:
    code, data = _leader_json(procs)
    assert (code, data) == (1, None)
    ctl = procs.controller(lease_ms=TTL_MS)
    code, data = _leader_json(procs)
    assert code == 0 and isinstance(data, dict)
    assert data["holder"] == f"{HOSTNAME}:{ctl.pid}" and data["epoch"] == 1
    assert isinstance(data["since"], str) and data["since"].endswith("Z")
    text = procs.cli("leader")
    assert text.returncode == 0 and f"{HOSTNAME}:{ctl.pid}" in text.stdout


def test_a_standby_leads_within_the_lease_after_the_leader_is_killed(procs: Procs) -> None:
    first = procs.controller(lease_ms=TTL_MS)
    standby = procs.controller(lease_ms=TTL_MS, ready=False)
    standby.wait_log("controller ")  # started, waiting
    before = _leads(procs, first, timeout=5)
    first.kill9()
    killed_at = time.monotonic()
    after = _leads(procs, standby, timeout=TTL_MS / 1000 + 1)
    print(f"[failover] kill -9 -> new leader in {time.monotonic() - killed_at:.2f} s")
    assert after.epoch == before.epoch + 1
    code, data = _leader_json(procs)
    assert code == 0 and isinstance(data, dict)
    assert data["holder"] == f"{HOSTNAME}:{standby.pid}" and data["epoch"] == after.epoch


def test_a_paused_leader_is_replaced_and_changes_nothing_when_it_wakes(procs: Procs) -> None:
    procs.worker()
    first = procs.controller(lease_ms=TTL_MS)
    standby = procs.controller(lease_ms=TTL_MS, ready=False)
    _leads(procs, first, timeout=5)
    first.signal(signal.SIGSTOP)
    try:
        _leads(procs, standby, timeout=TTL_MS / 1000 + 1)
        # Work that both would act on: a run whose execution vanished.
        runs = RunStore(procs.observer.runs.store)
        runs.record(prepare(RunRequest("chain", b'{"steps": 1}', "paused-1"),
                            _chain_registry()))
        assert runs.start("paused-1", 1, ttl_ms=60_000, worker="gone").status == "ok"
        assert runs.abandon("paused-1", 1, "gone") == "ok"
        procs.observer.wait_status("paused-1", "succeeded", timeout=30)
    finally:
        first.signal(signal.SIGCONT)
    # Woken mid-pass, a fenced write makes it step down; woken between passes, its lease
    # renewal fails: either way it says it steps down, and acts on nothing.
    first.wait_log("stepping down", timeout=20)
    events = procs.observer.events("paused-1")
    assert [e.type for e in events].count("redelivered") == 1
    assert [e.type for e in events].count("final") == 1
    assert _holder(procs) is not None and _leads(procs, standby, timeout=1)


def _chain_registry():  # type: ignore[no-untyped-def]
    from marbles_rq.engine.authoring import REGISTRY, load_source
    from tests.procs import CHAIN_SOURCE

    if "chain" not in REGISTRY.workflows:
        load_source(str(CHAIN_SOURCE))
    return REGISTRY


def test_an_ex_leader_is_fenced_in_every_bucket(redis_url: str) -> None:
    """Even in a bucket the new leader never wrote to, a woken ex-leader's write is refused:
    the new leader claims every bucket when it is elected."""
    runs = RunStore(open_store(redis_url))
    rq = rq_connection(redis_url)
    old = Controller(runs, rq, lease_ms=1000)
    assert old.lead()
    runs.record(prepare(RunRequest("chain", b'{"steps": 1}', "fence-1"), _chain_registry()))
    assert runs.start("fence-1", 1, ttl_ms=60_000, worker="gone").status == "ok"
    assert runs.abandon("fence-1", 1, "gone") == "ok"
    # The old leader pauses past its lease; a new one is elected and recovers.
    wait_for(lambda: runs.store.lease_holder(LEASE_NAME) is None or None, timeout=5,
             what="the old lease to lapse")
    new = Controller(runs, rq, lease_ms=10_000)
    assert new.lead()
    new.recover()
    assert old.lease is not None  # it still believes it leads ...
    assert old.reap() == 0  # ... but its write is refused,
    assert old.lease is None  # and it steps down
    view = runs.get("fence-1")
    assert view is not None and view.status == "running" and view.attempt == 1
    assert new.reap() == 1


def test_the_controller_rides_out_a_hung_redis(procs: Procs,
                                               redis_server: RedisServer) -> None:
    procs.env["MARBLES_SOCKET_TIMEOUT"] = "1"
    ctl = procs.controller(lease_ms=TTL_MS)
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        ctl.wait_log("Redis error (", timeout=20)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    ctl.wait_log("Redis answers again", timeout=60)
    assert ctl.alive() and "Traceback" not in ctl.text()
    procs.worker()
    procs.enqueue("chain", {"steps": 1}, "after-hang")
    assert procs.observer.wait_status("after-hang", "succeeded", timeout=30)


def test_a_pass_that_hangs_puts_every_threads_stack_in_the_log(
        procs: Procs, redis_server: RedisServer) -> None:
    """Half a lease into a pass that does not end, the controller's log says where each of its
    threads is (a controller silent for tens of seconds once cost its lanes, and the stacks
    taken when the test stopped it no longer showed why)."""
    procs.env["MARBLES_SOCKET_TIMEOUT"] = "60"  # the pass waits on Redis rather than failing
    ctl = procs.controller(lease_ms=10_000)
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        ctl.wait_log("Timeout (0:00:05)!", timeout=30)
        ctl.wait_log("marbles_rq/controller/", timeout=5)  # its frames, not only threading's
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    assert ctl.alive() and "Traceback" not in ctl.text()


def test_recovery_dispatches_recorded_runs_first_and_logs_each_kind(procs: Procs) -> None:
    runs = RunStore(procs.observer.runs.store)
    ids = [f"rec-{i}" for i in range(30)]
    for run_id in ids:  # recorded, never enqueued (the enqueuer died), grace long gone
        runs.record(prepare(RunRequest("chain", b'{"steps": 1}', run_id), _chain_registry()))
        runs.client.zadd(runs.keys.run_keys(run_id).dispatch, {run_id: 0})
    ctl = procs.controller(lease_ms=TTL_MS)
    ctl.wait_log("recovered children: 30 in ")
    procs.worker()
    for run_id in ids:
        assert procs.observer.wait_status(run_id, "succeeded", timeout=60).attempt == 1


def test_roll_enqueues_a_workflow_now_and_list_shows_what_source_declares(
        procs: Procs) -> None:
    procs.worker()
    done = procs.cli("roll", "chain", "--input", '{"steps": 1}', "--id", "rolled-1")
    assert done.returncode == 0, done.stderr
    assert procs.observer.wait_status("rolled-1", "succeeded", timeout=30)
    again = procs.cli("roll", "chain", "--input", '{"steps": 1}', "--id", "rolled-1")
    assert again.returncode == 0 and "exists already" in again.stdout
    unknown = procs.cli("roll", "no-such-thing")
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: ")
    assert len(unknown.stderr.strip().splitlines()) == 1
    listed = procs.cli("list", "--json")
    assert listed.returncode == 0
    workflows = {w["name"]: w for w in json.loads(listed.stdout)["workflows"]}
    assert workflows["chain"]["input_schema"] is not None
    assert "steps" in json.dumps(workflows["chain"]["input_schema"])


def test_roll_and_list_a_monitor_from_the_cli(procs: Procs, tmp_path: Path) -> None:
    watched = tmp_path / "watched"
    watched.mkdir()
    (watched / "a.txt").write_text("a")
    source = tmp_path / "mon_flows.py"
    source.write_text(f'''
import marbles_rq as mr

@mr.workflow
def m_rolled(ctx, inp: dict) -> int:
    return len(inp["files"])

@mr.monitor("*.txt", root={str(watched)!r}, interval_s=3600, key="txt-files")
def on_txt(change):
    return mr.Launch("m_rolled", {{"files": sorted(change.added)}})
''')
    args = ("--source", str(source))
    listed = procs.cli(*args, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (mon,) = json.loads(listed.stdout)["monitors"]
    assert (mon["key"], mon["kind"], mon["interval_s"]) == ("txt-files", "files", 3600)
    rolled = procs.cli(*args, "roll", "txt-files")
    assert rolled.returncode == 0, rolled.stderr
    assert rolled.stdout.startswith("monitor txt-files: launched (run ")
    again = procs.cli(*args, "roll", "txt-files")
    assert again.returncode == 0 and again.stdout.startswith("monitor txt-files: unchanged")
    bad = procs.cli(*args, "roll", "txt-files", "--input", "{}")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_roll_and_list_a_schedule_from_the_cli(procs: Procs, tmp_path: Path) -> None:
    source = tmp_path / "sched_flows.py"
    source.write_text('''
import marbles_rq as mr

@mr.schedule(every="1h", key="hourly")
@mr.workflow
def s_rolled(ctx) -> str:
    return "ok"
''')
    args = ("--source", str(source))
    own = Procs(procs.url, tmp_path / "own", sources=(source,))
    try:
        own.controller(lease_ms=TTL_MS)  # registers the schedule

        def active() -> dict[str, object] | None:
            listed = procs.cli(*args, "list", "--json")
            assert listed.returncode == 0, listed.stderr
            (found,) = json.loads(listed.stdout)["schedules"]
            return found if found["status"] == "active" else None

        sch = wait_for(active, timeout=20, what="the schedule to be registered")
    finally:
        own.stop_all()
    assert (sch["key"], sch["workflow"], sch["paused"]) == ("hourly", "s_rolled", False)
    rolled = procs.cli(*args, "roll", "hourly")
    assert rolled.returncode == 0, rolled.stderr
    assert "hourly fired run " in rolled.stdout
    store = procs.observer.runs.store
    store.client.set(store.keys.schedule_lock("hourly"), "someone-else", px=60_000)
    held = procs.cli(*args, "roll", "hourly")
    assert held.returncode == 0, held.stderr
    assert "skipped: held by someone-else" in held.stdout


def test_two_controllers_started_at_once_elect_one(procs: Procs) -> None:
    procs.worker()
    both = [procs.controller(lease_ms=TTL_MS, ready=False) for _ in range(2)]
    for proc in both:
        proc.wait_log("controller ")
    info = wait_for(lambda: _holder(procs), timeout=10, what="a leader")
    assert info.epoch == 1  # one election, not two
    leaders = [p for p in both if info.token.startswith(f"{HOSTNAME}:{p.pid}:")]
    assert len(leaders) == 1
    runs = [f"pair-{i}" for i in range(5)]
    for run_id in runs:
        procs.enqueue("chain", {"steps": 1}, run_id)
    for run_id in runs:
        assert procs.observer.wait_status(run_id, "succeeded", timeout=30).attempt == 1
    (other,) = [p for p in both if p is not leaders[0]]
    assert "elected controller" not in other.text()
