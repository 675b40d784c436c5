"""Start and stop real ``marbles-rq`` worker and controller processes for tests, and wait on
what they do (run status, output events, processes appearing or vanishing) -- never sleep
and hope.

No pytest dependency::

    procs = Procs(redis_url, tmp_path / "procs")
    try:
        w = procs.worker()                      # marbles-rq worker --lease-ms 2000
        procs.controller()                      # marbles-rq controller --interval 0.2
        procs.cli("enqueue", "chain", "--input", '{"steps": 3}', "--id", "r1")
        procs.observer.wait_step_started("r1", "chain.link#1", attempt=1)
        os.kill(w.horse(), signal.SIGKILL)
        procs.observer.wait_final("r1")
    finally:
        procs.stop_all()                        # SIGCONT + SIGTERM, then SIGKILL the trees
        print(procs.report())                   # log tails (pytest shows them on failure)

Every child gets ``MARBLES_REDIS_URL`` (the chain example's effect target reads it) and
``--source`` with examples/chain.py and tests/kill_workflows.py. Each child runs in its own
session (so a test can signal a worker's process group) and is SIGKILLed by the kernel if
the thread that started it dies (PR_SET_PDEATHSIG), and at interpreter exit, so no process
outlives the test run. Process trees are read from ``/proc`` (Linux).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis

from marbles_rq.engine.runs import OutputEvent, RunStore, RunView
from marbles_rq.errors import MarblesError
from marbles_rq.store import open_store

__all__ = [
    "CHAIN_SOURCE",
    "DEFAULT_LEASE_MS",
    "KILL_SOURCE",
    "Observer",
    "Proc",
    "Procs",
    "WaitTimeout",
    "children",
    "descendants",
    "pid_alive",
    "wait_for",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAIN_SOURCE = REPO_ROOT / "examples" / "chain.py"
KILL_SOURCE = REPO_ROOT / "tests" / "kill_workflows.py"
DEFAULT_LEASE_MS = 2000
HOSTNAME = socket.gethostname()

T = TypeVar("T")

# Errors that mean "Redis is not answering right now" to a poller: keep polling.
TRANSIENT: tuple[type[BaseException], ...] = (redis.RedisError, MarblesError, OSError)


# --------------------------------------------------------------------------------------------
# waiting


def db_contents(client: Any) -> dict[str, object]:
    """Every key of the server and its value, in a form equal for equal data: equal before and
    after means nothing was written. (Not DUMP: a read of a hash stored as a hash table may
    step its incremental rehash, which reorders the entries a DUMP serializes.)"""
    out: dict[str, object] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        value: object
        if kind == "hash":
            value = sorted(client.hgetall(key).items())
        elif kind == "set":
            value = sorted(client.smembers(key))
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "stream":
            value = client.xrange(key)
        else:
            value = client.get(key)
        out[key.decode() if isinstance(key, bytes) else key] = (kind, value)
    return out


class WaitTimeout(AssertionError):
    """A condition a test waited for did not happen in time."""


def wait_for(predicate: Callable[[], T | None], *, timeout: float, what: str,
             interval: float = 0.05, context: Callable[[], str] | None = None) -> T:
    """Poll `predicate` until it returns a truthy value and return that value. Transient
    Redis errors count as "not yet". On timeout raise WaitTimeout naming `what`, the last
    value or error, and `context()` (e.g. process log tails)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except TRANSIENT as exc:
            value, last = None, exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:.1f} s waiting for {what} (last: {last!r})"
            if context is not None:
                with contextlib.suppress(Exception):
                    message += "\n" + context()
            raise WaitTimeout(message)
        time.sleep(interval)


