"""Benchmark (not a test): redelivery after kill -9 of a worker, at default settings.

Run from the repo root::

    python -m bench.redelivery [--kills 20] [--baseline /path/to/another/checkout]

For each side (this checkout, and with ``--baseline`` another one, e.g. the main branch
before a change) it starts a durable ``redis-server`` (``ops/redis.conf``), one
``marbles-rq controller`` and two forking ``marbles-rq worker``s with no flags (the
defaults: lease 10 s, controller interval 0.5 s), all from that side's checkout
(``python -m marbles_rq``, ``PYTHONPATH`` = the checkout), and enqueues one ``sleeper`` run
(``bench/runs_flows.py``: steps of 0.25 s sleep). Then, alternating between the sides so
both see the same machine load, ``--kills`` times: 0.3-1.0 s after the run's attempt
started, kill -9 the worker running it (the worker process only, as ``kill -9 <pid>``; its
horse dies with it), start a replacement worker (as a supervisor would), and time from the
server clock just before the kill to the next ``attempt_started`` (its output-stream id).

Prints every kill (with the redelivery's reason: ``worker lost`` is the liveness path,
``lease expired`` the lease), p50/p90/p99/max per side and whether p99 <= 5 s. Then, on this
checkout, the steady cost of keeping a run alive: the script calls per second Redis serves
while one run sits in a 12 s step (lease renewals, worker beats, the controller's lease).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis

from marbles_rq.engine.runs import OutputEvent, RunStore
from marbles_rq.store import open_store
from tests.redis_procs import DEFAULT_CONF, RedisServer

from .runs_util import alive, descendants, load_line, pct, server_stats, table

REPO_ROOT = Path(__file__).resolve().parent.parent
FLOWS = "bench/runs_flows.py"
AIM_P99_S = 5.0


class BenchError(RuntimeError):
    pass


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class Sample:
    total_ms: int
    reason: str
    lease_left_ms: int | None


@dataclass
class Side:
    """One checkout: its own Redis, controller and workers, and one long run."""

    label: str
    tree: Path
    tmp: Path
    server: RedisServer
    procs: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    run_id: str = ""
    attempt: int = 1
    samples: list[Sample] = field(default_factory=list)
    after: str = "0-0"

    @classmethod
    def start(cls, label: str, tree: Path, tmp: Path) -> Side:
        tmp.mkdir(parents=True)
        server = RedisServer.start(dir=tmp / "redis", conf=DEFAULT_CONF)
        side = cls(label, tree, tmp, server)
        side.r = redis.Redis.from_url(server.url)
        side.runs = RunStore(open_store(server.url))
        return side

    r: redis.Redis = field(init=False)
    runs: RunStore = field(init=False)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
        env.update(PYTHONPATH=str(self.tree), PYTHONUNBUFFERED="1",
                   MARBLES_REDIS_URL=self.server.url)
        return env

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "marbles_rq", "--source", FLOWS, *args]

    def spawn(self, name: str, *args: str) -> Proc:
        log = self.tmp / f"{len(self.procs):03d}-{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(self.argv(*args), cwd=self.tree, env=self.env(),
                                     stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def worker(self) -> Proc:
        proc = self.spawn("worker", "worker", "--log-level", "WARNING")  # default lease
        self.workers.append(proc)
        return proc

    def wait_registered(self, proc: Proc, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(m.endswith(f".{proc.pid}".encode()) for m in self.r.smembers("rq:workers")):
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{self.label}: worker {proc.pid} did not register\n"
                                 f"{proc.tail()}")
            time.sleep(0.05)

    def begin(self, workflow: str = "sleeper", input: dict[str, Any] | None = None) -> None:
        self.spawn("controller", "controller", "--log-level", "WARNING")  # defaults
        for proc in (self.worker(), self.worker()):
            self.wait_registered(proc)
        self.run_id = f"redeliver-{self.label}"
        done = subprocess.run(
            self.argv("enqueue", workflow, "--input", msgspec.json.encode(
                input or {"steps": 100_000, "nap_s": 0.25}).decode(), "--id", self.run_id),
            cwd=self.tree, env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise BenchError(f"{self.label}: enqueue failed: {done.stderr}")

    def server_ms(self) -> int:
        secs, micros = self.r.time()
        return int(secs) * 1000 + int(micros) // 1000

    def wait_event(self, match: Any, timeout: float) -> OutputEvent:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.runs.output(self.run_id, after=self.after, block_ms=200):
                self.after = ev.id
                if match(ev):
                    return ev
        view = self.runs.get(self.run_id)
        raise BenchError(f"{self.label}: run {self.run_id}: nothing matched in {timeout:.0f} s; "
                         f"status {view and view.status}, attempt {view and view.attempt}, "
                         f"worker {view and view.worker}\n" + "\n".join(
                             f"--- {p.name} {p.pid}\n{p.tail()}" for p in self.procs))

    def kill_once(self) -> Sample:
        attempt = self.attempt
        if attempt == 1:  # later attempts' starts were awaited by the previous kill
            self.wait_event(lambda e: e.type == "attempt_started" and e.attempt == attempt, 90)
        time.sleep(random.uniform(0.3, 1.0))  # land the kill at a random point of a step
        keys = self.runs.keys.run_keys(self.run_id)
        name = self.r.hget(keys.run, "worker")
        pid = int(name.decode().rsplit(".", 1)[1]) if name else -1
        victim = next((w for w in self.workers if w.pid == pid), None)
        if victim is None:
            raise BenchError(f"{self.label}: the run is on {name!r}, not one of our workers")
        pipe = self.r.pipeline(transaction=False)
        pipe.time()
        pipe.zscore(keys.leases, self.run_id)
        (secs, micros), lease = pipe.execute()
        kill_ms = int(secs) * 1000 + int(micros) // 1000
        horses = descendants(pid)
        os.kill(pid, signal.SIGKILL)  # the worker only; its horse dies with it (PDEATHSIG)
        victim.popen.wait(timeout=10)
        for horse in horses:  # a stray horse would be a bug; never leave one running
            with contextlib.suppress(OSError):
                os.kill(horse, signal.SIGKILL)
        self.workers.remove(victim)
        replacement = self.worker()
        redelivered = self.wait_event(lambda e: e.type == "redelivered", 90)
        started = self.wait_event(
            lambda e: e.type == "attempt_started" and e.attempt == attempt + 1, 90)
        self.attempt = attempt + 1
        self.wait_registered(replacement)
        sample = Sample(started.at_ms - kill_ms, str(redelivered.data.get("reason")),
                        None if lease is None else int(lease) - kill_ms)
        self.samples.append(sample)
        return sample

    def stop(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            for pid in (proc.pid, *descendants(proc.pid)):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=5)
        self.server.stop()

    def strays(self) -> list[int]:
        return [p.pid for p in self.procs if alive(p.pid)]


def row(side: Side) -> list[Any]:
    totals = [s.total_ms / 1000 for s in side.samples]
    reasons: dict[str, int] = {}
    for s in side.samples:
        reasons[s.reason] = reasons.get(s.reason, 0) + 1
    p99 = pct(totals, 99)
    return [side.label, len(totals), f"{pct(totals, 50):.2f}", f"{pct(totals, 90):.2f}",
            f"{p99:.2f}", f"{max(totals):.2f}",
            ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
            "yes" if p99 <= AIM_P99_S else "NO"]


def steady_cost(side: Side, seconds: float = 8.0) -> None:
    """Script calls per second while one run sits inside one long step, one worker."""
    side.begin("sleeper", {"steps": 1, "nap_s": 12.0})
    side.wait_event(lambda e: e.type == "attempt_started", 60)
    time.sleep(1.0)
    s0, t0 = server_stats(side.r), time.monotonic()
    time.sleep(seconds)
    delta, elapsed = server_stats(side.r).minus(s0), time.monotonic() - t0
    evals = delta.calls.get("evalsha", 0) + delta.calls.get("eval", 0)
    say(f"  {side.label:8}: {evals / elapsed:.2f} script calls/s while one run sits in a 12 s "
        f"step, with {len(side.workers)} workers and one controller (each script: one write "
        f"command, e.g. ZADD: {delta.calls.get('zadd', 0) / elapsed:.2f}/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout to measure in the same run, alternated")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    random.seed(args.seed)
    os.chdir(REPO_ROOT)

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    tmp = Path(tempfile.mkdtemp(prefix="marbles-bench-redelivery-"))
    sides: list[Side] = []
    code = 0
    try:
        trees = [("this", REPO_ROOT)]
        if args.baseline is not None:
            trees.append(("baseline", args.baseline.resolve()))
        for label, tree in trees:
            head = subprocess.run(["git", "-C", str(tree), "log", "--oneline", "-1"],
                                  capture_output=True, text=True).stdout.strip()
            say(f"{label}: {tree} ({head})")
        say(f"machine: {os.cpu_count()} CPUs; host load at start: {load_line()}")
        say(f"each side: redis-server with {DEFAULT_CONF.name}, `marbles-rq controller`, two "
            "`marbles-rq worker` (no flags: the defaults), a `sleeper` run; kill -9 of the "
            f"worker running it, {args.kills} times per side, alternating sides")
        for label, tree in trees:
            side = Side.start(label, tree, tmp / label)
            sides.append(side)
            side.begin()
        for i in range(args.kills):
            for side in sides:
                s = side.kill_once()
                say(f"  {side.label:8} kill {i + 1:2}: next attempt_started after "
                    f"{s.total_ms / 1000:.3f} s ({s.reason}; lease left at kill "
                    f"{'-' if s.lease_left_ms is None else s.lease_left_ms} ms)")
        say()
        say(table(["side", "kills", "p50 s", "p90 s", "p99 s", "max s", "redelivered by",
                   f"p99 <= {AIM_P99_S:.0f} s"], [row(s) for s in sides]))
        say(f"host load at end: {load_line()}")
        for side in sides:
            side.stop()
        say()
        say("steady cost of a running run (INFO commandstats over 8 s; expected with liveness: "
            "1 beat/s per worker + a lease renewal per running run every 3.3 s + the "
            "controller's lease every 3.3 s; without: the last two)")
        for label, tree in trees:
            side = Side.start(label, tree, tmp / f"{label}-steady")
            sides.append(side)
            steady_cost(side)
            side.stop()
    except BenchError as exc:
        say(f"BENCHMARK FAILED: {exc}")
        code = 1
    finally:
        for side in sides:
            with contextlib.suppress(Exception):
                side.stop()
        strays = [p for side in sides for p in side.strays()]
        say(f"stray processes left: {strays or 'none'}")
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return code


if __name__ == "__main__":
    sys.exit(main())
