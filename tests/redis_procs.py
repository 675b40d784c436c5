"""Start and stop real ``redis-server`` processes for tests, benchmarks and demos.

No pytest dependency: import it from anywhere run at the repo root, e.g.
``from tests.redis_procs import RedisServer, RedisCluster, free_port``.

* :class:`RedisServer` -- one server, by default with the durable config ``ops/redis.conf``
  (``conf=None`` gives Redis's built-in defaults, for negative tests of durability checks).
* :class:`RedisCluster` -- a 3-master Redis Cluster (no replicas), one directory per node.

Every child is launched with ``--daemonize no`` so ``Popen.pid`` is the server itself. Children
are SIGKILLed at interpreter exit (``atexit``) and, on Linux, also when the starting process dies
(``PR_SET_PDEATHSIG``), so a crashed test run leaves no servers behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "CLUSTER_SLOTS",
    "DEFAULT_CONF",
    "REPO_ROOT",
    "RedisCluster",
    "RedisNotInstalledError",
    "RedisServer",
    "RedisStartError",
    "free_port",
    "redis_binary",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONF = REPO_ROOT / "ops" / "redis.conf"
CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000
HOST = "127.0.0.1"

_INSTALL_HINT = "install it with 'apt-get install redis-server' (Debian/Ubuntu)"


class RedisNotInstalledError(RuntimeError):
    """``redis-server`` or ``redis-cli`` is not on PATH."""


class RedisStartError(RuntimeError):
    """A server or cluster did not come up; the message includes the log tail."""


def redis_binary(name: str = "redis-server") -> str:
    """Path of ``redis-server`` / ``redis-cli``; raises :class:`RedisNotInstalledError`."""
    path = shutil.which(name)
    if path is None:
        raise RedisNotInstalledError(f"{name} not found on PATH: {_INSTALL_HINT}")
    return path


# --------------------------------------------------------------------------------------------
# ports

_ports_lock = threading.Lock()
_handed_out: set[int] = set()


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR like redis-server itself: TIME_WAIT leftovers do not count as "in use",
    # a listening socket does.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A currently free TCP port on 127.0.0.1 (kernel-chosen via bind to port 0).

    Never returns the same port twice within this process. With ``cluster_bus=True`` the port
    is also checked so that the cluster bus port ``port + 10000`` is valid and free.
    There is an unavoidable race until the server binds; :meth:`RedisServer.start` retries
    on "Address already in use" when it chose the port itself.
    """
    with _ports_lock:
        for _ in range(500):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((HOST, 0))
                port: int = s.getsockname()[1]
            if port in _handed_out:
                continue
            if cluster_bus:
                bus = port + CLUSTER_BUS_OFFSET
                if bus > 65535 or bus in _handed_out or not _port_is_free(bus):
                    continue
                _handed_out.add(bus)
            _handed_out.add(port)
            return port
    raise RuntimeError("could not find a free port on 127.0.0.1")


# --------------------------------------------------------------------------------------------
# child process bookkeeping

_children: set[subprocess.Popen[bytes]] = set()
_children_lock = threading.Lock()


_owner_pid = os.getpid()


def _kill_children_at_exit() -> None:
    if os.getpid() != _owner_pid:
        return  # a forked child (e.g. an RQ work horse) exiting must not kill our servers
    with _children_lock:
        procs = list(_children)
        _children.clear()
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)


atexit.register(_kill_children_at_exit)


def _pdeathsig_preexec() -> None:  # pragma: no cover - runs in the forked child
    # Linux: SIGKILL the server if the thread that started it dies (e.g. pytest is kill -9'd).
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _preexec_fn() -> Any:
    # PDEATHSIG fires when the *thread* that forked exits, so only use it from the main thread.
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        return _pdeathsig_preexec
    return None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no {path.name})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path.name} is empty)"


def _password_from_args(args: Sequence[str]) -> str | None:
    password: str | None = None
    for i, arg in enumerate(args[:-1]):
        if arg == "--requirepass":
            password = args[i + 1] or None
    return password


