"""Prometheus metrics: every definition, the endpoint, and how forked processes report.

Off unless a process asks (``--metrics-port`` on ``controller`` and ``worker``, or the
``web`` command calling `serve_metrics` / `asgi_app`): until `enable` is called every
recording function below is one test of a module global, so the engine's hot paths pay
nothing when metrics are off and a few microseconds when they are on.

Forked processes. A forking worker executes each delivery in a work-horse, and ``--pool N``
in N executor processes; what they count must reach the worker's one endpoint. They use
prometheus-client's multiprocess mode: every process writes its values to memory-mapped
files in one directory (``PROMETHEUS_MULTIPROC_DIR``), and the endpoint, served by the
worker's parent (the supervisor with ``--pool``), sums the files of all of them at scrape
time. Values survive the process that wrote them (a horse killed -9 loses nothing it
wrote), so nothing is sent to the parent and nothing is lost with a child.

The files are named after a process *identity*, not its pid: a horse writes as
``horse-<worker pid>`` and an executor as ``pool-<supervisor pid>-<slot>``. Horses of one
worker run one at a time, and an executor's slot is refilled only after its previous
process was reaped, so one identity never has two live writers, and a new horse (or a
restarted executor) takes over its predecessor's file and counts on from its values. With
pids, a forking worker would leave one set of files per delivery (40 a second at full
speed) and every scrape would read them all. No metric uses a live gauge mode, so there is
nothing for `mark_process_dead` to remove.

The directory is a new private one (mkdtemp: a random name, mode 0700, so no other local
user can plant it or take its name first) named ``marbles-rq-metrics.<uid>.<bind>.<port>.*``
in /dev/shm (under ``MARBLES_METRICS_DIR`` if set; in the temp directory where /dev/shm is
missing or not writable), made when the endpoint starts; after its port is bound, the
endpoint removes the directories earlier holders of that port left (its own user's only).
A restarted worker therefore starts its counters at zero, which Prometheus reads as a
counter reset, as for any restarted process.

Labels are low-cardinality by design: workflow, queue, status, outcome, cause, kind;
never a run id or a step key. Workflow and queue names come from whoever enqueues, so
their values are bounded here: a workflow the process's registry does not know, an
invalid queue name, and any name beyond the first MAX_LABEL_VALUES of a label are counted
as ``_other``.

The endpoint is one thread that waits on every open connection with a selector and hands a
connection whose request has arrived to a small pool (METRICS_THREADS): an idle or slow
client costs a file descriptor, not a thread, is closed after REQUEST_TIMEOUT_S, and at most
MAX_CONNECTIONS are open at once (the longest-waiting goes first).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import selectors
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from .errors import ConfigError, RedisUnavailableError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Histogram

# prometheus_client is imported only by `enable` and the endpoint (it costs ~70 ms): every
# command imports this module through the engine, and most never turn metrics on.

PORT_ENV, BIND_ENV = "MARBLES_METRICS_PORT", "MARBLES_METRICS_BIND"
DIR_ENV = "MARBLES_METRICS_DIR"  # where a worker's multiprocess files go (see _base_dirs)
DEFAULT_BIND = "127.0.0.1"
SCRAPE_TIMEOUT_S = 1.0  # the controller's scrape-time reads of Redis give up after this

# Buckets, in seconds. Steps are user code (milliseconds to an hour); a run lasts from its
# enqueue to its settle, waits included (up to days); a controller pass is milliseconds;
# lateness is what a timer or a schedule fires after its due time.
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 300.0, 900.0, 3600.0)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
               3600.0, 21600.0, 86400.0, 604800.0)
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 300.0)

MAX_LABEL_VALUES = 100  # distinct workflow (or queue) names one process reports
OTHER = "_other"
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # engine.authoring.QUEUE_PATTERN

REDELIVERY_CAUSES = ("lease_expired", "worker_lost", "delivery_lost", "delivery_failed",
                     "not_in_rq")
LEASE_OUTCOMES = ("redelivered", "cancelled", "gave_up")
REDIS_ERROR_KINDS = ("timeout", "connection", "oom", "readonly", "other")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")
STEP_OUTCOMES = ("succeeded", "retried", "failed")


class Metrics:
    """Every metric of marbles-rq (README, "Metrics"). Built by `enable`, once per process
    tree; `registry` is None in multiprocess mode (the endpoint reads the files instead)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        from prometheus_client import Counter, Histogram

        def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
            return Counter(name, doc, list(labels), registry=registry)

        def histogram(name: str, doc: str, labels: Iterable[str],
                      buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=registry)

        self.runs_enqueued = counter(
            "marbles_rq_runs_enqueued_total", "Runs recorded by this process (a repeated id "
            "that found its run is not counted).", ["workflow", "queue"])
        self.runs_started = counter(
            "marbles_rq_runs_started_total", "Executions started, by kind: first (a run's "
            "first execution), redelivery (one that replaced a vanished execution), "
            "resumption (after a wait), handback (after a worker handed it back).",
            ["workflow", "kind"])
        self.runs_finished = counter(
            "marbles_rq_runs_finished_total", "Runs settled by a worker, by final status "
            "(succeeded, failed, cancelled).", ["workflow", "status"])
        self.run_seconds = histogram(
            "marbles_rq_run_duration_seconds", "From a run's enqueue to its settle (queueing, "
            "waits and redeliveries included), by final status.", ["workflow", "status"],
            RUN_BUCKETS)
        self.step_seconds = histogram(
            "marbles_rq_step_duration_seconds", "One try of a step's function (a replayed "
            "step is not a try), by outcome (succeeded, retried, failed).",
            ["workflow", "outcome"], STEP_BUCKETS)
        self.redeliveries = counter(
            "marbles_rq_redeliveries_total", "Deliveries the controller enqueued again, by "
            "cause: lease_expired, worker_lost, delivery_lost (popped, never started), "
            "delivery_failed (refused by a worker), not_in_rq (recorded, missing in RQ).",
            ["queue", "cause"])
        self.lease_expirations = counter(
            "marbles_rq_lease_expirations_total", "Execution leases the controller found "
            "expired, by what it did: redelivered, cancelled, gave_up.", ["outcome"])
        self.horse_deaths = counter(
            "marbles_rq_horse_deaths_total", "Work-horses that died before reporting their "
            "delivery's outcome (killed, crashed).")
        self.pass_seconds = histogram(
            "marbles_rq_controller_pass_seconds", "One pass of the elected controller "
            "(reaping, lost workers, dispatch checks, lost deliveries, retention, duties).",
            (), PASS_BUCKETS)
        self.schedule_lateness = histogram(
            "marbles_rq_schedule_lateness_seconds", "How long after its nominal time a "
            "schedule occurrence was fired (server clock).", ["workflow"], LATENESS_BUCKETS)
        self.timer_lateness = histogram(
            "marbles_rq_timer_lateness_seconds", "How long after its due time a sleeping run "
            "was woken (server clock).", (), LATENESS_BUCKETS)
        self.step_retries_parked = counter(
            "marbles_rq_step_retries_parked_total", "Failed step tries whose next try waits on "
            "a durable timer (the run parked, reason retry, no worker held).", ["workflow"])
        self.steps_paused = counter(
            "marbles_rq_steps_paused_total", "Steps whose tries ran out and that paused their "
            "run (on_exhausted=\"pause\"; reason failed_step).", ["workflow"])
        self.notices = counter(
            "marbles_rq_pause_notices_total", "Pause notifications POSTed to MARBLES_NOTIFY_URL, "
            "by outcome: delivered, retried (a try failed), dropped (out of tries).",
            ["outcome"])
        self.rate_admissions = counter(
            "marbles_rq_rate_admissions_total", "Runs a rate limit let through, by limit (a "
            "workflow's limit per key counts under the workflow's name).", ["limit"])
        self.rate_waits = counter(
            "marbles_rq_rate_waits_total", "Times a rate limit held a run (it parked until its "
            "turn; a run woken early and parked again counts again), by limit.", ["limit"])
        self.redis_errors = counter(
            "marbles_rq_redis_errors_total", "Redis errors met, by kind (timeout, connection, "
            "oom, readonly, other); a resent script call counts each failed send.", ["kind"])
        self.events_batched = counter(
            "marbles_rq_events_batched_total", "Inbound events appended to a batch of their "
            "trigger (each once).", ["workflow"])
        self.batches_sealed = counter(
            "marbles_rq_batches_sealed_total", "Event batches sealed, by what sealed them: "
            "size (full), bytes (the next event would pass the input limit), time (max_wait "
            "ended).", ["workflow", "by"])


