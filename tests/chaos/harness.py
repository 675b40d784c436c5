"""Runs a chaos plan against real processes and collects its history.

Processes: a durable redis-server (ops/redis.conf: appendonly yes, appendfsync always) in a
temporary directory on a free port; two controllers; two forking workers, one ``--pool 3``
worker and one ``--concurrency 4`` worker (several runs, sync and async, in one process).
Each process runs in its own session, so in its own process group (a
forking worker's horse puts itself in a group of its own and dies with its worker through
PR_SET_PDEATHSIG). A supervisor loop in the main thread restarts whatever died, as systemd
would, and SIGCONTs what a fault stopped once its time is up.

Threads: the main thread fires the plan's faults and supervises; a submitter thread
enqueues, sends events and cancels at the plan's times (CLI calls on a small pool; some CLI
calls are SIGKILLed while they work, as a client that dies midway); an answerer thread
answers the questions it finds in the feed (and tries a second answer, which must be
refused); a sampler thread reads the concurrency limits' live holds in the store every
0.1 s. Every call that meets a Redis outage is retried with the same ids.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import redis

from marbles_rq.client import Client
from marbles_rq.deployment import Settings
from marbles_rq.engine import ops
from marbles_rq.engine.execution import RunNotFoundError
from marbles_rq.engine.failed_steps import NotFailedStepError
from marbles_rq.engine.rerun import rerun
from marbles_rq.engine.runs import TERMINAL, RunStore
from marbles_rq.engine.signals import send_signal, start_with_signal
from marbles_rq.engine.waits import AlreadyAnsweredError, NotPausedError, WaitStore
from marbles_rq.errors import MarblesError
from marbles_rq.flow.limit_specs import limit_id
from marbles_rq.store import open_store
from marbles_rq.transport.lanes import open_lanes
from marbles_rq.triggers.events import Events
from tests.chaos import history as h
from tests.chaos import workloads  # registers the workflows and the trigger to submit
from tests.chaos.names import (
    ARTIFACT_CAS,
    ARTIFACT_PLAIN,
    COLOURS,
    CUSTOMERS,
    EVENT_SOURCE,
    EVENT_TYPE,
    LIMIT_GLOBAL,
    LIMIT_PER_KEY,
    ORDER_SOURCE,
    PUTS_KEY,
    RETRY_PATCH,
    SCHEDULES,
    SESSION_SHARED,
    SIGNAL_NAME,
    SOURCE,
)
from tests.chaos.plan import Action, Fault, Plan, order_event
from tests.procs import REPO_ROOT, Proc, _cli_argv, children, descendants, stop_procs
from tests.redis_procs import RedisServer

T = TypeVar("T")
assert workloads.SOURCE == SOURCE
NOW = time.monotonic
RETRY_FOR_S = 90.0  # a submission keeps trying this long through Redis outages
TARGET_WAIT_S = 3.0  # a fault waits this long for a busy target before taking any
# Lanes of the deployment under test (MARBLES_CHAOS_LANES; 1 by default): with several, the
# controllers share them, each lane with its own lease, epoch and RQ keyspace.
LANES = int(os.environ.get("MARBLES_CHAOS_LANES", "1"))
STARTUP_EXCUSE_S = 15.0
KEY_ID = "cx1"  # MARBLES_KEYS of every chaos process: one key, made for the run
SAMPLE_EVERY_S = 0.1  # how often the sampler reads the concurrency limits' holds
RERUN_WAIT_S = 90.0  # a rerun waits this long for its source run to finish
RETRY_WAIT_S = 240.0  # six tries parked 0.6 s to 9.6 s apart, through kills and outages
WAIT_START_S = 60.0  # a cancel or pause waits this long for its run to start
HOLD_S = 5.0  # a "hold" between a pause and its resume: longer than a lease and a step
# The limits of the flow control workloads: (label, workflow, key value label, limit).
LIMITS = [("cx_limited", "cx_limited", "", LIMIT_GLOBAL)] + [
    (f"cx_limited_key customer={c}", "cx_limited_key", f"customer={c}", LIMIT_PER_KEY)
    for c in CUSTOMERS]
# One atomic read of every limit's live holds on the server's clock (the slot scripts prune
# holds whose expiry passed; a live one expires after now).
_SAMPLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for i, key in ipairs(KEYS) do
  out[#out + 1] = redis.call('ZRANGEBYSCORE', key, '(' .. now, '+inf')
end
return out
"""  # an exit 3 (Redis unreachable at start) this soon after a Redis kill


class ChaosRedis(RedisServer):
    """The chaos's redis-server: in a process group of its own, like every other process."""

    new_session = True


def wall_ms() -> int:
    return int(time.time() * 1000)


