"""`marbles-rq dev`: the whole stack on one machine, in the foreground.

It starts (or reuses) a durable redis-server under `./.marbles/redis` on 127.0.0.1, one
controller and N workers as child processes, shows the runs' progress, restarts a child that
dies, and on Ctrl-C or SIGTERM stops the workers and the controller (SIGTERM, then a bounded
wait) and then Redis (SHUTDOWN, which fsyncs the append-only file). The data stays in
`./.marbles/redis` for the next start.

Every child is its own process group, so the terminal's Ctrl-C reaches only `dev`, which
then stops them in order: Redis last, so nothing is cut off from it while it finishes. Each
child also gets SIGTERM from the kernel if `dev` itself dies (PR_SET_PDEATHSIG), so a
`dev` killed with SIGKILL leaves nothing running.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any

import click
import redis

from ..deployment import Settings
from ..store.keys import DEFAULT_BUCKETS, Keyspace
from ..store.replies import as_text
from .exits import EXIT_INPUT, EXIT_REDIS
from .procs import LOG_LEVELS

DEFAULT_PORT = 6399
PORT_ENV = "MARBLES_DEV_PORT"
DEFAULT_WEB_PORT = 8700
WEB_PORT_ENV = "MARBLES_DEV_WEB_PORT"
DIR_ENV = "MARBLES_DEV_DIR"
HOST = "127.0.0.1"
# Same policy as the worker's --pool supervisor: a child that ran this long before it died
# is restarted at once; one that dies sooner waits 0.5 s, doubling to 30 s.
HEALTHY_S = 10.0
BACKOFF_FIRST_S, BACKOFF_CAP_S = 0.5, 30.0
REDIS_READY_S = 300.0  # a large append-only file takes a while to load
REDIS_STOP_S = 60.0
_PR_SET_PDEATHSIG = 1
TERMINAL = ("succeeded", "failed", "cancelled")
SHOWN = ("queued", "running", "waiting", "succeeded", "failed")


class DevError(click.ClickException):
    """One line and exit 3: the port or the directory is taken, or Redis will not start."""

    exit_code = EXIT_REDIS


class DevInputError(DevError):
    exit_code = EXIT_INPUT


def redis_conf() -> Path:
    """The durable redis.conf: packaged in the wheel, else ops/redis.conf of a checkout."""
    packaged = Path(str(resources.files("marbles_rq"))) / "redis.conf"
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "ops" / "redis.conf"


def _pdeathsig() -> None:  # pragma: no cover - runs in the forked child before exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # not Linux: kill(0) is all we know
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:200] if lines else ""


# ------------------------------------------------------------------------------------ Redis


@dataclass(frozen=True)
class Probe:
    kind: str  # "free" | "ours" | "foreign"
    pid: int = 0
    detail: str = ""


def _client(port: int, timeout: float) -> Any:
    """A client without redis-py's automatic resend: a listener that never answers costs one
    timeout, not four, and SHUTDOWN is sent once."""
    from ..store.connection import connect

    return connect(f"redis://{HOST}:{port}/0", socket_timeout=timeout, connect_timeout=1.0)


def probe_port(port: int, data_dir: Path) -> Probe:
    """What listens on 127.0.0.1:`port`: nothing; our redis-server (a Redis whose data dir is
    `data_dir`, so its append-only file is ours); or anything else."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            pass
    except ConnectionRefusedError:
        return Probe("free")
    except OSError as exc:
        return Probe("foreign", detail=f"connecting to it fails: {exc}")
    client = _client(port, 2.0)
    try:
        with contextlib.suppress(redis.BusyLoadingError):  # loading: still tell whose it is
            client.ping()
        found = client.config_get("dir")
        where = as_text(next(iter(found.values()), ""))
        if not where or Path(where).resolve() != data_dir.resolve():
            return Probe("foreign", detail=f"a Redis server with data dir {where or '?'}")
        pid = int(as_text(client.info("server").get("process_id", 0)))
        return Probe("ours", pid=pid)
    except redis.AuthenticationError:
        return Probe("foreign", detail="a Redis server that wants a password")
    except redis.ResponseError as exc:
        return Probe("foreign", detail=f"a Redis server that refuses CONFIG GET ({exc})")
    except redis.TimeoutError:
        return Probe("foreign", detail="it does not answer PING")
    except redis.RedisError as exc:
        return Probe("foreign", detail=f"it does not answer PING as Redis does "
                                       f"({type(exc).__name__})")
    finally:
        client.close()