_M: Metrics | None = None
_REGISTRY: CollectorRegistry | None = None
_LOCK = threading.Lock()
# (metric name, label values) -> child: a dict lookup instead of `labels()`, which locks
# and validates its arguments at every call (~3 us). Races only create a child twice.
_CHILDREN: dict[tuple[str, ...], Any] = {}
_FORK_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_FORK_LOCK.acquire, after_in_parent=_FORK_LOCK.release,
                        after_in_child=_FORK_LOCK.release)


def _child(metric: Any, *labels: str) -> Any:
    key = (metric._name, *labels)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*labels)
    return child


def enabled() -> bool:
    return _M is not None


_LABELS: dict[str, set[str]] = {"workflow": set(), "queue": set(), "limit": set(),
                                 "lock": set()}
# The workflows this process defines, as the engine's registry lists them (it installs
# itself with `know_workflows`; this module sits below the engine and never imports it).
# While none are known, any name is a label.
_known_workflows: Callable[[], Collection[str]] = tuple


def know_workflows(names: Callable[[], Collection[str]]) -> None:
    global _known_workflows
    _known_workflows = names


def bounded(kind: str, value: str) -> str:
    """`value` as a label of `kind` (workflow, queue), or OTHER: names come from enqueuers,
    and each distinct one would be a series of every metric it labels, for ever."""
    seen = _LABELS[kind]
    if value in seen:
        return value
    with _LOCK:
        if kind == "workflow":
            known = _known_workflows()
            if known and value not in known:
                return OTHER
        elif kind == "queue" and not _QUEUE_NAME.fullmatch(value):
            return OTHER
        if len(seen) >= MAX_LABEL_VALUES:
            return OTHER
        seen.add(value)
        return value