class Log:
    """The harness's own record of what it did, in memory and as JSON lines on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.submitted: list[h.Submitted] = []
        self.sent: list[h.Sent] = []
        self.answers: list[h.AnswerTry] = []
        self.cancels: list[h.Cancel] = []
        self.pauses: list[h.PauseTry] = []
        self.reruns: list[h.RerunTry] = []
        self.signals: list[h.SignalTry] = []
        self.orders: list[h.OrderSent] = []
        self.retries: list[h.RetryTry] = []
        self.limit_over: list[h.LimitSample] = []
        self.faults: list[h.Fault] = []
        self.crashes: list[h.Crash] = []
        self.notes: list[str] = []
        self._fh = path.open("a")

    def add(self, bucket: list[Any], item: Any) -> None:
        with self.lock:
            bucket.append(item)
            self._fh.write(json.dumps({"record": type(item).__name__,
                                       **dataclasses.asdict(item)}, default=str) + "\n")
            self._fh.flush()

    def load(self) -> None:
        """Read back a log written by an earlier harness (for --recheck)."""
        kinds: dict[str, tuple[type[Any], list[Any]]] = {
            "Submitted": (h.Submitted, self.submitted), "Sent": (h.Sent, self.sent),
            "AnswerTry": (h.AnswerTry, self.answers), "Cancel": (h.Cancel, self.cancels),
            "PauseTry": (h.PauseTry, self.pauses), "RerunTry": (h.RerunTry, self.reruns),
            "SignalTry": (h.SignalTry, self.signals), "OrderSent": (h.OrderSent, self.orders),
            "RetryTry": (h.RetryTry, self.retries),
            "LimitSample": (h.LimitSample, self.limit_over),
            "Fault": (h.Fault, self.faults), "Crash": (h.Crash, self.crashes)}
        for line in self.path.read_text().splitlines():
            entry = json.loads(line)
            record = entry.pop("record")
            if record == "note":
                self.notes.append(entry["text"])
                continue
            cls, bucket = kinds[record]
            if cls is h.Fault:
                entry["pids"] = tuple(entry["pids"])
            if cls is h.RerunTry:
                entry["copied"], entry["order"] = tuple(entry["copied"]), tuple(entry["order"])
            if cls is h.LimitSample:
                entry["holders"] = tuple(entry["holders"])
            bucket.append(cls(**entry))

    def note(self, text: str) -> None:
        with self.lock:
            self.notes.append(text)
            self._fh.write(json.dumps({"record": "note", "text": text}) + "\n")
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class Slot:
    """One supervised marbles-rq process (a controller or a worker) and its restarts."""

    def __init__(self, name: str, role: str, args: list[str], pool: int = 0) -> None:
        self.name, self.role, self.args, self.pool = name, role, args, pool
        self.proc: Proc | None = None
        self.starts = 0
        self.expect_exit = False  # we killed it: its exit is no crash
        self.stopped: list[tuple[int, int]] = []  # (pid, start ticks) a fault stopped
        self.cont_at = 0.0
        self.restart_at = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()


def _ticks(pid: int) -> int:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(raw[raw.rindex(")") + 2:].split()[19])


def _signal(pid: int, sig: int, ticks: int | None = None) -> bool:
    if ticks is not None and _ticks(pid) != ticks:
        return False  # gone, or the pid was reused
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Harness:
    def __init__(self, plan: Plan, workdir: Path, *, lease_ms: int = 2000,
                 interval_s: float = 0.2, quiesce_s: float = 180.0,
                 out: Callable[[str], None] = print, lanes: int = LANES) -> None:
        self.plan, self.dir = plan, workdir
        self.lanes = lanes
        self.lease_ms, self.interval_s, self.quiesce_s = lease_ms, interval_s, quiesce_s
        self.out = out
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = Log(self.dir / "harness.jsonl")
        # Encryption at rest, always on: every chaos process (and this one, which reads the
        # history) seals payloads under a key of this run's own, kept beside its data so a
        # recheck can open them.
        keyfile = self.dir / "marbles-keys"
        if not keyfile.exists():
            keyfile.write_text(f"{KEY_ID}:{base64.b64encode(os.urandom(32)).decode()}\n")
        self.keys = keyfile.read_text().strip()
        os.environ["MARBLES_KEYS"] = self.keys
        self.redis: RedisServer | None = None
        self.slots: list[Slot] = []
        self.stop = threading.Event()
        self.t0 = 0.0
        self.redis_killed_at = -1e9
        self.cli_pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="chaos-cli")
        self.rng = random.Random(plan.seed ^ 0x5EED)
        self.answered: set[tuple[str, str]] = set()
        self.waiters: list[threading.Thread] = []  # reruns and cancels waiting for their run
        self.pausers: dict[str, ThreadPoolExecutor] = {}  # run id -> its pause/resume caller
        # run id -> its signal sender: a run's signals go out one after the other, so the
        # order the run takes them in must be the order they were sent in
        self.signallers: dict[str, ThreadPoolExecutor] = {}
        self.stuck_after_s = 0.0
        self.aimed: set[str] = set()  # the cx:puts receipts a put_kill struck
        # label -> [samples, most live holds seen, limit]
        self.limit_counts: dict[str, list[int]] = {label: [0, 0, limit]
                                                   for label, _, _, limit in LIMITS}

    # -- processes --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        path = env.get("PYTHONPATH", "")
        env.update(MARBLES_REDIS_URL=self.url, MARBLES_SOURCE=SOURCE, PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(REPO_ROOT) + (os.pathsep + path if path else ""),
                   MARBLES_LANE_COUNT=str(self.lanes), MARBLES_KEYS=self.keys)
        return env

    def base_argv(self) -> list[str]:
        return [*_cli_argv(), "--redis-url", self.url, "--source", SOURCE]

    def reopen(self) -> None:
        """Restart the Redis of an earlier run (its AOF) and read back its harness log."""
        self.log.load()
        self._connect()

    def _connect(self) -> None:
        self.redis = ChaosRedis.start(dir=self.dir / "redis")
        self.runs = RunStore(open_store(self.url, lanes=self.lanes))
        self.rq = open_lanes(self.url, self.runs.keys)
        self.waits = WaitStore(self.runs)
        self.events = Events(self.runs, self.rq)
        self.client = Client(Settings(self.url, lanes=self.lanes))

    def start(self) -> None:
        self._connect()
        lease = ["--lease-ms", str(self.lease_ms)]
        self.slots = [
            Slot("c0", "controller", ["controller", *lease, "--interval", str(self.interval_s)]),
            Slot("c1", "controller", ["controller", *lease, "--interval", str(self.interval_s)]),
            Slot("w0", "worker", ["worker", *lease]),
            Slot("w1", "worker", ["worker", *lease]),
            Slot("w2", "worker", ["worker", *lease, "--pool", "3"], pool=3),
            # One process executing up to 4 runs at once (threads, async bodies on loops).
            Slot("w3", "worker", ["worker", *lease, "--concurrency", "4"]),
        ]
        for slot in self.slots:
            self._launch(slot)
        for slot in self.slots:
            assert slot.proc is not None
            if slot.role == "worker":
                slot.proc.wait_log("*** Listening on", count=slot.pool or 1, timeout=60)
        wait_until(lambda: self.leader_pid() is not None, 60, "a controller to lead")

    def _launch(self, slot: Slot) -> None:
        argv = [*self.base_argv(), *slot.args]
        slot.proc = Proc(slot.role, argv, self.dir / f"{slot.name}-{slot.starts}.log",
                         self.env())
        slot.starts += 1
        slot.expect_exit = False
        slot.stopped = []

    def supervise(self) -> None:
        """Restart every process that died (as a supervisor would); SIGCONT what is due."""
        now = NOW()
        if self.redis is not None and not self.redis.is_running():  # not killed by a fault
            code = self.redis._proc.poll() if self.redis._proc is not None else None
            self.log.add(self.log.crashes, h.Crash("redis-server", code or 0, "",
                                                   _tail(self.redis.logfile)))
            self.redis.restart()
            self.redis_killed_at = NOW()
        for slot in self.slots:
            if slot.stopped and now >= slot.cont_at:
                for pid, ticks in slot.stopped:
                    _signal(pid, signal.SIGCONT, ticks)
                slot.stopped = []
            if slot.proc is None or slot.alive():
                continue
            code = slot.proc.returncode
            if not slot.expect_exit:
                excuse = ""
                if code == 3 and NOW() - self.redis_killed_at < STARTUP_EXCUSE_S:
                    excuse = "Redis was down (exit 3: refused to start or stopped)"
                self.log.add(self.log.crashes, h.Crash(
                    f"{slot.name} ({slot.role}, pid {slot.pid})", code or 0, excuse,
                    "" if excuse else slot.proc.tail(30)))
                slot.expect_exit = True
                slot.restart_at = now + 0.5  # a supervisor's restart delay
            if now < slot.restart_at:
                continue
            slot.restart_at = 0.0
            self._launch(slot)

    def leader_pid(self) -> int | None:
        try:
            info = self.runs.store.lease_holder("controller")
        except (redis.RedisError, MarblesError, OSError):
            return None
        if info is None:
            return None
        pid = info.token.split(":")[1]
        return int(pid) if pid.isdigit() else None

    def busy_pids(self) -> set[int]:
        """Pids (from the worker names) of the processes executing a run now."""
        try:
            keys = self.runs.keys
            pipe = self.runs.client.pipeline(transaction=False)
            for bucket in range(keys.buckets):
                pipe.zrange(keys.run_leases(bucket), 0, -1)
            ids = [h._s(r) for part in pipe.execute() for r in part]
            pipe = self.runs.client.pipeline(transaction=False)
            for rid in ids:
                pipe.hget(keys.run(rid), "worker")
            out = set()
            for worker in pipe.execute():
                tail = h._s(worker).rsplit(".", 1)[-1] if worker else ""
                if tail.isdigit():
                    out.add(int(tail))
            return out
        except (redis.RedisError, MarblesError, OSError):
            return set()

    # -- faults ------------------------------------------------------------------------------

    def _workers(self, *, forking: bool | None = None) -> list[Slot]:
        return [s for s in self.slots if s.role == "worker" and s.alive() and not s.stopped
                and (forking is None or (s.pool == 0) == forking)]

    def _choose(self, fault: Fault, candidates: list[T], busy: list[T], first_try: float
                ) -> T | None:
        """A busy candidate if there is one (waiting up to TARGET_WAIT_S), else any."""
        pool = busy or (candidates if NOW() - first_try >= TARGET_WAIT_S else [])
        if not pool:
            return None
        return pool[fault.pick % len(pool)]

    def do_fault(self, fault: Fault, first_try: float) -> bool:
        """Strike `fault`; False to try again shortly (no target yet)."""
        kind = fault.kind
        if kind == "redis":
            return self._kill_redis(fault)
        if kind in ("leader", "stop_leader"):
            pid = self.leader_pid()
            slot = next((s for s in self.slots if s.pid == pid and s.alive()
                         and not s.stopped), None)
            if slot is None:
                return False
            if kind == "leader":
                self._kill(slot, [], fault, killpg=False)  # it executes no run
            else:
                self._stop(slot, [slot.pid], fault)
            return True
        busy = self.busy_pids()
        if kind == "horse":
            pairs = [(s, kids[0]) for s in self._workers(forking=True)
                     if len(kids := children(s.pid)) == 1]
            chosen = self._choose(fault, pairs, [p for p in pairs if p[0].pid in busy],
                                  first_try)
            if chosen is None:
                return False
            slot, horse = chosen
            if not _signal(horse, signal.SIGKILL):
                return False  # it ended between the look and the kill: look again
            self._record(fault, [slot.pid], f"{slot.name} horse {horse}")
            return True
        if kind == "pool_executor":
            pairs = [(s, kid) for s in self._workers(forking=False) for kid in children(s.pid)]
            chosen = self._choose(fault, pairs, [p for p in pairs if p[1] in busy], first_try)
            if chosen is None:
                return False
            slot, executor = chosen
            if not _signal(executor, signal.SIGKILL):
                return False  # it ended between the look and the kill: look again
            self._record(fault, [executor], f"{slot.name} executor {executor}")
            return True
        slots = self._workers()
        chosen_slot = self._choose(fault, slots, [s for s in slots if busy & {
            s.pid, *children(s.pid)}], first_try)
        if chosen_slot is None:
            return False
        tree = [chosen_slot.pid, *descendants(chosen_slot.pid)]
        if kind == "worker_parent":
            self._kill(chosen_slot, tree, fault, killpg=False)
        elif kind == "worker_group":
            self._kill(chosen_slot, tree, fault, killpg=True)
        elif kind == "stop_worker":
            self._stop(chosen_slot, tree, fault)
        else:
            raise ValueError(f"unknown fault kind {kind}")
        return True

    def _record(self, fault: Fault, pids: list[int], target: str) -> None:
        self.log.add(self.log.faults, h.Fault(fault.kind, wall_ms(), tuple(pids), target))

    def _kill(self, slot: Slot, pids: list[int], fault: Fault, *, killpg: bool) -> None:
        assert slot.proc is not None
        slot.expect_exit = True
        if killpg:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(slot.pid, signal.SIGKILL)
        else:
            _signal(slot.pid, signal.SIGKILL)
        self._record(fault, pids, f"{slot.name} pid {slot.pid}"
                     + (" (process group)" if killpg else ""))
        with contextlib.suppress(subprocess.TimeoutExpired):
            slot.proc.popen.wait(timeout=10)

    def _stop(self, slot: Slot, pids: list[int], fault: Fault) -> None:
        stopped = []
        for pid in pids:
            ticks = _ticks(pid)
            if ticks >= 0 and _signal(pid, signal.SIGSTOP, ticks):
                stopped.append((pid, ticks))
        slot.stopped = stopped
        slot.cont_at = NOW() + fault.hold_s
        self._record(fault, [p for p, _ in stopped],
                     f"{slot.name} pids {[p for p, _ in stopped]} for {fault.hold_s} s")

    def _kill_redis(self, fault: Fault) -> bool:
        assert self.redis is not None
        self.redis.kill9()
        self.redis_killed_at = NOW()
        self._record(fault, [], f"redis-server, down {fault.hold_s} s")
        time.sleep(fault.hold_s)
        self.redis.restart()  # same port, same dir: the data comes back from the AOF
        self.redis_killed_at = NOW()
        return True

    # -- the chaos phase ----------------------------------------------------------------------

    def run_chaos(self) -> None:
        """Submit the plan's runs and strike its faults; returns when both are done."""
        self.t0 = NOW()
        submitter = threading.Thread(target=self._submitter, name="chaos-submit", daemon=True)
        answerer = threading.Thread(target=self._answerer, name="chaos-answer", daemon=True)
        sampler = threading.Thread(target=self._sampler, name="chaos-sample", daemon=True)
        submitter.start()
        answerer.start()
        sampler.start()
        self._answerer_thread = answerer
        pending = list(self.plan.faults)
        first_try: dict[int, float] = {}
        last_report = NOW()
        while pending:
            now = NOW() - self.t0
            fault = pending[0]
            if now >= fault.at_s:
                started = first_try.setdefault(id(fault), NOW())
                if self.do_fault(fault, started):
                    pending.pop(0)
                elif NOW() - started > 30:
                    self.log.note(f"fault {fault} found no target in 30 s; skipped")
                    pending.pop(0)
            self.supervise()
            if NOW() - last_report >= 15:
                last_report = NOW()
                self.out(f"  t={now:5.1f} s  faults done {len(self.log.faults)}/"
                         f"{len(self.plan.faults)}  enqueues {len(self.log.submitted)}")
            time.sleep(0.05)
        while submitter.is_alive() or any(s.stopped for s in self.slots) \
                or any(t.is_alive() for t in self.waiters):
            self.supervise()
            time.sleep(0.05)
        self.supervise()

    def _submitter(self) -> None:
        for action in self.plan.actions:
            delay = self.t0 + action.at_s - NOW()
            if delay > 0 and self.stop.wait(delay):
                return
            if action.op in ("rerun", "cancel_spawning", "retry_patch", "lock_stop",
                             "put_kill") \
                    or action.ops == ("parked",):
                # they wait: a thread of their own
                thread = threading.Thread(target=self._guard, args=(action,), daemon=True,
                                          name=f"chaos-wait-{len(self.waiters)}")
                self.waiters.append(thread)
                thread.start()
            elif action.op == "pause":  # in order per run, without holding up the rest
                lane = self.pausers.get(action.runs[0].run_id)
                if lane is None:
                    lane = self.pausers[action.runs[0].run_id] = ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="chaos-pause")
                lane.submit(self._guard, action)
            elif action.op in ("signal", "signal_start"):
                lane = self.signallers.get(action.runs[0].run_id)
                if lane is None:
                    lane = self.signallers[action.runs[0].run_id] = ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="chaos-signal")
                lane.submit(self._guard, action)
            elif action.via in ("cli", "cli-kill", "thread"):
                self.cli_pool.submit(self._guard, action)
            else:
                self._guard(action)
        self.cli_pool.shutdown(wait=True)
        for lane in (*self.pausers.values(), *self.signallers.values()):
            lane.shutdown(wait=True)

    def _guard(self, action: Action) -> None:
        try:
            self._act(action)
        except Exception as exc:  # a harness bug must be seen, not kill the thread silently
            self.log.note(f"action {action.op} {[r.run_id for r in action.runs]} failed: "
                          f"{type(exc).__name__}: {exc}")

    def _retry(self, what: str, call: Callable[[], T],
               failed: Callable[[BaseException], None]) -> T | None:
        """Call until it does not meet a Redis outage; `failed` records each failure."""
        deadline = NOW() + RETRY_FOR_S
        while True:
            try:
                return call()
            except (redis.RedisError, MarblesError, OSError, CliRedisError) as exc:
                if isinstance(exc, MarblesError) and not _outage(exc):
                    raise
                failed(exc)
                if NOW() > deadline or self.stop.is_set():
                    self.log.note(f"{what}: gave up after {RETRY_FOR_S} s: {exc}")
                    return None
                time.sleep(0.2)

    def _act(self, action: Action) -> None:
        op = action.op
        if op in ("submit", "resend"):
            spec = action.runs[0]
            self._submit(spec.run_id, spec.workflow, spec.input, action.via, spec.priority,
                         spec.start_in_ms)
        elif op == "batch":
            self._batch(action)
        elif op == "send":
            self._send(action)
        elif op == "cancel":
            self._cancel(action.runs[0].run_id, action.via)
        elif op == "cancel_compensate":
            self._cancel(action.runs[0].run_id, action.via, compensate=True)
        elif op == "retry_patch":
            self._retry_patch(action)
        elif op == "lock_stop":
            self._lock_stop(action)
        elif op == "put_kill":
            self._put_kill(action)
        elif op == "cancel_spawning":
            run_id = action.runs[0].run_id
            if self._wait_for(run_id, "child_started"):
                time.sleep(action.pick / 1000)
                self._cancel(run_id, action.via)
            else:
                self.log.note(f"{run_id}: started no child in {WAIT_START_S} s; not cancelled")
        elif op == "pause":
            calls = [c for c in action.ops if c not in ("started", "hold")]
            if "started" in action.ops and not self._wait_for(action.runs[0].run_id,
                                                              "attempt_started"):
                self.log.note(f"{action.runs[0].run_id}: did not start in {WAIT_START_S} s")
            for call in (c for c in action.ops if c != "started"):
                if call == "hold":
                    self.stop.wait(HOLD_S)
                else:  # back to back: through the API (a CLI takes seconds)
                    self._pause(action.runs[0].run_id, call, cli=len(calls) == 1)
        elif op == "rerun":
            self._rerun(action)
        elif op in ("signal", "signal_start"):
            self._signal(action)
        elif op == "order":
            if action.ops == ("parked",):
                if self._wait_for(action.runs[0].run_id, "parked"):
                    self.stop.wait(action.pick_ms / 1000)
                else:
                    self.log.note(f"{action.runs[0].run_id}: did not park in "
                                  f"{WAIT_START_S} s")
            self._order(action)
        else:
            raise ValueError(op)

    def _submit(self, run_id: str, workflow: str, input: dict[str, Any], via: str,
                priority: int | None = None, start_in_ms: int = 0) -> None:
        def failed(exc: BaseException) -> None:
            self.log.add(self.log.submitted, h.Submitted(run_id, workflow, via, None, wall_ms()))

        def api() -> bool:
            return ops.enqueue(self.runs, self.rq, ops.RunRequest(
                workflow, json.dumps(input).encode(), run_id, priority=priority)).created

        def client() -> bool:
            start_at = None if not start_in_ms else time.time() + start_in_ms / 1000
            return bool(self.client.start(workflow, input, id=run_id, priority=priority,
                                          start_at=start_at).created)

        args: tuple[str, ...] = ("enqueue", workflow, "--input", json.dumps(input), "--id",
                                 run_id, "--json")
        if priority is not None:
            args += ("--priority", str(priority))

        def cli() -> bool:
            return bool(json.loads(self.cli(*args).stdout)["created"])

        if via == "cli-kill":
            done = self.killed_cli(args, run_id)
            created = None if done is None else bool(json.loads(done.stdout)["created"])
            self.log.add(self.log.submitted, h.Submitted(run_id, workflow, via, created,
                                                         wall_ms()))
            return
        call = {"cli": cli, "client": client, "later": client}.get(via, api)
        created = self._retry(f"enqueue {run_id}", call, failed)
        if created is not None:
            self.log.add(self.log.submitted, h.Submitted(run_id, workflow, via, created,
                                                         wall_ms()))

    def _batch(self, action: Action) -> None:
        requests = [ops.RunRequest(s.workflow, json.dumps(s.input).encode(), s.run_id)
                    for s in action.runs]

        def failed(exc: BaseException) -> None:
            for s in action.runs:
                self.log.add(self.log.submitted, h.Submitted(s.run_id, s.workflow, "batch",
                                                             None, wall_ms()))

        done = self._retry("batch", lambda: ops.enqueue_many(self.runs, self.rq, requests),
                           failed)
        for spec, result in zip(action.runs, done or [], strict=True):
            self.log.add(self.log.submitted, h.Submitted(spec.run_id, spec.workflow, "batch",
                                                         result.created, wall_ms()))

    def _send(self, action: Action) -> None:
        spec = action.runs[0]
        payload = json.dumps(spec.input)

        def failed(exc: BaseException) -> None:
            self.log.add(self.log.sent, h.Sent(action.event_id, spec.run_id, action.via, None,
                                               wall_ms()))

        def api() -> bool:
            return self.events.send(EVENT_SOURCE, action.event_id, type=EVENT_TYPE,
                                    payload=payload.encode()).created

        args = ("events", "send", EVENT_SOURCE, "--id", action.event_id, "--type", EVENT_TYPE,
                "--payload", payload, "--json")

        def cli() -> bool:
            return bool(json.loads(self.cli(*args).stdout)["created"])

        if action.via == "cli-kill":
            done = self.killed_cli(args, action.event_id)
            created = None if done is None else bool(json.loads(done.stdout)["created"])
            self.log.add(self.log.sent, h.Sent(action.event_id, spec.run_id, action.via,
                                               created, wall_ms()))
            return
        created = self._retry(f"send {action.event_id}", cli if action.via == "cli" else api,
                              failed)
        if created is not None:
            self.log.add(self.log.sent, h.Sent(action.event_id, spec.run_id, action.via,
                                               created, wall_ms()))

    def _order(self, action: Action) -> None:
        """Send a cx_publish_wait run's matching event (pick 0) or a decoy (a source with
        no trigger: the event starts no run, it is only offered to the waits it matches)."""
        spec, event_id, via = action.runs[0], action.event_id, action.via
        type, payload = order_event(spec.run_id, action.pick)
        body = json.dumps(payload)
        log = self.log

        def record(created: bool | None) -> None:
            log.add(log.orders, h.OrderSent(event_id, spec.run_id, type, payload,
                                            action.pick != 0, via, created, wall_ms()))

        def api() -> bool:
            return self.events.send(ORDER_SOURCE, event_id, type=type,
                                    payload=body.encode()).created

        def cli() -> bool:
            return bool(json.loads(self.cli("events", "send", ORDER_SOURCE, "--id", event_id,
                                            "--type", type, "--payload", body,
                                            "--json").stdout)["created"])

        created = self._retry(f"send {event_id}", cli if via == "cli" else api,
                              lambda exc: record(None))
        if created is not None:
            record(created)

    def _signal(self, action: Action) -> None:
        """Send the run's `pick`-th signal (or, signal_start, start the run with it), with a
        request id of its own: a retry after an outage whose reply was lost records nothing
        twice. A signal to a run whose enqueue has not landed yet waits for it."""
        spec, index, via = action.runs[0], action.pick, action.via
        start = action.op == "signal_start"
        payload = json.dumps({"run": spec.run_id, "i": index})
        request_id = f"{spec.run_id}-s{index}"
        log = self.log

        def failed(exc: BaseException) -> None:
            log.add(log.signals, h.SignalTry(spec.run_id, index, via, f"error: {exc}", 0,
                                             wall_ms()))
            if start:
                log.add(log.submitted, h.Submitted(spec.run_id, spec.workflow, "signal_start",
                                                   None, wall_ms()))

        def api() -> tuple[str, int]:
            if start:
                started = start_with_signal(
                    self.runs, self.rq, ops.RunRequest(spec.workflow,
                                                       json.dumps(spec.input).encode(),
                                                       spec.run_id),
                    SIGNAL_NAME, payload_json=payload.encode(), request_id=request_id)
                return ("created" if started.created else "exists"), started.seq
            sent = send_signal(self.runs, spec.run_id, SIGNAL_NAME,
                               payload_json=payload.encode(), rq=self.rq,
                               request_id=request_id)
            return "ok", sent.seq

        def cli() -> tuple[str, int]:
            args: tuple[str, ...] = ("signal", spec.run_id, SIGNAL_NAME)
            if start:
                args = ("signal", "--start", spec.workflow, "--id", spec.run_id, "--input",
                        json.dumps(spec.input), SIGNAL_NAME)
            reply = json.loads(self.cli(*args, "--payload", payload, "--request-id",
                                        request_id, "--json").stdout)
            return ("ok" if not start else "created" if reply["created"] else "exists",
                    int(reply["seq"]))

        deadline = NOW() + WAIT_START_S
        while True:
            try:
                got = self._retry(f"signal {request_id}", cli if via == "cli" else api, failed)
            except (RunNotFoundError, CliFailed) as exc:
                missing = isinstance(exc, RunNotFoundError) or (
                    isinstance(exc, CliFailed) and exc.code == 2 and "no run" in str(exc))
                if missing and NOW() < deadline and not self.stop.is_set():
                    time.sleep(0.2)  # its enqueue has not landed yet
                    continue
                log.add(log.signals, h.SignalTry(spec.run_id, index, via, f"refused: {exc}",
                                                 0, wall_ms()))
                return
            except MarblesError as exc:  # e.g. RunSettledError
                log.add(log.signals, h.SignalTry(spec.run_id, index, via, f"refused: {exc}",
                                                 0, wall_ms()))
                return
            break
        if got is None:
            return
        outcome, seq = got
        log.add(log.signals, h.SignalTry(spec.run_id, index, via, outcome, seq, wall_ms()))
        if start:
            log.add(log.submitted, h.Submitted(spec.run_id, spec.workflow, "signal_start",
                                               outcome == "created", wall_ms()))

    def _cancel(self, run_id: str, via: str, *, compensate: bool = False) -> None:
        def failed(exc: BaseException) -> None:
            self.log.add(self.log.cancels, h.Cancel(run_id, via, f"error: {exc}", wall_ms()))

        def api() -> str:
            if compensate:  # a woken delivery: the controller dispatches it after its grace
                return self.runs.cancel_compensate(run_id)[0]
            return self.runs.cancel(run_id)

        def cli() -> str:
            if compensate:
                return self.cli("cancel", run_id, "--compensate").stdout.strip()
            return self.cli("cancel", run_id).stdout.strip()

        outcome = self._retry(f"cancel {run_id}", cli if via == "cli" else api, failed)
        if outcome is not None:
            self.log.add(self.log.cancels, h.Cancel(run_id, via, outcome, wall_ms()))

    def _retry_patch(self, action: Action) -> None:
        """Once a cx_retry run has paused on its step (its tries ran out), retry the step
        with RETRY_PATCH; a retry whose reply an outage lost is not repeated blindly: the
        next call is refused (not paused on a failed step) and logged so."""
        run_id, via, log = action.runs[0].run_id, action.via, self.log
        patch = dict(RETRY_PATCH)
        if not self._wait_failed_step(run_id):
            log.add(log.retries, h.RetryTry(run_id, patch, via, f"gave_up: not paused on "
                                            f"its step in {RETRY_WAIT_S} s", wall_ms()))
            return

        def api() -> str:
            try:
                return self.client.retry(run_id, input_patch=patch).outcome
            except NotFailedStepError:
                return "not_failed_step"

        def cli() -> str:
            done = self.cli("retry", run_id, "--input-patch", json.dumps(patch), ok=(0, 2))
            return "retried" if done.returncode == 0 else "not_failed_step"

        outcome = self._retry(f"retry {run_id}", cli if via == "cli" else api,
                              lambda exc: log.add(log.retries, h.RetryTry(
                                  run_id, patch, via, f"error: {exc}", wall_ms())))
        if outcome is not None:
            log.add(log.retries, h.RetryTry(run_id, patch, via, outcome, wall_ms()))

    def _lock_stop(self, action: Action) -> None:
        """Wait for an execution inside cx_lock's critical section (an entry receipt that
        held the lock, with no exit yet), then SIGSTOP its worker's processes for pick_ms:
        its hold lapses while it sleeps. Logged as a stop_worker fault; noted if no
        execution entered the section in time."""
        deadline = self._aimed_deadline()
        while NOW() < deadline and not self.stop.is_set():
            try:
                receipts, _, _ = h.read_locks(self.runs.client)
            except (redis.RedisError, OSError):
                receipts = []
            left = {r.x for r in receipts if r.op == "exit"}
            inside = [r for r in receipts if r.op == "enter" and r.valid and r.x not in left]
            for entry in reversed(inside):
                slot = next((s for s in self._workers() if entry.pid == s.pid
                             or entry.pid in descendants(s.pid)), None)
                if slot is None:
                    continue
                fault = Fault(0.0, "stop_worker", 0, action.pick_ms / 1000)
                self._stop(slot, [slot.pid, *descendants(slot.pid)], fault)
                self.log.note(f"stopped {slot.name} inside the critical section of "
                              f"{entry.run} (epoch {entry.epoch}) for {fault.hold_s} s")
                return
            time.sleep(0.05)
        self.log.note(f"lock_stop #{action.pick}: no execution inside the critical section "
                      f"before the chaos phase's end")

    def _put_kill(self, action: Action) -> None:
        """Wait for a cx_put step that has put its version and not returned (its receipt in
        cx:puts, written after this action began; one whose compare-and-set met a conflict
        first if one comes in the first half of the wait), then SIGKILL what executes it:
        a horse or a pool executor alone, a --concurrency worker with its group. Logged as
        a fault of that kind; noted if none came in time."""
        since, start, deadline = wall_ms(), NOW(), self._aimed_deadline()
        seen: set[str] = set()
        while NOW() < deadline and not self.stop.is_set():
            try:
                rows = [json.loads(r) for r in self.runs.client.lrange(PUTS_KEY, 0, -1)]
            except (redis.RedisError, OSError):
                rows = []
            fresh = [r for r in rows if r["t"] >= since and r["x"] not in seen]
            seen.update(r["x"] for r in fresh)
            picky = NOW() < (start + deadline) / 2
            for put in reversed(fresh):
                if (picky and not put["conflicts"]) or put["x"] in self.aimed:
                    continue
                self.aimed.add(put["x"])  # one kill per put, whichever waiter sees it first
                if self._kill_pid(int(put["pid"]), f"inside cx_put of {put['run']} after its "
                                  f"put of version {put['version']} (conflicts "
                                  f"{put['conflicts']})"):
                    return
            time.sleep(0.05)
        self.log.note(f"put_kill #{action.pick}: no cx_put step to kill before the chaos "
                      f"phase's end")

    def _aimed_deadline(self) -> float:
        """An aimed fault (lock_stop, put_kill) waits for its moment until the plan's last
        faults at most, so it never makes the chaos phase longer."""
        return min(NOW() + WAIT_START_S, self.t0 + self.plan.duration_s)

    def _kill_pid(self, pid: int, why: str) -> bool:
        """SIGKILL the process executing a step: a horse or a pool executor alone, a worker
        that executes in its own process with its group. False if it is gone."""
        for slot in self._workers():
            if pid == slot.pid:
                self._kill(slot, [slot.pid, *descendants(slot.pid)],
                           Fault(0.0, "worker_group", 0), killpg=True)
            elif pid in children(slot.pid):
                if not _signal(pid, signal.SIGKILL):
                    return False
                kind = "horse" if slot.pool == 0 else "pool_executor"
                self._record(Fault(0.0, kind, 0), [slot.pid if kind == "horse" else pid],
                             f"{slot.name} {kind} {pid}")
            else:
                continue
            self.log.note(f"killed {slot.name} ({pid}) {why}")
            return True
        return False

    def _wait_failed_step(self, run_id: str) -> bool:
        """Wait until the run's journal says it parked on a failed step."""
        deadline = NOW() + RETRY_WAIT_S
        key = self.runs.keys.run_keys(run_id).output
        while NOW() < deadline and not self.stop.is_set():
            try:
                rows = self.runs.client.xrange(key, "-", "+")
            except (redis.RedisError, OSError):
                rows = []
            if any(e.type == "parked" and e.data.get("reason") == "failed_step"
                   for e in h._events(list(rows or []))):
                return True
            time.sleep(0.1)
        return False

    def _wait_for(self, run_id: str, entry: str) -> bool:
        """Wait until the run's journal has an entry of this type (or the run finished)."""
        deadline = NOW() + WAIT_START_S
        key = self.runs.keys.run_keys(run_id).output
        while NOW() < deadline and not self.stop.is_set():
            try:
                rows = self.runs.client.xrange(key, "-", "+")
                status = self.runs.client.hget(self.runs.keys.run(run_id), "status")
            except (redis.RedisError, OSError):
                rows, status = [], None
            if any(h._s(f.get(b"t", b"")) == entry for _, f in rows) \
                    or h._s(status or b"") in TERMINAL:
                return True
            time.sleep(0.05)
        return False

    def _pause(self, run_id: str, call: str, *, cli: bool) -> None:
        """One pause or resume of `run_id`; its outcome is logged in call order (a run's
        calls are made one after the other, by a thread of its own, so the log orders
        them)."""
        via = "cli" if cli and _hash(run_id, "pause-via") % 10 == 0 else "api"

        def failed(exc: BaseException) -> None:
            self.log.add(self.log.pauses, h.PauseTry(run_id, call, via, f"error: {exc}",
                                                     wall_ms()))

        def api() -> str:
            try:
                if call == "pause":
                    return self.waits.pause(run_id)
                outcome, attempt, queue = self.waits.resume(run_id)
            except NotPausedError:
                return "not_paused"
            except RunNotFoundError:
                return "missing"  # not recorded yet: the enqueue comes later
            if outcome == "woken":
                with contextlib.suppress(redis.RedisError):
                    self.rq.enqueue(queue, run_id, attempt)
            return outcome

        def by_cli() -> str:
            done = self.cli(call, run_id, ok=(0, 1, 2))
            text = (done.stdout + done.stderr).strip()
            return f"exit {done.returncode}: {text[:80]}"

        outcome = self._retry(f"{call} {run_id}", by_cli if via == "cli" else api, failed)
        if outcome is not None:
            self.log.add(self.log.pauses, h.PauseTry(run_id, call, via, outcome, wall_ms()))

    def _rerun(self, action: Action) -> None:
        """Wait for the source run to finish, then rerun it from one of its steps, chosen
        by the action's draw among its steps in the order they were committed (the order of
        their `step_succeeded` entries in its journal: the server's order)."""
        source, target = action.runs[0].run_id, action.runs[1].run_id
        deadline = NOW() + RERUN_WAIT_S
        order: list[str] = []
        while not self.stop.is_set():
            try:
                found = h.read_runs(self.runs, [source]).get(source)
            except (redis.RedisError, MarblesError, OSError):
                found = None
            if found is not None and found.status in TERMINAL:
                order = [str(e.data.get("step")) for e in found.events
                         if e.type == "step_succeeded"
                         and not str(e.data.get("step", "|")).rsplit(".", 1)[-1].startswith("|")]
                break
            if NOW() > deadline:
                self.log.note(f"rerun of {source}: it did not finish in {RERUN_WAIT_S} s")
                return
            time.sleep(0.3)
        if not order:
            self.log.note(f"rerun of {source}: no step committed (or the harness stopped)")
            return
        path = order[action.pick % len(order)]

        def failed(exc: BaseException) -> None:
            self.log.add(self.log.reruns, h.RerunTry(source, target, path, action.via,
                                                     f"error: {exc}", (), tuple(order),
                                                     wall_ms()))

        def api() -> tuple[bool, list[str]]:
            done = rerun(self.runs, self.rq, source, from_step=path, new_id=target)
            return done.created, list(done.copied)

        def cli() -> tuple[bool, list[str]]:
            reply = json.loads(self.cli("rerun", source, "--from-step", path, "--id", target,
                                        "--json").stdout)
            return bool(reply["created"]), list(reply["copied_steps"])

        outcome = self._retry(f"rerun {source}", cli if action.via == "cli" else api, failed)
        if outcome is not None:
            created, copied = outcome
            self.log.add(self.log.reruns, h.RerunTry(
                source, target, path, action.via, "created" if created else "exists",
                tuple(copied), tuple(order), wall_ms()))

    # -- sampling the concurrency limits --------------------------------------------------------

    def _sampler(self) -> None:
        keys = [self.runs.keys.limit_slots(limit_id(workflow, value))
                for _, workflow, value, _ in LIMITS]
        while not self.stop.is_set():
            try:
                reply = self.runs.client.eval(_SAMPLE, len(keys), *keys)
            except (redis.RedisError, OSError):
                reply = None
            if reply:
                now = int(reply[0])
                for (label, _, _, limit), holders in zip(LIMITS, reply[1:], strict=True):
                    held = [h._s(x) for x in holders]
                    counts = self.limit_counts[label]
                    counts[0] += 1
                    counts[1] = max(counts[1], len(held))
                    if len(held) > limit:
                        self.log.add(self.log.limit_over, h.LimitSample(
                            now, label, limit, len(held), tuple(sorted(held))))
            self.stop.wait(SAMPLE_EVERY_S)

    def cli(self, *args: str, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        """One ``marbles-rq`` command; exit 3 (Redis unreachable) raises CliRedisError."""
        argv = [*self.base_argv(), *args]
        done = subprocess.run(argv, cwd=REPO_ROOT, env=self.env(), capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        with (self.dir / "cli.log").open("a") as fh:
            fh.write(f"$ {' '.join(args)} -> exit {done.returncode}\n{done.stdout}{done.stderr}")
        if done.returncode == 3:
            raise CliRedisError(done.stderr.strip())
        if done.returncode not in ok:
            raise CliFailed(done.returncode, done.stderr.strip())
        return done

    def killed_cli(self, args: tuple[str, ...], ident: str
                   ) -> subprocess.CompletedProcess[str] | None:
        """Start one ``marbles-rq`` command and SIGKILL it at a seeded moment while it works
        (it takes about as long to start): None if it was killed, else what it printed."""
        delay = 0.3 + (_hash(ident, "kill") % 900) / 1000
        argv = [*self.base_argv(), *args]
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        try:
            out, err = proc.communicate(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            with (self.dir / "cli.log").open("a") as fh:
                fh.write(f"$ {' '.join(args)} -> SIGKILLed after {delay:.3f} s\n")
            return None
        with (self.dir / "cli.log").open("a") as fh:
            fh.write(f"$ {' '.join(args)} -> exit {proc.returncode} (before its kill)\n"
                     f"{out}{err}")
        if proc.returncode != 0:
            return None  # e.g. Redis was down: the second send or enqueue settles it
        return subprocess.CompletedProcess(argv, 0, out, err)

    # -- answering questions ------------------------------------------------------------------

    def _answerer(self) -> None:
        first_seen: dict[tuple[str, str], float] = {}
        while not self.stop.is_set():
            try:
                questions = self.waits.feed(limit=1000)
            except (redis.RedisError, MarblesError, OSError):
                questions = []
            for q in questions:
                ident = (q.run_id, q.key)
                if ident in self.answered:
                    continue
                seen = first_seen.setdefault(ident, NOW())
                if NOW() - seen < _delay(q.run_id):
                    continue
                self.answered.add(ident)
                try:
                    self._answer(q.run_id, q.key, q.record.ask)
                except Exception as exc:
                    self.log.note(f"answering {ident} failed: {type(exc).__name__}: {exc}")
            self.stop.wait(0.2)

    def _answer(self, run_id: str, key: str, kind: str) -> None:
        via = "cli" if _hash(run_id, "via") % 5 == 0 else "api"
        value = _answer_value(run_id, kind)
        self._answer_once(run_id, key, kind, value, via)
        if _hash(run_id, "dup") % 2 == 0:  # a second answer: it must be refused
            self._answer_once(run_id, key, kind, _answer_value(run_id, kind, other=True), "api")

    def _answer_once(self, run_id: str, key: str, kind: str, value: Any, via: str) -> None:
        def failed(exc: BaseException) -> None:
            self.log.add(self.log.answers, h.AnswerTry(run_id, key, value, via, "error",
                                                       wall_ms()))

        def api() -> str:
            try:
                done = self.waits.answer(run_id, key, value, kind=kind)
            except AlreadyAnsweredError:
                return "refused"
            if done.woken_attempt:
                with contextlib.suppress(redis.RedisError):
                    self.rq.enqueue(done.queue, run_id, done.woken_attempt)
            return "accepted"

        def cli() -> str:
            if kind == "question":
                args = ["answer", run_id, key, str(COLOURS.index(value) + 1)]  # by number
            else:
                args = ["approve" if value["approved"] else "reject", run_id, key,
                        "--note", value["note"]]
            done = self.cli(*args, ok=(0, 1))
            return "accepted" if done.returncode == 0 else "refused"

        outcome = self._retry(f"answer {run_id} {key}", cli if via == "cli" else api, failed)
        if outcome is not None:
            self.log.add(self.log.answers, h.AnswerTry(run_id, key, value, via, outcome,
                                                       wall_ms()))

    # -- quiescence ----------------------------------------------------------------------------

    def pause_schedules(self) -> None:
        for key in SCHEDULES:
            self._retry(f"pause {key}", lambda key=key: self.cli("schedules", "pause", key),
                        lambda exc: None)

    def quiesce(self) -> bool:
        """Wait until every run is terminal, no event is pending, and nothing new appears
        for a few seconds. False if the deadline passed first."""
        start = NOW()
        deadline = start + self.quiesce_s
        last_count, stable_since = -1, NOW()
        while NOW() < deadline:
            self.supervise()
            state = self._open_work()
            if state is not None:
                count, open_ = state
                if count != last_count or open_:
                    last_count, stable_since = count, NOW()
                elif NOW() - stable_since >= 3.0:
                    self.stuck_after_s = NOW() - start
                    return True
            time.sleep(0.5)
        self.stuck_after_s = NOW() - start
        return False

    def _open_work(self) -> tuple[int, int] | None:
        """(runs in the store, runs and events not finished), or None if Redis is away."""
        try:
            ids = h.all_run_ids(self.runs)
            pipe = self.runs.client.pipeline(transaction=False)
            for rid in ids:
                pipe.hget(self.runs.keys.run(rid), "status")
            statuses = pipe.execute()
            open_runs = sum(1 for s in statuses if h._s(s or b"") not in TERMINAL)
            keys = self.runs.keys
            pipe = self.runs.client.pipeline(transaction=False)
            for bucket in range(keys.buckets):
                pipe.zcard(keys.event_pending(bucket))
                pipe.zcard(keys.occurrences_open(bucket))
            pending = sum(int(n) for n in pipe.execute())
            accepted = {s.run for s in self.log.submitted if s.created is not None}
            missing = len(accepted - set(ids))
            return len(ids), open_runs + pending + missing
        except (redis.RedisError, MarblesError, OSError):
            return None

    # -- the history ---------------------------------------------------------------------------

    def collect(self) -> h.History:
        ids = h.all_run_ids(self.runs)
        executions, claims, applied = h.read_receipts(self.runs.client)
        events = json.loads(self.cli("events", "--json", "--limit", "10000").stdout)
        schedules = json.loads(self.cli("schedules", "--json").stdout)
        locks = h.read_locks(self.runs.client)
        return h.History(
            runs=h.read_runs(self.runs, ids), executions=executions, claims=claims,
            applied=applied, submitted=list(self.log.submitted), sent=list(self.log.sent),
            answers=list(self.log.answers), cancels=list(self.log.cancels),
            pauses=list(self.log.pauses), reruns=list(self.log.reruns),
            signals=list(self.log.signals), orders=list(self.log.orders),
            retries=list(self.log.retries), retry_tries=h.read_retry_tries(self.runs.client),
            sessions=self._sessions(), artifacts=self._artifacts(),
            lock_receipts=locks[0], lock_counter=locks[1], lock_done=locks[2],
            limit_counts={k: (v[0], v[1], v[2]) for k, v in self.limit_counts.items()},
            limit_over=list(self.log.limit_over),
            faults=list(self.log.faults), crashes=list(self.log.crashes),
            event_journal=events, schedules=schedules,
            schedule_every_ms={k: every for k, (_, every) in SCHEDULES.items()},
            schedule_workflows={wf: k for k, (wf, _) in SCHEDULES.items()},
            stuck_after_s=self.stuck_after_s)

    def _sessions(self) -> dict[str, list[Any] | None]:
        """cx_session's sessions (each run's own: its id is the run's) and the shared one,
        read back through the client (the codec decodes them): id -> its messages in order
        (None: missing or unreadable, noted)."""
        ids = [rid for rid, wf in self._submitted_workflows().items() if wf == "cx_session"]
        out: dict[str, list[Any] | None] = {}
        for sid in [SESSION_SHARED, *sorted(ids)]:
            try:
                messages = self.client.session_messages(sid)
            except MarblesError as exc:
                self.log.note(f"session {sid}: {type(exc).__name__}: {exc}")
                out[sid] = None
                continue
            positions = [m.position for m in messages]
            if positions != list(range(1, len(positions) + 1)):
                self.log.note(f"session {sid}: positions {positions}")
            out[sid] = [m.data for m in messages]
        return out

    def _artifacts(self) -> dict[str, list[h.ArtifactVersion]]:
        """cx_artifact's artifacts read back through the client: every version's content."""
        out: dict[str, list[h.ArtifactVersion]] = {}
        for name in (ARTIFACT_PLAIN, ARTIFACT_CAS):
            try:
                handle = self.client.artifact(name)
                out[name] = [h.ArtifactVersion(v.version, handle.get(v.version), v.run or "")
                             for v in handle.versions()]
            except MarblesError as exc:
                self.log.note(f"artifact {name}: {type(exc).__name__}: {exc}")
        return out

    def _submitted_workflows(self) -> dict[str, str]:
        return {s.run: s.workflow for s in self.log.submitted}

    def shutdown(self) -> None:
        self.stop.set()
        self.cli_pool.shutdown(wait=False, cancel_futures=True)
        for lane in (*self.pausers.values(), *self.signallers.values()):
            lane.shutdown(wait=False, cancel_futures=True)
        procs = [s.proc for s in self.slots if s.proc is not None]
        for slot in self.slots:
            slot.expect_exit = True
            for pid, ticks in slot.stopped:
                _signal(pid, signal.SIGCONT, ticks)
        stop_procs(procs, grace=5.0)
        if self.redis is not None:
            self.redis.stop()
        self.log.close()

    def restarts(self) -> dict[str, int]:
        return {s.name: s.starts - 1 for s in self.slots}


class CliRedisError(Exception):
    """A marbles-rq command exited 3: Redis unreachable or refusing."""


class CliFailed(Exception):
    def __init__(self, code: int, stderr: str) -> None:
        super().__init__(f"exit {code}: {stderr}")
        self.code = code


def _outage(exc: BaseException) -> bool:
    from marbles_rq.errors import RedisUnavailableError

    return isinstance(exc, RedisUnavailableError)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _hash(run_id: str, salt: str) -> int:
    return zlib.crc32(f"{salt}:{run_id}".encode())


def _delay(run_id: str) -> float:
    """How long the harness waits before answering a question: 0.2 to 2 s, per run."""
    return 0.2 + (_hash(run_id, "delay") % 1800) / 1000


def _answer_value(run_id: str, kind: str, *, other: bool = False) -> Any:
    n = _hash(run_id, "answer") + (1 if other else 0)
    if kind == "question":
        return COLOURS[n % len(COLOURS)]
    approved = n % 4 != 0
    return {"approved": approved, "note": f"note {n % 1000}" + (" (second)" if other else "")}


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = NOW() + timeout
    while NOW() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")