# --------------------------------------------------------------------------------------------
# /proc


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may contain spaces
    return fields[0], int(fields[19])


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a dead child not yet reaped)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """Live children of `pid` (every thread's), from /proc/<pid>/task/*/children."""
    found: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            found.update(int(p) for p in (task / "children").read_text().split())
    return sorted(p for p in found if pid_alive(p))


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid`, parents before their children."""
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop(0)):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def _signal_if_same(pid: int, start: int, sig: int) -> None:
    """Signal `pid` only if it is still the process that had start time `start`."""
    st = _stat(pid)
    if st is not None and st[1] == start:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _pdeathsig() -> None:  # pragma: no cover - runs in the forked child
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no {path.name})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path.name} is empty)"


# --------------------------------------------------------------------------------------------
# one process


_live: set[Proc] = set()
_live_lock = threading.Lock()
_owner = os.getpid()


class Proc:
    """One ``marbles-rq worker`` or ``controller`` child process and its log file."""

    def __init__(self, role: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.role, self.argv, self.log = role, argv, log
        with log.open("ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            main = threading.current_thread() is threading.main_thread()
            self.popen = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_pdeathsig if main and sys.platform.startswith("linux") else None)
        self.pid = self.popen.pid
        stat = _stat(self.pid)
        self.start_ticks = stat[1] if stat else -1
        self.started = time.monotonic()
        with _live_lock:
            _live.add(self)

    def __repr__(self) -> str:
        return f"<Proc {self.role} pid={self.pid} {'alive' if self.alive() else 'exited'}>"

    def names(self) -> list[str]:
        """Every RQ worker name this process has announced in its log (one per start of a
        worker loop; several for a pool)."""
        return re.findall(r"Worker (\S+): started with PID", self.text())

    @property
    def name(self) -> str:
        """The RQ worker name it runs under now (``hostname.<random>.pid``, unique per
        start), as `status` shows it."""
        names = self.names()
        return names[-1] if names else f"{HOSTNAME}.?.{self.pid}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return _tail(self.log, lines)

    def children(self) -> list[int]:
        return children(self.pid)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill9(self, *, timeout: float = 10.0) -> None:
        """SIGKILL this process and reap it."""
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=timeout)

    def wait_exit(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def wait_log(self, needle: str, *, timeout: float = 30.0, count: int = 1) -> None:
        """Wait until `needle` appears `count` times in the log (or the process exits)."""
        def seen() -> bool:
            if self.text().count(needle) >= count:
                return True
            if not self.alive():
                raise WaitTimeout(f"{self.role} {self.pid} exited with {self.returncode} "
                                  f"before logging {needle!r}\n{self.tail()}")
            return False

        wait_for(seen, timeout=timeout, what=f"{needle!r} x{count} in the {self.role} log",
                 context=lambda: self.tail())

    def horse(self, *, timeout: float = 15.0) -> int:
        """The pid of this forking worker's work-horse (its only child), waiting for one."""
        def one() -> int | None:
            kids = self.children()
            return kids[0] if len(kids) == 1 else None

        return wait_for(one, timeout=timeout, what=f"the work-horse of worker {self.pid}",
                        context=lambda: f"children: {self.children()}\n{self.tail()}")

    def stop(self, *, grace: float = 3.0) -> None:
        stop_procs([self], grace=grace)


def stop_procs(procs: Iterable[Proc], *, grace: float = 3.0) -> None:
    """SIGCONT + SIGTERM every process (each is its own process group) and wait up to
    `grace` seconds; then SIGKILL whatever is left of each tree, including descendants that
    were reparented when their parent died. Never signals a recycled pid."""
    procs = list(procs)
    tree: list[tuple[int, int]] = []
    for proc in procs:
        for pid in [proc.pid, *descendants(proc.pid)]:
            st = _stat(pid)
            if st is not None:
                tree.append((pid, st[1]))
    for pid, start in tree:
        _signal_if_same(pid, start, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
    for proc in procs:
        if proc.alive():
            proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    for pid, start in tree:
        _signal_if_same(pid, start, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)
        with _live_lock:
            _live.discard(proc)
    leftovers = [pid for pid, start in tree if pid_alive(pid) and (_stat(pid) or ("", -1))[1]
                 == start]
    if leftovers:
        wait_for(lambda: not any(pid_alive(p) for p in leftovers), timeout=10,
                 what=f"processes {leftovers} to die after SIGKILL")


@atexit.register
def _kill_leftovers() -> None:
    if os.getpid() != _owner:
        return  # a forked child exiting must not kill anything
    with _live_lock:
        procs = list(_live)
    if procs:
        stop_procs(procs, grace=0.0)


# --------------------------------------------------------------------------------------------
# observing runs


class Observer:
    """Reads a run's state, output journal and Redis lists, and waits on them."""

    def __init__(self, redis_url: str, context: Callable[[], str] | None = None, *,
                 effects_url: str | None = None) -> None:
        """`effects_url`: where the test workflows write their effects and markers, if not
        the store (a cluster store: see MARBLES_TEST_EFFECTS_URL in tests/kill_workflows.py)."""
        self.url = redis_url
        self.runs = RunStore(open_store(redis_url))
        self.client = redis.Redis.from_url(effects_url or redis_url, decode_responses=True,
                                           socket_timeout=3, socket_connect_timeout=2)
        self.context = context

    # -- reads ----------------------------------------------------------------------------

    def view(self, run_id: str) -> RunView | None:
        return self.runs.get(run_id)

    def status(self, run_id: str) -> str | None:
        view = self.runs.get(run_id)
        return None if view is None else view.status

    def events(self, run_id: str) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        after = "0-0"
        while True:
            page = self.runs.output(run_id, after=after, count=1000)
            out += page
            if len(page) < 1000:
                return out
            after = page[-1].id

    def lrange(self, key: str) -> list[str]:
        return [str(x) for x in self.client.lrange(key, 0, -1)]  # decode_responses=True

    def dump(self, run_id: str) -> str:
        """The run's status and output journal, for failure messages."""
        try:
            view = self.view(run_id)
            lines = [f"run {run_id}: " + ("missing" if view is None else
                                          f"{view.status} attempt {view.attempt} "
                                          f"worker {view.worker}")]
            lines += [f"  {e.id} a{e.attempt} {e.type} {json.dumps(e.data)}"
                      for e in self.events(run_id)]
        except TRANSIENT as exc:
            return f"run {run_id}: cannot read ({exc!r})"
        return "\n".join(lines)

    # -- waits ----------------------------------------------------------------------------

    def _context(self, run_id: str) -> Callable[[], str]:
        def describe() -> str:
            parts = [self.dump(run_id)]
            if self.context is not None:
                parts.append(self.context())
            return "\n".join(parts)

        return describe

    def wait_event(self, run_id: str, match: Callable[[OutputEvent], bool], *, what: str,
                   timeout: float = 30.0) -> OutputEvent:
        """The first output event of the run that `match`es, waiting for it."""
        def find() -> OutputEvent | None:
            return next((e for e in self.events(run_id) if match(e)), None)

        return wait_for(find, timeout=timeout, what=f"run {run_id}: {what}",
                        context=self._context(run_id))

    def wait_step_started(self, run_id: str, step: str, *, attempt: int,
                          timeout: float = 30.0) -> OutputEvent:
        """Wait until step `step` (e.g. ``chain.link#2``) has started in delivery `attempt`."""
        return self.wait_event(
            run_id, lambda e: e.type == "step_started" and e.attempt == attempt
            and e.data.get("step") == step,
            what=f"step {step} started in attempt {attempt}", timeout=timeout)

    def wait_attempt(self, run_id: str, attempt: int, *, timeout: float = 30.0) -> OutputEvent:
        return self.wait_event(run_id, lambda e: e.type == "attempt_started"
                               and e.attempt == attempt,
                               what=f"attempt {attempt} started", timeout=timeout)

    def wait_final(self, run_id: str, *, timeout: float = 60.0) -> OutputEvent:
        return self.wait_event(run_id, lambda e: e.type == "final", what="its final event",
                               timeout=timeout)

    def wait_status(self, run_id: str, *statuses: str, timeout: float = 30.0) -> RunView:
        def check() -> RunView | None:
            view = self.view(run_id)
            return view if view is not None and view.status in statuses else None

        return wait_for(check, timeout=timeout, what=f"run {run_id} to be {'/'.join(statuses)}",
                        context=self._context(run_id))

    def wait_list(self, key: str, predicate: Callable[[list[str]], bool], *, what: str,
                  timeout: float = 30.0) -> list[str]:
        def check() -> list[str] | None:
            items = self.lrange(key)
            return items if predicate(items) else None

        return wait_for(check, timeout=timeout, what=what, context=self.context)

    def close(self) -> None:
        self.client.close()
        with contextlib.suppress(Exception):
            self.runs.client.close()


# --------------------------------------------------------------------------------------------
# a test's processes


def _cli_argv() -> list[str]:
    script = Path(sys.executable).parent / "marbles-rq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "marbles_rq"]


class Procs:
    """The marbles-rq processes of one test, all against one Redis; logs in `dir`."""

    def __init__(self, redis_url: str, dir: Path,
                 sources: Sequence[Path] = (CHAIN_SOURCE, KILL_SOURCE)) -> None:
        self.url = redis_url
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.source = os.pathsep.join(str(s) for s in sources)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("MARBLES_PREFIX", "MARBLES_BUCKETS", "MARBLES_RQ_URL")}
        self.env.update(MARBLES_REDIS_URL=redis_url, MARBLES_SOURCE=self.source,
                        PYTHONUNBUFFERED="1")
        self.procs: list[Proc] = []
        self.cli_log = self.dir / "cli.log"
        self._observer: Observer | None = None

    @property
    def observer(self) -> Observer:
        if self._observer is None:
            self._observer = Observer(self.url, context=self.report,
                                      effects_url=self.env.get("MARBLES_TEST_EFFECTS_URL"))
        return self._observer

    def base_argv(self) -> list[str]:
        return [*_cli_argv(), "--redis-url", self.url, "--source", self.source]

    def _start(self, role: str, args: list[str]) -> Proc:
        n = sum(1 for p in self.procs if p.role == role)
        proc = Proc(role, [*self.base_argv(), *args], self.dir / f"{role}-{n}.log", self.env)
        self.procs.append(proc)
        return proc

    def worker(self, *, lease_ms: int = DEFAULT_LEASE_MS, pool: int | None = None,
               burst: bool = False, ready: bool = True, extra: Sequence[str] = ()) -> Proc:
        """Start ``marbles-rq worker``; with `ready`, wait until it listens on its queue
        (every executor, in pool mode)."""
        args = ["worker", "--lease-ms", str(lease_ms), *extra]
        if pool:
            args += ["--pool", str(pool)]
        if burst:
            args.append("--burst")
        proc = self._start("worker", args)
        if ready:
            proc.wait_log("*** Listening on", count=pool or 1)
        return proc

    def controller(self, *, interval: float = 0.2, lease_ms: int | None = None,
                   ready: bool = True, extra: Sequence[str] = ()) -> Proc:
        """Start ``marbles-rq controller``; with `ready`, wait until it is elected."""
        args = ["controller", "--interval", str(interval), *extra]
        if lease_ms is not None:
            args += ["--lease-ms", str(lease_ms)]
        proc = self._start("controller", args)
        if ready:
            proc.wait_log("elected controller")
        return proc

    def start(self, *, workers: int = 1, controller: bool = True, pool: int | None = None,
              lease_ms: int = DEFAULT_LEASE_MS, interval: float = 0.2) -> list[Proc]:
        """Start `workers` workers (and a controller) at once, then wait until all are ready
        (in parallel: each takes a second or two to import). Returns the workers."""
        started = [self.worker(lease_ms=lease_ms, pool=pool, ready=False)
                   for _ in range(workers)]
        ctl = self.controller(interval=interval, ready=False) if controller else None
        for proc in started:
            proc.wait_log("*** Listening on", count=pool or 1)
        if ctl is not None:
            ctl.wait_log("elected controller")
        return started

    def by_name(self, worker_name: str | None) -> Proc:
        """The started process that ran RQ worker `worker_name`."""
        for proc in self.procs:
            if worker_name in proc.names():
                return proc
        raise AssertionError(f"no started process runs as worker {worker_name!r}: "
                             f"{[p.name for p in self.procs]}")

    # -- one-shot commands ------------------------------------------------------------------

    def cli_argv(self, *args: str) -> list[str]:
        return [*self.base_argv(), *args]

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run one ``marbles-rq`` command to completion; its output goes to cli.log too."""
        argv = self.cli_argv(*args)
        done = subprocess.run(argv, cwd=REPO_ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        self.log_cli(argv, done.returncode, done.stdout, done.stderr)
        return done

    def cli_concurrently(self, *args: str, n: int,
                         timeout: float = 120.0) -> list[subprocess.CompletedProcess[str]]:
        """Start `n` copies of one ``marbles-rq`` command at once; wait for all of them."""
        argv = self.cli_argv(*args)
        started = [subprocess.Popen(argv, cwd=REPO_ROOT, env=self.env, text=True,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE) for _ in range(n)]
        done: list[subprocess.CompletedProcess[str]] = []
        try:
            for proc in started:
                out, err = proc.communicate(timeout=timeout)
                self.log_cli(argv, proc.returncode, out, err)
                done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
        finally:
            for proc in started:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return done

    def log_cli(self, argv: Sequence[str], code: int, out: str, err: str) -> None:
        with self.cli_log.open("a") as fh:
            fh.write(f"$ {' '.join(argv[len(self.base_argv()):])}  -> exit {code}\n{out}{err}")

    def enqueue(self, name: str, input: Any, run_id: str, *extra: str) -> str:
        """``marbles-rq enqueue``; asserts exit 0 and returns its stdout."""
        done = self.cli("enqueue", name, "--input", json.dumps(input), "--id", run_id, *extra)
        assert done.returncode == 0, f"enqueue exited {done.returncode}: {done.stderr}"
        return done.stdout

    # -- teardown and reporting -------------------------------------------------------------

    def stop_all(self, *, grace: float = 3.0) -> None:
        # Each live controller's threads' stacks into its log first (faulthandler on SIGUSR2):
        # the report of a failed test then says where a controller that went quiet was.
        for proc in self.procs:
            if proc.role == "controller" and proc.alive():
                with contextlib.suppress(OSError):
                    proc.signal(signal.SIGUSR2)
                with contextlib.suppress(WaitTimeout):
                    proc.wait_log("Current thread", timeout=2)
        try:
            stop_procs(self.procs, grace=grace)
        finally:
            if self._observer is not None:
                self._observer.close()

    def report(self, lines: int = 40) -> str:
        parts = []
        for proc in self.procs:
            state = "alive" if proc.alive() else f"exited {proc.returncode}"
            parts.append(f"--- {proc.log.name} (pid {proc.pid}, {state}) ---\n"
                         f"{proc.tail(lines)}")
        if self.cli_log.exists():
            parts.append(f"--- {self.cli_log.name} ---\n{_tail(self.cli_log, lines)}")
        return "\n".join(parts)