# -- recording (each a no-op while metrics are off) --------------------------------------------


def start_at_zero(workflows: Iterable[tuple[str, str]]) -> None:
    """Create every labelled series this process can count, at 0, for `workflows` ((name,
    queue) pairs: what the process's sources define): a rate or an increase over a series
    that appears only at its first count misses that count, and an alert on it has no
    series to look at until then."""
    m = _M
    if m is None:
        return
    for kind in REDIS_ERROR_KINDS:
        _child(m.redis_errors, kind)
    for outcome in LEASE_OUTCOMES:
        m.lease_expirations.labels(outcome)
    queues: set[str] = set()
    for name, queue in workflows:
        workflow, queue = bounded("workflow", name), bounded("queue", queue)
        queues.add(queue)
        _child(m.runs_enqueued, workflow, queue)
        for kind in sorted(START_KINDS):
            _child(m.runs_started, workflow, kind)
        for status in FINAL_STATUSES:
            _child(m.runs_finished, workflow, status)
            _child(m.run_seconds, workflow, status)
        for outcome in STEP_OUTCOMES:
            _child(m.step_seconds, workflow, outcome)
        m.schedule_lateness.labels(workflow)
    for queue in sorted(queues):
        for cause in REDELIVERY_CAUSES:
            m.redeliveries.labels(queue, cause)


def run_enqueued(workflow: str, queue: str) -> None:
    if _M is not None:
        _child(_M.runs_enqueued, bounded("workflow", workflow), bounded("queue", queue)).inc()


# What made an execution (start_attempt's reply); anything else is counted as "other".
START_KINDS = frozenset({"first", "redelivery", "resumption", "handback"})