def _fast_client(port: int, password: str | None, timeout: float = 2.0) -> redis.Redis:
    return redis.Redis(
        host=HOST,
        port=port,
        password=password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


# --------------------------------------------------------------------------------------------
# single server


class RedisServer:
    """One ``redis-server`` child process.

    Create and start with :meth:`RedisServer.start`. ``url`` never contains the password;
    use :attr:`auth_url` or :meth:`client` for servers started with ``--requirepass``.
    A subclass may set ``new_session = True`` to start the server in a session (and process
    group) of its own, as the chaos test does.
    """

    new_session = False

    def __init__(
        self,
        *,
        dir: Path,
        port: int,
        conf: Path | None,
        extra_args: Sequence[str],
    ) -> None:
        self.dir: Path = Path(dir).resolve()
        self.port: int = port
        self.conf: Path | None = Path(conf).resolve() if conf is not None else None
        self.extra_args: list[str] = list(extra_args)
        self.password: str | None = _password_from_args(self.extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- construction --------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        *,
        dir: Path,
        conf: Path | None = DEFAULT_CONF,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        timeout: float = 10.0,
    ) -> RedisServer:
        """Start a server in ``dir`` and wait until it answers PING and is not loading.

        ``conf``: config file (default ``ops/redis.conf``, the durable config); ``None`` means
        Redis's built-in defaults plus ``--save ""`` (no durability; for negative tests).
        ``port``: ``None`` picks a free one (and retries if it gets taken before the bind).
        ``extra_args``: appended to the command line, e.g. ``["--requirepass", "x"]``.
        """
        cluster = "--cluster-enabled" in extra_args
        attempts = 5 if port is None else 1
        last_error: RedisStartError | None = None
        for _ in range(attempts):
            chosen = port if port is not None else free_port(cluster_bus=cluster)
            server = cls(dir=dir, port=chosen, conf=conf, extra_args=extra_args)
            try:
                server._launch(timeout=timeout)
            except RedisStartError as exc:
                last_error = exc
                if port is None and "Address already in use" in str(exc):
                    continue
                raise
            return server
        assert last_error is not None
        raise last_error

    # -- attributes ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def auth_url(self) -> str:
        """Like :attr:`url`, with the password (if any) embedded."""
        if self.password is None:
            return self.url
        return f"redis://:{self.password}@{HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("server was never started")
        return self._proc.pid

    @property
    def logfile(self) -> Path:
        return self.dir / "redis.log"

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, *, decode_responses: bool = True, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this server (authenticated if it has a password)."""
        return redis.Redis(
            host=HOST,
            port=self.port,
            password=self.password,
            decode_responses=decode_responses,
            **kwargs,
        )

    # -- lifecycle -----------------------------------------------------------------------

    def command(self) -> list[str]:
        """The exact argv used to launch the server."""
        argv = [redis_binary("redis-server")]
        if self.conf is not None:
            argv.append(str(self.conf))
        argv += [
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.dir),
            "--logfile", str(self.logfile),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.conf is None:
            argv += ["--save", ""]
        argv += self.extra_args
        return argv

    def _launch(self, *, timeout: float) -> None:
        if self.is_running():
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.dir.mkdir(parents=True, exist_ok=True)
        stderr_path = self.dir / "redis.stderr"
        with stderr_path.open("ab") as stderr:
            proc = subprocess.Popen(
                self.command(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                preexec_fn=_preexec_fn(),
                start_new_session=self.new_session,
            )
        with _children_lock:
            _children.add(proc)
        self._proc = proc
        try:
            self._wait_ready(timeout)
        except BaseException:
            self._hard_stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        last: str = "no answer yet"
        client = _fast_client(self.port, self.password, timeout=1.0)
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise RedisStartError(self._failure(f"exited with code {code}"))
                try:
                    if client.ping():
                        info = client.info("persistence")
                        if int(info.get("loading", 0)) == 0:
                            return
                        last = "still loading the dataset"
                except redis.exceptions.BusyLoadingError:
                    last = "still loading the dataset"
                except redis.exceptions.AuthenticationError as exc:
                    raise RedisStartError(self._failure(f"authentication failed: {exc}")) from exc
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    last = str(exc)
                if time.monotonic() > deadline:
                    raise RedisStartError(self._failure(f"not ready after {timeout:.0f}s ({last})"))
                time.sleep(0.02)
        finally:
            client.close()

    def _failure(self, what: str) -> str:
        return (
            f"redis-server on {HOST}:{self.port} (dir {self.dir}) {what}\n"
            f"command: {' '.join(repr(a) if a == '' else a for a in self.command())}\n"
            f"--- tail of {self.logfile} ---\n{_tail(self.logfile)}\n"
            f"--- tail of {self.dir / 'redis.stderr'} ---\n{_tail(self.dir / 'redis.stderr')}"
        )

    def _wait_exit(self, timeout: float) -> bool:
        assert self._proc is not None
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        with _children_lock:
            _children.discard(self._proc)
        return True

    def _hard_stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.kill()
        self._wait_exit(10)

    def _terminate(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.terminate()

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown (SIGTERM: the same path as SHUTDOWN, fsyncs the AOF) and wait.

        Falls back to SIGKILL after ``timeout`` seconds. No-op if not running.
        """
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._terminate()
            if self._wait_exit(timeout):
                return
        self._hard_stop()

    def kill9(self) -> None:
        """SIGKILL the server (simulated crash) and wait until the process is gone."""
        if self._proc is None:
            raise RuntimeError("server was never started")
        self._hard_stop()

    def restart(self, timeout: float = 30.0) -> None:
        """Start again on the same dir, port and config; the data comes back from the AOF.

        If the server is still running it is first stopped gracefully (use :meth:`kill9`
        before this to simulate a crash). Waits until PING answers and ``loading:0``.
        """
        if self.is_running():
            self.stop()
        self._launch(timeout=timeout)

    def flushall(self) -> None:
        """FLUSHALL plus FUNCTION FLUSH and SCRIPT FLUSH: an empty server for the next test."""
        client = _fast_client(self.port, self.password, timeout=10.0)
        try:
            client.flushall()
            client.function_flush()
            client.script_flush()
        finally:
            client.close()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self._proc.pid}" if self.is_running() and self._proc else "stopped"
        return f"<RedisServer {self.url} {state} dir={self.dir}>"