def redis_ready(port: int) -> str | None:
    """None when 127.0.0.1:`port` answers PING; else why not."""
    client = _client(port, 2.0)
    try:
        client.ping()
        return None
    except redis.BusyLoadingError:
        return "loading"
    except redis.RedisError as exc:
        return type(exc).__name__
    finally:
        client.close()


# ----------------------------------------------------------------------------- children


@dataclass
class Child:
    """One supervised process: the redis-server, the controller or a worker."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    failures: int = 0
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)  # on top of dev's environment

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def next_delay(self, now: float) -> float:
        """Restart at once after a healthy run; else back off (0.5 s doubling to 30 s)."""
        if now - self.started >= HEALTHY_S:
            self.failures = 0
            return 0.0
        delay = min(BACKOFF_FIRST_S * 2.0 ** self.failures, BACKOFF_CAP_S)
        self.failures += 1
        return delay


@dataclass
class Snapshot:
    counts: Counter[str] = field(default_factory=Counter)
    leader: str = "-"
    error: str | None = None


class RunCounter:
    """Runs by status, read from the store: each bucket's run listing, then each run's
    status field. A finished status never changes, so finished runs are read once."""

    def __init__(self, url: str, prefix: str, buckets: int | None,
                 lanes: int | None = None) -> None:
        from ..store.connection import connect

        self.client: Any = connect(url)
        self.keys = Keyspace(prefix, buckets or DEFAULT_BUCKETS, lanes=lanes or 1)
        self.adopt = {"layout"} | {n for n, v in (("buckets", buckets), ("lanes", lanes))
                                   if v is None}
        self.final: dict[str, str] = {}

    def counts(self) -> Counter[str]:
        from ..store.redis_store import RedisStore

        # The deployment's recorded layout (the controller records it on its first start).
        self.keys = RedisStore(self.client, self.keys, read_only=True, adopt=self.adopt).keys
        pipe = self.client.pipeline(transaction=False)
        for bucket in range(self.keys.buckets):
            pipe.zrange(self.keys.listing("run", bucket), 0, -1)
        ids = [as_text(rid) for part in pipe.execute(raise_on_error=False)
               if isinstance(part, list) for rid in part]
        present = set(ids)
        self.final = {rid: st for rid, st in self.final.items() if rid in present}  # pruned
        counts: Counter[str] = Counter(self.final.values())
        todo = [rid for rid in ids if rid not in self.final]
        for start in range(0, len(todo), 1000):
            chunk = todo[start:start + 1000]
            pipe = self.client.pipeline(transaction=False)
            for rid in chunk:
                pipe.hget(self.keys.run(rid), "status")
            for rid, status in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
                if status is None or isinstance(status, Exception):
                    continue
                text = as_text(status)
                counts[text] += 1
                if text in TERMINAL:
                    self.final[rid] = text
        return counts

    def leader(self) -> str | None:
        """host:pid of the controller holding the lease, or None."""
        from ..controller.loop import LEASE_NAME

        value = self.client.get(self.keys.lease(LEASE_NAME))
        if value is None:
            return None
        token = as_text(value).partition("|")[2]
        host, _, rest = token.partition(":")
        return f"{host}:{rest.partition(':')[0]}"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


class Console:
    """Event lines, and one progress line: redrawn in place on a terminal, printed as its
    own line otherwise (only when it changed)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.shown = ""  # the progress line now on the terminal (tty only)
        self.last = ""

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a closed or full pipe is no reason to die
            self.stream.write(text)
            self.stream.flush()

    def event(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        if self.tty and self.shown:
            self._write("\r\x1b[K")
        self._write(f"{stamp} {text}\n")
        if self.tty and self.shown:
            self._write(self.shown)

    def progress(self, text: str) -> None:
        if self.tty:
            width = shutil.get_terminal_size((120, 24)).columns - 1
            self.shown = text[:width]
            self._write("\r\x1b[K" + self.shown)
        elif text != self.last:
            self._write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.last = text

    def close(self) -> None:
        if self.tty and self.shown:
            self._write("\n")
            self.shown = ""


# -------------------------------------------------------------------------------- the stack


class Dev:
    def __init__(self, settings: Settings, *, home: Path, port: int, workers: int,
                 pool: int | None, lease_ms: int, stop_timeout: float, progress_every: float,
                 log_level: str, out: IO[str], web_port: int | None = None) -> None:
        self.settings = settings
        self.home = home
        self.data = home / "redis"
        self.logs = home / "logs"
        self.port = port
        self.url = f"redis://{HOST}:{port}/0"
        self.workers, self.pool, self.lease_ms = workers, pool, lease_ms
        self.stop_timeout, self.progress_every = stop_timeout, progress_every
        self.log_level = log_level
        self.web_port = web_port  # None: no dashboard (--no-web)
        self.web_url = ""  # set once the dashboard is started
        self.console = Console(out)
        self.children: list[Child] = []
        self.redis: Child | None = None
        self.adopted_pid = 0  # a redis-server of ours that was running before we started
        self.stops = 0  # stop signals received; a second one means "now"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._lock: IO[str] | None = None

    # -- setup -------------------------------------------------------------------------------

    def _take_lock(self) -> None:
        """One `dev` per directory: a second one would start a second set of processes on
        the same Redis and fight over nothing useful."""
        self.home.mkdir(parents=True, exist_ok=True)
        lock = (self.home / "dev.lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            other = lock.read().strip() or "?"
            lock.close()
            raise DevError(f"marbles-rq dev already runs in {self.home} (pid {other}); stop it "
                           f"first, or use another --dir") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock

    def _env(self) -> dict[str, str]:
        # One metrics port cannot serve the controller and every worker: dev's children get
        # none (MARBLES_METRICS_PORT would make all but the first exit 2, again and again).
        env = {k: v for k, v in os.environ.items()
               if k not in ("MARBLES_RQ_URL", "MARBLES_METRICS_PORT")}
        env.update(MARBLES_REDIS_URL=self.url, MARBLES_SOURCE=self.settings.source or "",
                   MARBLES_PREFIX=self.settings.prefix, PYTHONUNBUFFERED="1")
        # Only what was given: unset, the children adopt what the deployment recorded.
        for name, value in (("MARBLES_BUCKETS", self.settings.buckets),
                            ("MARBLES_LANE_COUNT", self.settings.lanes)):
            env.pop(name, None)
            if value is not None:
                env[name] = str(value)
        return env

    def _spawn(self, child: Child) -> None:
        child.log.parent.mkdir(parents=True, exist_ok=True)
        with child.log.open("ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} marbles-rq dev starts: "
                      f"{' '.join(child.argv)}\n".encode())
            log.flush()
            # Its own session: Ctrl-C on the terminal reaches dev only, which stops the
            # children in order; a test or an operator can signal one child's whole group.
            child.popen = subprocess.Popen(
                child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**self._env(), **child.env}, start_new_session=True,
                preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)
        child.started = time.monotonic()
        child.restart_at = None

    def _redis_child(self, server: str) -> Child:
        argv = [server, str(redis_conf()), "--port", str(self.port), "--bind", HOST,
                "--dir", str(self.data), "--pidfile", str(self.data / "redis.pid"),
                "--logfile", str(self.data / "redis.log"), "--daemonize", "no"]
        return Child("redis", argv, self.data / "redis.log")

    def _app_child(self, name: str, args: list[str]) -> Child:
        argv = [sys.executable, "-m", "marbles_rq", *args, "--log-level", self.log_level]
        return Child(name, argv, self.logs / f"{name}.log")

    def start_redis(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise DevError("redis-server is not on PATH: install it (apt-get install -y "
                           "redis-server) or run ops/test --setup-only")
        if not redis_conf().is_file():
            raise DevInputError(f"the durable Redis configuration is missing: {redis_conf()}")
        self.data.mkdir(parents=True, exist_ok=True)
        found = probe_port(self.port, self.data)
        if found.kind == "foreign":
            raise DevError(f"port {self.port} on {HOST} is taken by something that is not "
                           f"marbles-rq dev's redis-server ({found.detail}); stop it or pick "
                           f"another with --port")
        elsewhere = self._server_of_data_dir()
        if found.kind == "free" and elsewhere:
            # Two servers on one append-only file would corrupt it.
            raise DevError(f"a redis-server (pid {elsewhere}) already serves {self.data} on "
                           f"another port ({self._saved_port()}); use that --port, or stop it "
                           f"(ops/redis-local stop {self.data})")
        if found.kind == "ours":
            self.adopted_pid = found.pid
            self.console.event(f"reusing redis-server pid {found.pid} on {self.url} (its data "
                               f"dir is {self.data}); it was running before dev, so dev "
                               f"leaves it running")
        else:
            self.redis = self._redis_child(server)
            (self.data / "redis.port").write_text(f"{self.port}\n")  # for ops/redis-local
            self._spawn(self.redis)
        self._wait_redis()

    def _server_of_data_dir(self) -> int:
        """The pid of a live redis-server named by our data dir's pidfile, else 0."""
        try:
            pid = int((self.data / "redis.pid").read_text().strip())
            comm = Path(f"/proc/{pid}/comm").read_text()
        except (OSError, ValueError):
            return 0
        return pid if comm.startswith("redis-server") and _alive(pid) else 0

    def _saved_port(self) -> str:
        try:
            return (self.data / "redis.port").read_text().strip() or "?"
        except OSError:
            return "?"

    def _wait_redis(self) -> None:
        deadline = time.monotonic() + REDIS_READY_S
        said_loading = False
        while (why := redis_ready(self.port)) is not None:
            if self.redis is not None and not self.redis.running():
                assert self.redis.popen is not None
                raise DevError(f"redis-server exited with {_exit_text(self.redis.popen.wait())} "
                               f"at start: {_last_line(self.redis.log) or 'no log'} "
                               f"(log: {self.redis.log})")
            if why == "loading" and not said_loading:
                self.console.event("redis-server is loading its append-only file")
                said_loading = True
            if self.stops:
                return  # asked to stop while Redis starts: run() stops it again
            if time.monotonic() > deadline:
                raise DevError(f"redis-server on port {self.port} did not answer PING within "
                               f"{REDIS_READY_S:.0f} s ({why}); see {self.data / 'redis.log'}")
            time.sleep(0.05)

    def start_app(self) -> None:
        ctl = self._app_child("controller", ["controller"])
        workers = []
        for n in range(1, self.workers + 1):
            args = ["worker", "--lease-ms", str(self.lease_ms)]
            if self.pool:
                args += ["--pool", str(self.pool)]
            workers.append(self._app_child(f"worker-{n}", args))
        web = self._web_child()
        for child in (ctl, *workers, *([web] if web is not None else [])):
            self.children.append(child)
            self._spawn(child)

    def web_token(self) -> str:
        """The dashboard's local token: made once, kept in --dir (owner-only), so a browser
        signed in stays signed in across starts."""
        import secrets

        path = self.home / "web.token"
        with contextlib.suppress(OSError):
            token = path.read_text().strip()
            if len(token) >= 16:
                # A file made or copied with looser rights: the token signs in for writes.
                os.chmod(path, 0o600)
                return token
        token = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)  # the mode above applies only to a new file
            fh.write(token + "\n")
        return token

    def _web_child(self) -> Child | None:
        """`marbles-rq web` on 127.0.0.1:--web-port with the local token; a port someone
        else holds is said once and dev goes on without the dashboard."""
        if self.web_port is None:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            taken = probe.connect_ex((HOST, self.web_port)) == 0
        if taken:
            self.console.event(f"dashboard not started: port {self.web_port} on {HOST} is "
                               f"taken (pick another with --web-port, or --no-web)")
            return None
        argv = [sys.executable, "-m", "marbles_rq", "web", "--bind", HOST, "--port",
                str(self.web_port), "--log-level", self.log_level.lower()]
        self.web_url = f"http://{HOST}:{self.web_port}/"
        return Child("web", argv, self.logs / "web.log",
                     env={"MARBLES_WEB_TOKEN": self.web_token()})

    def banner(self) -> None:
        from ..engine.authoring import REGISTRY

        kind = f"--pool {self.pool} (non-forking)" if self.pool else "forking"
        pids = ", ".join(f"{c.name} {c.pid}" for c in self.children)
        redis_pid = self.redis.pid if self.redis is not None else self.adopted_pid
        lines = [
            f"marbles-rq dev: Redis {self.url} (redis-server pid {redis_pid}; data "
            f"{self.data}, append-only, fsync always)",
            f"  source     {self.settings.source} (workflows: "
            f"{', '.join(sorted(REGISTRY.workflows)) or '-'})",
            f"  processes  controller and {self.workers} worker(s), {kind}: {pids}",
            f"  logs       {self.logs}/<name>.log, Redis {self.data / 'redis.log'}",
            *([f"  dashboard  {self.web_url} (token {self.web_token()}: sign in with it to "
               f"answer, cancel or rerun; kept in {self.home / 'web.token'})"]
              if self.web_url else []),
            "  try        export MARBLES_REDIS_URL=" + self.url
            + f" MARBLES_SOURCE={self.settings.source}",
            "             marbles-rq enqueue NAME --input '{...}' --wait; marbles-rq runs; "
            "marbles-rq status RUN; marbles-rq watch RUN; marbles-rq feed; marbles-rq leader",
            "  stop       Ctrl-C (or SIGTERM): workers and controller stop, then Redis; the data "
            "stays for the next start",
        ]
        for line in lines:
            self.console.event(line)
        self._declare(REGISTRY)
        self.console.event(f"ready: {self.url}" + (f", dashboard {self.web_url}"
                                                    if self.web_url else ""))

    def _declare(self, registry: Any) -> None:
        """Declare the workflows and event triggers before saying ready, as the workers
        will: a caller without the source may start one, or send an event, the moment it
        reads `ready`."""
        from ..deployment import Settings
        from ..engine.catalog import declare
        from ..triggers.events import declare_triggers

        deployment = Settings(self.url, self.settings.prefix, self.settings.buckets,
                              lanes=self.settings.lanes)
        runs = deployment.runs()
        declare(runs.client, runs.keys, registry)
        declare_triggers(runs.client, runs.keys)
        runs.client.close()

    # -- the loop ----------------------------------------------------------------------------

    def _signal(self, _signum: int, _frame: Any) -> None:
        self.stops += 1
        self._wake()

    def _wake(self, *_args: Any) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _sleep(self, seconds: float) -> None:
        if select.select([self._wake_r], [], [], max(0.0, seconds))[0]:
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._wake_r, 4096)

    def _supervised(self) -> Iterator[Child]:
        if self.redis is not None:
            yield self.redis
        yield from self.children

    def _check(self, now: float) -> None:
        """Notice exits and schedule restarts; start what is due."""
        for child in self._supervised():
            if child.popen is not None and child.restart_at is None:
                code = child.popen.poll()
                if code is not None:
                    delay = child.next_delay(now)
                    child.restart_at = now + delay
                    why = _last_line(child.log) if code not in (0, -9) else ""
                    self.console.event(
                        f"{child.name} (pid {child.pid}) exited with {_exit_text(code)}; "
                        f"restarting it{f' in {delay:.1f} s' if delay else ''}"
                        + (f" (last log line: {why})" if why else ""))
            if child.restart_at is not None and child.restart_at <= now:
                child.restarts += 1
                self._spawn(child)
                self.console.event(f"{child.name} restarted (pid {child.pid})")
        if self.adopted_pid and not _alive(self.adopted_pid):
            self.console.event(f"redis-server pid {self.adopted_pid} (not started by dev) is "
                               f"gone; starting one of dev's own")
            self.adopted_pid = 0
            server = shutil.which("redis-server") or "redis-server"
            self.redis = self._redis_child(server)
            self._spawn(self.redis)

    def _progress(self, counter: RunCounter) -> None:
        up = sum(1 for c in self.children if c.name.startswith("worker") and c.running())
        ctl = next(c for c in self.children if c.name == "controller")
        try:
            counts = counter.counts()
            holder = counter.leader()
        except (redis.RedisError, OSError) as exc:
            self.console.progress(f"redis: not answering ({type(exc).__name__}) | workers "
                                  f"{up}/{self.workers}")
            return
        if holder is None:
            lead = "controller: nobody leads yet"
        elif ctl.pid is not None and holder.endswith(f":{ctl.pid}"):
            lead = "controller leads"
        else:
            lead = f"controller: {holder} leads"
        runs = ", ".join(f"{counts.get(s, 0)} {s}" for s in SHOWN)
        if counts.get("cancelled"):
            runs += f", {counts['cancelled']} cancelled"
        restarts = sum(c.restarts for c in self._supervised())
        self.console.progress(f"runs: {runs} | workers {up}/{self.workers}, {lead}"
                              + (f", {restarts} restart(s)" if restarts else ""))

    def run(self) -> None:
        self._take_lock()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._signal)
        signal.signal(signal.SIGCHLD, self._wake)
        counter: RunCounter | None = None
        try:
            self.start_redis()
            self._check_durable()
            if not self.stops:
                self.start_app()
                self.banner()
            counter = RunCounter(self.url, self.settings.prefix, self.settings.buckets,
                                 self.settings.lanes)
            next_progress = 0.0
            while not self.stops:
                now = time.monotonic()
                self._check(now)
                if now >= next_progress:
                    began = time.monotonic()
                    self._progress(counter)
                    # Counting reads every run id: on a big store, count less often.
                    cost = time.monotonic() - began
                    next_progress = time.monotonic() + max(self.progress_every, 20 * cost)
                dues = [c.restart_at for c in self._supervised() if c.restart_at is not None]
                self._sleep(min([next_progress, *dues]) - time.monotonic())
        finally:
            self.console.close()
            self.stop()
            if counter is not None:
                counter.close()

    def _check_durable(self) -> None:
        from ..store.connection import connect
        from ..store.doctor import require_durable

        client = connect(self.url)
        try:
            require_durable(client)
        finally:
            client.close()

    # -- stopping ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Workers and controller: SIGTERM, wait up to --stop-timeout (a second Ctrl-C cuts
        it short), then SIGKILL their groups. Then Redis: SHUTDOWN, which fsyncs the
        append-only file before the server exits."""
        apps = [c for c in self.children if c.running()]
        for child in self.children:
            child.restart_at = None
        if apps:
            self.console.event("stopping: " + ", ".join(f"{c.name} {c.pid}" for c in apps)
                               + f" (SIGTERM; up to {self.stop_timeout:g} s for a run in "
                               "progress; Ctrl-C again to kill them now)")
        for child in apps:
            assert child.popen is not None
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(signal.SIGTERM)
        seen = self.stops
        deadline = time.monotonic() + self.stop_timeout
        while any(c.running() for c in apps):
            if time.monotonic() >= deadline or self.stops > max(seen, 1):
                left = [c for c in apps if c.running()]
                self.console.event("killing " + ", ".join(f"{c.name} {c.pid}" for c in left)
                                   + " (SIGKILL); a run they had is redelivered next time")
                for child in left:
                    # Not yet reaped, so the group id cannot have been reused.
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        assert child.pid is not None
                        os.killpg(child.pid, signal.SIGKILL)
                for child in left:
                    assert child.popen is not None
                    child.popen.wait()
                break
            self._sleep(0.1)
        self._stop_redis()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _stop_redis(self) -> None:
        if self.adopted_pid:
            self.console.event(f"left redis-server pid {self.adopted_pid} running (dev did not "
                               f"start it); data in {self.data}")
            return
        child = self.redis
        if child is None or child.popen is None or not child.running():
            return
        if child.running():
            client = _client(self.port, REDIS_STOP_S)
            with contextlib.suppress(redis.RedisError):
                client.shutdown()  # replies only with an error; success closes the connection
            client.close()
            try:
                child.popen.wait(timeout=REDIS_STOP_S)
            except subprocess.TimeoutExpired:
                child.popen.terminate()  # the same shutdown path, if SHUTDOWN was refused
                try:
                    child.popen.wait(timeout=REDIS_STOP_S)
                except subprocess.TimeoutExpired:
                    child.popen.kill()
                    child.popen.wait()
        self.console.event(f"stopped; data kept in {self.data} (the next marbles-rq dev "
                           f"starts from it)")


@click.command()
@click.option("--workers", type=click.IntRange(0, 64), default=2, show_default=True,
              help="Worker processes to run.")
@click.option("--pool", type=click.IntRange(1, 256), default=None,
              help="Each worker runs N non-forking executors instead of forking per run.")
@click.option("--port", type=click.IntRange(1, 65535), envvar=PORT_ENV, default=DEFAULT_PORT,
              show_default=True, help=f"Port of the local Redis on {HOST} (env {PORT_ENV}).")
@click.option("--dir", "home", envvar=DIR_ENV, default=".marbles", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help=f"Where Redis data, logs and the lock live (env {DIR_ENV}).")
@click.option("--lease-ms", type=click.IntRange(1000, 3_600_000), default=10_000,
              show_default=True, help="The workers' execution lease.")
@click.option("--stop-timeout", type=click.FloatRange(0, 3600), default=30.0, show_default=True,
              help="Seconds a stopping worker may take to finish its run before it is killed.")
@click.option("--progress-every", type=click.FloatRange(0.2, 3600), default=None,
              help="Seconds between progress updates [default: 1 on a terminal, else 10; "
                   "off a terminal a line is printed only when it changed].")
@click.option("--log-level", type=LOG_LEVELS, default="INFO", show_default=True,
              help="Log level of the controller and workers.")
@click.option("--web-port", type=click.IntRange(1, 65535), envvar=WEB_PORT_ENV,
              default=DEFAULT_WEB_PORT, show_default=True,
              help=f"Port of the dashboard on {HOST} (env {WEB_PORT_ENV}).")
@click.option("--no-web", is_flag=True, help="Do not start the dashboard.")
@click.pass_obj
def dev(settings: Settings, workers: int, pool: int | None, port: int, home: Path,
        lease_ms: int, stop_timeout: float, progress_every: float | None,
        log_level: str, web_port: int, no_web: bool) -> None:
    """Run everything on this machine: a durable local Redis under --dir, a controller,
    --workers workers on --source and the dashboard (its URL and local token are printed);
    live progress; restarts what dies; Ctrl-C stops it all and keeps the data. --redis-url
    and --rq-url are not used: dev runs its own Redis."""
    from ..engine.authoring import REGISTRY
    from ..errors import ConfigError

    settings.check()
    if not settings.source:
        raise ConfigError("dev needs --source (env MARBLES_SOURCE): the workflows to run")
    settings.load_source()  # a definition error is one line now, not a restart loop later
    if not REGISTRY.workflows:
        raise ConfigError(f"--source {settings.source!r} defines no workflow")
    out = sys.stdout
    every = progress_every if progress_every is not None else (1.0 if out.isatty() else 10.0)
    stack = Dev(settings, home=home.absolute(), port=port, workers=workers, pool=pool,
                lease_ms=lease_ms, stop_timeout=stop_timeout, progress_every=every,
                log_level=log_level, out=out, web_port=None if no_web else web_port)
    stack.run()