def run_started(workflow: str, kind: str = "first") -> None:
    if _M is not None:
        _child(_M.runs_started, bounded("workflow", workflow),
               kind if kind in START_KINDS else "other").inc()


def run_finished(workflow: str, status: str, seconds: float) -> None:
    if _M is not None:
        workflow = bounded("workflow", workflow)
        _child(_M.runs_finished, workflow, status).inc()
        _child(_M.run_seconds, workflow, status).observe(max(0.0, seconds))


def step_tried(workflow: str, outcome: str, seconds: float) -> None:
    if _M is not None:
        _child(_M.step_seconds, bounded("workflow", workflow), outcome).observe(seconds)


def step_retry_parked(workflow: str) -> None:
    """A failed step's next try is a durable timer (the run parked, reason retry)."""
    if _M is not None:
        _M.step_retries_parked.labels(bounded("workflow", workflow)).inc()


def step_paused(workflow: str) -> None:
    """A step's tries ran out and it pauses its run (reason failed_step)."""
    if _M is not None:
        _M.steps_paused.labels(bounded("workflow", workflow)).inc()


def notice_outcome(outcome: str) -> None:
    """A pause notification (MARBLES_NOTIFY_URL): delivered | retried | dropped."""
    if _M is not None:
        _M.notices.labels(outcome).inc()


def redelivered(queue: str, cause: str) -> None:
    if _M is not None:
        _M.redeliveries.labels(bounded("queue", queue), cause).inc()


def redelivered_many(queue: str, cause: str, count: int) -> None:
    if _M is not None and count:
        _M.redeliveries.labels(bounded("queue", queue), cause).inc(count)


def lease_expired(outcome: str) -> None:
    if _M is not None:
        _M.lease_expirations.labels(outcome).inc()


def horse_died() -> None:
    if _M is not None:
        _M.horse_deaths.inc()


def controller_pass(seconds: float) -> None:
    if _M is not None:
        _M.pass_seconds.observe(seconds)


def schedule_late(workflow: str, seconds: float) -> None:
    if _M is not None:
        _M.schedule_lateness.labels(bounded("workflow", workflow)).observe(max(0.0, seconds))


def timer_late(seconds: float) -> None:
    if _M is not None:
        _M.timer_lateness.observe(max(0.0, seconds))


def rate_admitted(family: str) -> None:
    if _M is not None:
        _child(_M.rate_admissions, bounded("limit", family)).inc()


def rate_held(family: str) -> None:
    if _M is not None:
        _child(_M.rate_waits, bounded("limit", family)).inc()


def redis_error_kind(exc: BaseException) -> str:
    """timeout | connection | oom | readonly | other. (redis-py turns some error codes into
    classes and strips the code from the message; others keep it as the first word.)"""
    if isinstance(exc, redis.TimeoutError):
        return "timeout"
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "oom"
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "readonly"
    if isinstance(exc, redis.ConnectionError | RedisUnavailableError):  # LOADING is one too
        return "connection"
    text = str(exc)
    if text.startswith("OOM"):
        return "oom"
    if text.startswith("READONLY"):
        return "readonly"
    return "other"


def redis_error(exc: BaseException) -> None:
    """Count a Redis error once, however many handlers it passes through on its way up
    (a script call counts it, then the worker's or controller's loop sees it again)."""
    if _M is None:
        return
    for seen in (exc, exc.__cause__):  # a wrapper (RedisUnavailableError) of a counted one
        if seen is not None and getattr(seen, "_marbles_counted", False):
            return
    with contextlib.suppress(AttributeError):
        exc._marbles_counted = True  # type: ignore[attr-defined]
    # The one metric a background thread records in a process that forks (a forking
    # worker's liveness thread): a fork while that thread held prometheus-client's value
    # lock would leave the horse's copy locked forever. Forks wait for this lock instead.
    with _FORK_LOCK:
        _child(_M.redis_errors, redis_error_kind(exc)).inc()


# -- turning metrics on --------------------------------------------------------------------------


_IDENTITY: tuple[int, str] | None = None  # (pid, identity) of a named process