# --------------------------------------------------------------------------------------------
# cluster


class RedisCluster:
    """A Redis Cluster of ``masters`` masters (default 3) and no replicas, one dir per node.

    Create and start with :meth:`RedisCluster.start`. ``url`` has the form
    ``redis+cluster://127.0.0.1:<first port>``.
    """

    def __init__(self, *, dir: Path, nodes: list[RedisServer]) -> None:
        self.dir: Path = Path(dir).resolve()
        self.nodes: list[RedisServer] = nodes
        self.masters = len(nodes)
        self.replicas = 0

    @classmethod
    def start(
        cls,
        *,
        dir: Path,
        conf: Path | None = DEFAULT_CONF,
        masters: int = 3,
        replicas: int = 0,
        extra_args: Sequence[str] = (),
        timeout: float = 30.0,
    ) -> RedisCluster:
        """Start ``masters * (1 + replicas)`` nodes under ``dir/node<i>/``, create the cluster
        (``replicas`` replicas per master), wait until ready."""
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        redis_binary("redis-cli")
        dir = Path(dir).resolve()
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "5000",
            *extra_args,
        ]  # fmt: skip
        nodes: list[RedisServer] = []
        cluster = cls(dir=dir, nodes=nodes)
        cluster.masters = masters
        cluster.replicas = replicas
        try:
            for i in range(masters * (1 + replicas)):
                # port=None: a free port whose bus port (+10000) is free too, retried on a race
                nodes.append(RedisServer.start(dir=dir / f"node{i}", conf=conf, extra_args=args))
            cluster._create(timeout)
            cluster.wait_ready(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    # -- attributes ----------------------------------------------------------------------

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    @property
    def password(self) -> str | None:
        return self.nodes[0].password

    def client(self, *, decode_responses: bool = True, **kwargs: Any) -> redis.RedisCluster:
        """A ``redis.RedisCluster`` client knowing all nodes."""
        return redis.RedisCluster(
            host=HOST,
            port=self.nodes[0].port,
            password=self.password,
            decode_responses=decode_responses,
            **kwargs,
        )

    # -- lifecycle -----------------------------------------------------------------------

    def _create(self, timeout: float) -> None:
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password
        argv = [
            redis_binary("redis-cli"),
            "--cluster", "create",
            *(f"{HOST}:{p}" for p in self.ports),
            "--cluster-replicas", str(self.replicas),
            "--cluster-yes",
        ]  # fmt: skip
        try:
            res = subprocess.run(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=max(timeout, 30.0),
            )
        except subprocess.TimeoutExpired as exc:
            raise RedisStartError(f"{' '.join(argv)} timed out\n{self._logs()}") from exc
        if res.returncode != 0 or "[OK] All 16384 slots covered" not in res.stdout:
            raise RedisStartError(
                f"{' '.join(argv)} failed (exit {res.returncode})\n"
                f"--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-3000:]}\n"
                f"{self._logs()}"
            )

    def _logs(self) -> str:
        return "\n".join(f"--- tail of {n.logfile} ---\n{_tail(n.logfile, 15)}" for n in self.nodes)

    def _node_view(self, node: RedisServer) -> tuple[str, tuple[tuple[int, int, int], ...]] | str:
        """(cluster_state, sorted slot ranges with master port) as seen by ``node``, or an error."""
        client = _fast_client(node.port, node.password, timeout=1.0)
        try:
            info_raw = client.cluster("INFO")
            slots_raw = client.cluster("SLOTS")
        except redis.exceptions.RedisError as exc:
            return f"{node.port}: {exc}"
        finally:
            client.close()
        if isinstance(info_raw, dict):
            info = {str(k): str(v) for k, v in info_raw.items()}
        else:
            text = str(info_raw)
            info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(info.get("cluster_known_nodes", "0")) != len(self.nodes):
            return f"{node.port}: knows {info.get('cluster_known_nodes')} nodes"
        # CLUSTER SLOTS rows: [start, end, [host, port, id, ...], replicas...]
        ranges = sorted((int(row[0]), int(row[1]), int(row[2][1])) for row in slots_raw)
        return info.get("cluster_state", "?").strip(), tuple(ranges)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll until every node says ``cluster_state:ok``, all nodes report the same slot map,
        and that map covers all 16384 slots with each node owning some. Also used after a
        node restart."""
        deadline = time.monotonic() + timeout
        while True:
            views = [self._node_view(n) for n in self.nodes]
            problem = self._check_views(views)
            if problem is None:
                return
            for node in self.nodes:
                if not node.is_running():
                    raise RedisStartError(
                        f"cluster node {node.port} is not running\n{self._logs()}"
                    )
            if time.monotonic() > deadline:
                raise RedisStartError(
                    f"cluster not ready after {timeout:.0f}s: {problem}\n{self._logs()}"
                )
            time.sleep(0.05)

    def _check_views(
        self, views: list[tuple[str, tuple[tuple[int, int, int], ...]] | str]
    ) -> str | None:
        first: tuple[tuple[int, int, int], ...] | None = None
        for view in views:
            if isinstance(view, str):
                return view
            state, ranges = view
            if state != "ok":
                return f"cluster_state:{state}"
            if first is None:
                first = ranges
            elif ranges != first:
                return "nodes disagree on the slot map"
        assert first is not None
        covered = sum(end - start + 1 for start, end, _ in first)
        if covered != CLUSTER_SLOTS:
            return f"{covered} of {CLUSTER_SLOTS} slots covered"
        owners = {port for _, _, port in first}
        if len(owners) != self.masters or not owners <= set(self.ports):
            return f"slot owners {sorted(owners)}: expected {self.masters} of {self.ports}"
        return None

    def master_of_slot(self, slot: int) -> RedisServer:
        """The node serving ``slot`` now (as the first node that answers sees it)."""
        for node in self.nodes:
            view = self._node_view(node)
            if isinstance(view, str):
                continue
            for start, end, port in view[1]:
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == port)
        raise RedisStartError(f"no node serves slot {slot}")

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A replica of ``master`` (the cluster must have replicas)."""
        for node in self.nodes:
            if node is master:
                continue
            info = _fast_client(node.port, node.password).info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
                return node
        raise RedisStartError(f"no replica of {master.port}")

    def flushall(self) -> None:
        """FLUSHALL + FUNCTION FLUSH + SCRIPT FLUSH on every master."""
        for node in self.nodes:
            if self.replicas and _fast_client(node.port, node.password).info(
                    "replication").get("role") != "master":
                continue
            node.flushall()

    def stop(self) -> None:
        """Gracefully stop every node (SIGKILL fallback)."""
        for node in self.nodes:  # signal all first so they shut down in parallel
            node._terminate()
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<RedisCluster {self.url} ports={self.ports}>"