def _process_identity() -> str:
    """The name of this process's files in multiprocess mode (see the module's docstring).
    A process nobody named (a fork we do not know of) writes under its pid."""
    pid = os.getpid()
    named = _IDENTITY
    return named[1] if named is not None and named[0] == pid else str(pid)


def name_process(identity: str) -> None:
    """Call first thing in a forked child that records metrics (a horse, an executor): its
    values go to the files of `identity`, which it takes over from a dead predecessor."""
    global _IDENTITY
    _IDENTITY = (os.getpid(), identity)
    _close_inherited_listener()


def enable(*, multiprocess_dir: Path | None = None) -> CollectorRegistry:
    """Build every metric (once) and return the registry an endpoint serves. With
    `multiprocess_dir`, values live in files there (forked children count too); the
    directory must exist and be empty."""
    global _M, _REGISTRY
    with _LOCK:
        if _REGISTRY is not None:
            return _REGISTRY
        from prometheus_client import CollectorRegistry, disable_created_metrics, values

        disable_created_metrics()  # type: ignore[no-untyped-call]  # `_created`: scrape noise
        registry = CollectorRegistry(auto_describe=True)
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess

            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(multiprocess_dir)
            values.ValueClass = values.MultiProcessValue(  # type: ignore[no-untyped-call]
                process_identifier=_process_identity)
            multiprocess.MultiProcessCollector(  # type: ignore[no-untyped-call]
                registry, path=str(multiprocess_dir))
            _M = Metrics(None)
        else:
            # In-process values, whatever PROMETHEUS_MULTIPROC_DIR the environment has.
            values.ValueClass = values.MutexValue
            from prometheus_client import ProcessCollector

            ProcessCollector(registry=registry)
            _M = Metrics(registry)
        _REGISTRY = registry
        return registry


def registry() -> CollectorRegistry:
    """The registry an endpoint serves (enabling metrics in-process if nobody did)."""
    return _REGISTRY if _REGISTRY is not None else enable()


def add_collector(collector: Any) -> None:
    """Register a scrape-time collector (the controller's queue depths) with the endpoint."""
    registry().register(collector)


def asgi_app() -> Callable[..., Any]:
    """An ASGI app answering scrapes, for an ASGI server to mount (the web dashboard:
    ``app.mount("/metrics", metrics.asgi_app())``)."""
    from prometheus_client import make_asgi_app

    return make_asgi_app(registry())


# -- the endpoint --------------------------------------------------------------------------------


@dataclass
class MetricsServer:
    bind: str
    port: int
    server: Any
    thread: threading.Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_SERVER: MetricsServer | None = None


def _close_inherited_listener() -> None:
    """A forked child must not keep the parent's listening socket open: after the parent
    dies, a child that outlived it would hold the port and its successor could not bind."""
    global _SERVER
    if _SERVER is not None:
        _SERVER.server.close_in_child()
        _SERVER = None


MAX_CONNECTIONS = 64
METRICS_THREADS = 4
REQUEST_TIMEOUT_S = 5.0  # a request's line and headers, and the reply's sending


class BoundedWSGIServer:
    """The endpoint's HTTP server (see the module's docstring): wsgiref's request handling,
    without its thread per connection."""

    def __init__(self, sock: socket.socket) -> None:
        from wsgiref.simple_server import WSGIRequestHandler

        class Handler(WSGIRequestHandler):
            def setup(self) -> None:
                self.connection = self.request
                # The request line and headers were read already (no body is read).
                self.rfile = io.BytesIO(server.pending_heads.pop(self.request, b""))
                self.wfile = self.connection.makefile("wb", buffering=0)

            def log_message(self, format: str, *args: Any) -> None:  # a scrape is not news
                pass

        server = self
        self.socket = sock
        self.handler = Handler
        self.app: Callable[..., Any] = lambda env, start: []
        self.server_name = socket.getfqdn(sock.getsockname()[0])
        self.server_port = sock.getsockname()[1]
        self.base_environ: dict[str, Any] = {}
        self.pending_heads: dict[socket.socket, bytes] = {}
        self._waiting: dict[socket.socket, tuple[float, bytearray, Any]] = {}
        self._answering: set[socket.socket] = set()
        self._busy = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(METRICS_THREADS, thread_name_prefix="marbles-metrics")
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._setup_environ()

    # What wsgiref's handler asks of its server.
    def _setup_environ(self) -> None:
        env = self.base_environ
        env["SERVER_NAME"] = self.server_name
        env["GATEWAY_INTERFACE"] = "CGI/1.1"
        env["SERVER_PORT"] = str(self.server_port)
        env["REMOTE_HOST"] = ""
        env["CONTENT_LENGTH"] = ""
        env["SCRIPT_NAME"] = ""

    def get_app(self) -> Callable[..., Any]:
        return self.app

    def set_app(self, app: Callable[..., Any]) -> None:
        self.app = app

    def serve_forever(self) -> None:
        self.socket.setblocking(False)
        self._selector.register(self.socket, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                try:
                    ready = self._selector.select(timeout=0.25)
                except OSError:  # the listener closed under us (server_close, a fork)
                    return
                for key, _ in ready:
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn, (deadline, _, _) in list(self._waiting.items()):
                    if deadline <= now:
                        self._drop(conn)
        finally:
            self._stopped.set()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            with self._lock:
                open_now = len(self._waiting) + self._busy
            if open_now >= MAX_CONNECTIONS:
                if not self._waiting:
                    conn.close()  # every slot is answering: this one waits for none
                    continue
                self._drop(next(iter(self._waiting)))  # the longest-waiting goes
            conn.setblocking(False)
            self._waiting[conn] = (time.monotonic() + REQUEST_TIMEOUT_S, bytearray(), addr)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        entry = self._waiting.get(conn)
        if entry is None:
            return  # dropped by an accept earlier in the same batch of events
        _, head, addr = entry
        try:
            chunk = conn.recv(8192)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        head += chunk
        if b"\r\n\r\n" not in head and b"\n\n" not in head:
            if len(head) > 16384:
                self._drop(conn)
            return
        self._selector.unregister(conn)
        del self._waiting[conn]
        with self._lock:
            self._busy += 1
            self._answering.add(conn)
        self.pending_heads[conn] = bytes(head)
        self._pool.submit(self._answer, conn, addr)

    def _answer(self, conn: socket.socket, addr: Any) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(REQUEST_TIMEOUT_S)  # a client that does not read its reply
            self.handler(conn, addr, self)  # type: ignore[arg-type]
        except Exception:  # a broken connection is the client's loss
            pass
        finally:
            self.pending_heads.pop(conn, None)
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._busy -= 1
                self._answering.discard(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._waiting.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def close_in_child(self) -> None:
        """In a forked child: close its copies of the listener and of every connection,
        so that none outlives the parent's close (the selector is left alone: it is the
        parent's, shared)."""
        # No lock: a thread of the parent may have held it at the fork (and is not here).
        for sock in [self.socket, *self._waiting, *self._answering]:
            with contextlib.suppress(OSError):
                sock.close()

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait(5)

    def server_close(self) -> None:
        for conn in list(self._waiting):
            self._drop(conn)
        with contextlib.suppress(OSError):
            self.socket.close()
        self._pool.shutdown(wait=False)


def bind_endpoint(port: int, bind: str = DEFAULT_BIND) -> BoundedWSGIServer:
    """Bind the endpoint's socket, or raise ConfigError naming why (one line; exit 2)."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"--metrics-port {port}: expected 1..65535")
    try:
        # IPv4 or IPv6, as the address is (what prometheus-client's own server does).
        family, _, _, _, sockaddr = socket.getaddrinfo(
            bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((str(sockaddr[0]), port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(f"--metrics-port {port}: cannot listen on {bind}:{port} ({why})"
                          ) from None
    # The app is set once the registry exists (after the port is known to be ours).
    return BoundedWSGIServer(sock)


def serve_metrics(port: int, bind: str = DEFAULT_BIND, *,
                  multiprocess: bool = False) -> MetricsServer:
    """Serve /metrics on bind:port from a daemon thread and turn metrics on. With
    `multiprocess` (a worker: forked horses or executors), values go through files in
    this endpoint's own directory, emptied now. Raises ConfigError (exit 2) when the port
    cannot be bound."""
    global _SERVER
    from prometheus_client import make_wsgi_app

    httpd = bind_endpoint(port, bind)
    try:
        directory = multiprocess_dir(bind, port) if multiprocess else None
        reg = enable(multiprocess_dir=directory)
    except BaseException:
        httpd.server_close()
        raise
    httpd.set_app(make_wsgi_app(reg))
    thread = threading.Thread(target=httpd.serve_forever, name="marbles-metrics", daemon=True)
    thread.start()
    _SERVER = MetricsServer(bind, port, httpd, thread)
    return _SERVER


def _base_dirs() -> list[Path]:
    """Where multiprocess files may go, best first: MARBLES_METRICS_DIR if set; else memory
    (/dev/shm, a tmpfs: a value written to a file on disk costs a page fault after each
    writeback, measured at several microseconds a write), then the temp directory."""
    given = os.environ.get(DIR_ENV)
    if given:
        return [Path(given)]
    shm = Path("/dev/shm")
    return [shm, Path(tempfile.gettempdir())] if shm.is_dir() else [
        Path(tempfile.gettempdir())]


def multiprocess_dir(bind: str, port: int) -> Path:
    """A new private directory (0700, a random name) for this endpoint's multiprocess
    files. A predictable name would let another local user take it first (a directory of
    theirs, or a link) and stop the endpoint from starting, or read what it counts. The
    caller holds the port: what earlier holders of it left behind is removed."""
    safe = re.sub(r"[^A-Za-z0-9.-]", "_", bind)
    prefix = f"marbles-rq-metrics.{os.getuid()}.{safe}.{port}."
    bases = _base_dirs()
    for i, base in enumerate(bases):
        try:
            path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        except OSError as exc:  # not writable here (a hardened unit): the next base
            if i + 1 < len(bases):
                continue
            raise ConfigError(f"cannot create a directory in {base} for metrics files: "
                              f"{exc}") from None
        break
    _remove_stale(path.parent, prefix, keep=path)
    owner = os.getpid()

    def remove() -> None:  # at a clean exit of the endpoint's process, not of a fork of it
        if os.getpid() == owner:
            with contextlib.suppress(OSError):
                _empty(path)
                path.rmdir()

    atexit.register(remove)
    return path


def _remove_stale(base: Path, prefix: str, keep: Path) -> None:
    """The directories of this port that a killed endpoint left: ours (not a link, not
    another user's), their files removed, then themselves."""
    with contextlib.suppress(OSError):
        for entry in base.iterdir():
            if not entry.name.startswith(prefix) or entry == keep:
                continue
            with contextlib.suppress(OSError):
                info = os.lstat(entry)
                if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
                    _empty(entry)
                    entry.rmdir()


def _empty(path: Path) -> None:
    for entry in path.iterdir():
        if entry.suffix == ".db":
            entry.unlink()


# -- scrape-time gauges (the controller) --------------------------------------------------------


class StoreGauges:
    """Queue depths, waiting runs, open questions, live workers per lane, read from Redis when
    scraped (and the lanes this controller leads, from its memory): one pipelined read of
    each Redis, on connections of their own that give up after SCRAPE_TIMEOUT_S (a slow
    Redis costs the scrape its gauges, never the controller's loop a stall). A failed read
    is counted in marbles_rq_redis_errors_total and its gauges are left out."""

    def __init__(self, read_queues: Callable[[], dict[tuple[str, str], tuple[int, int]]],
                 read_waiting: Callable[[], tuple[int, int, float]],
                 read_workers: Callable[[], dict[int, int]] | None = None,
                 leading: Callable[[], tuple[int, Collection[int]]] | None = None,
                 read_memory: Callable[[], list[tuple[str, int, int]]] | None = None) -> None:
        self.read_queues, self.read_waiting = read_queues, read_waiting
        self.read_workers, self.leading = read_workers, leading
        self.read_memory = read_memory

    def describe(self) -> list[Any]:
        return []  # collected only when scraped, never at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            queues = self.read_queues()
        except redis.RedisError as exc:
            redis_error(exc)
        else:
            depth = GaugeMetricFamily(
                "marbles_rq_queue_depth", "Deliveries waiting in an RQ queue of this "
                "deployment, per lane (the queue list's length).", labels=["queue", "lane"])
            flight = GaugeMetricFamily(
                "marbles_rq_queue_in_flight", "Deliveries a worker popped from the queue and "
                "has not completed (the queue's intermediate list).", labels=["queue", "lane"])
            summed: dict[tuple[str, str], tuple[int, int]] = {}
            for (name, lane), (queued, popped) in sorted(queues.items()):
                label = (bounded("queue", name), lane)
                was = summed.get(label, (0, 0))
                summed[label] = (was[0] + queued, was[1] + popped)
            for (name, lane), (queued, popped) in summed.items():
                depth.add_metric([name, lane], queued)
                flight.add_metric([name, lane], popped)
            yield depth
            yield flight
        if self.leading is not None:
            lanes, led = self.leading()
            leader = GaugeMetricFamily(
                "marbles_rq_lane_leader", "1 for each lane this controller process leads, 0 "
                "for the others: summed over the controllers, 1 per lane (0: nobody leads "
                "it; its runs are not redelivered, woken or dispatched).", labels=["lane"])
            for index in range(lanes):
                leader.add_metric([str(index)], 1 if index in led else 0)
            yield leader
        if self.read_workers is not None:
            try:
                workers = self.read_workers()
            except redis.RedisError as exc:
                redis_error(exc)
            else:
                live = GaugeMetricFamily(
                    "marbles_rq_live_workers", "Workers whose liveness beat is current, per "
                    "lane they serve (a worker serving several lanes counts in each).",
                    labels=["lane"])
                for index, count in sorted(workers.items()):
                    live.add_metric([str(index)], count)
                yield live
        if self.read_memory is not None:
            try:
                nodes = self.read_memory()
            except redis.RedisError as exc:
                redis_error(exc)
            else:
                used = GaugeMetricFamily(
                    "marbles_rq_redis_memory_used_bytes", "Memory the store's Redis uses "
                    "(INFO used_memory), per server.", labels=["node"])
                limit = GaugeMetricFamily(
                    "marbles_rq_redis_memory_limit_bytes", "What it may use: maxmemory, or "
                    "the machine's memory where maxmemory is 0. Past maxmemory a durable "
                    "Redis (noeviction) refuses writes: nothing new is accepted.",
                    labels=["node"])
                for node, used_bytes, limit_bytes in nodes:
                    used.add_metric([node], used_bytes)
                    limit.add_metric([node], limit_bytes)
                yield used
                yield limit
        try:
            waiting, questions, oldest_s = self.read_waiting()
        except redis.RedisError as exc:
            redis_error(exc)
        else:
            yield GaugeMetricFamily(
                "marbles_rq_waiting_runs", "Runs parked with a time the controller looks at "
                "them again (a timer, a question's timeout, a child to check).",
                value=waiting)
            yield GaugeMetricFamily(
                "marbles_rq_open_questions", "Questions and approvals asked and not yet "
                "answered.", value=questions)
            yield GaugeMetricFamily(
                "marbles_rq_oldest_open_question_age_seconds", "How long the oldest question "
                "or approval not yet answered has waited (0: none open).", value=oldest_s)


def scrape_client(client: Any) -> Any:
    """A client to `client`'s server whose reads give up after SCRAPE_TIMEOUT_S (a cluster
    client is used as it is: its own timeout applies)."""
    if not isinstance(client, redis.Redis):
        return client
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": SCRAPE_TIMEOUT_S,
              "socket_connect_timeout": SCRAPE_TIMEOUT_S}
    kwargs.pop("retry", None)
    return redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, max_connections=2, **kwargs))
