"""Monitors (Marbles §4.4): poll a source every interval; when it changed, call a handler that
may ask for one run.

    @mr.monitor("reports/*.csv", root="/srv/data", interval_s=30)
    def new_reports(change: mr.FileChange) -> mr.Launch | None:
        return mr.Launch("ingest", {"paths": sorted(change.added)}) if change.added else None

    @mr.monitor("https://api.example.com/status", allow_hosts=["api.example.com"])
    def status_changed(change: mr.HttpChange) -> mr.Launch | None: ...

* A source starting with ``http://`` or ``https://`` is fetched (httpx, timeouts, redirects
  followed only to hosts in `allow_hosts`, the body capped at MARBLES_MAX_PAYLOAD); its hash
  is sha256 of the body's stable JSON (sorted keys, compact) when it is JSON, else of its
  text. A status other than 2xx is a failed poll. Anything else is a glob under `root`; its
  observation is every matching file's sha256.
* The first poll is a change (no baseline; a glob that matches nothing fires nothing). The
  handler runs only on a change; the observation is recorded only after it returns, so a
  handler that raises sees the same change at the next poll. A failed poll keeps the state.
* A returned `Launch` is stored as pending together with the observation, under a run id
  ``mon.<key>.<n>`` fixed then, and handed out before every later poll until a start
  succeeds; starting it again is a no-op (same run id), so a started run is never started
  twice. A target that is not registered fails one poll and is dropped. While a launch is
  pending the monitor is not polled.

State lives in Redis (`keys.monitor`), polls come due from a per-bucket index
(`keys.monitor_due`), and the controller's ``monitors`` duty polls what is due on a small
thread pool, so a slow source never holds up redelivery.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from ..engine import ops
from ..engine.authoring import (
    REGISTRY,
    DefinitionError,
    InputError,
    Registry,
    UnknownWorkflowError,
    _where,
)
from ..engine.runs import RunStore
from ..errors import InvalidIdError, MarblesError
from ..store import RedisStore
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text
from ..transport.lanes import RQLike

if TYPE_CHECKING:
    from ..controller.context import DutyContext

log = logging.getLogger("marbles_rq.triggers.monitors")
# httpx logs every request at INFO: one line per poll would drown the controller's log.
logging.getLogger("httpx").setLevel(logging.WARNING)

DEFAULT_INTERVAL_S = 60.0
DEFAULT_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5
PER_BUCKET = 50           # due monitors read per bucket per pass
POLL_THREADS = 4


class UnknownMonitorError(MarblesError):
    code = "unknown_monitor"


class HostNotAllowedError(MarblesError):
    code = "host_not_allowed"


# -- what a handler gets and returns ----------------------------------------------------------

@dataclass(frozen=True)
class FileChange:
    """Paths (relative to the root, with /) -> sha256; `removed` carries the old digest."""

    added: dict[str, str]
    modified: dict[str, str]
    removed: dict[str, str]

    def __bool__(self) -> bool:
        return bool(self.added or self.modified or self.removed)


@dataclass(frozen=True)
class HttpChange:
    """The new body, its status, and the previous and current body hashes."""

    status: int
    previous: str | None   # None on the first poll
    current: str
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Launch:
    """A run a monitor's handler asks for: workflow name and its input (JSON-able)."""

    workflow: str
    input: Any = None


# -- declarations ---------------------------------------------------------------------------

@dataclass
class MonitorDef:
    key: str
    source: str
    kind: str                 # files | http
    handler: Callable[[Any], Launch | None]
    interval_s: float
    root: Path | None = None
    allow_hosts: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def interval_ms(self) -> int:
        return max(1, int(self.interval_s * 1000))

    def __call__(self, change: Any) -> Launch | None:
        """The handler itself, so a declared monitor is easy to unit-test."""
        return self.handler(change)


@dataclass
class Monitors:
    by_key: dict[str, MonitorDef] = field(default_factory=dict)

    def add(self, definition: MonitorDef, explicit_key: bool) -> MonitorDef:
        existing = self.by_key.get(definition.key)
        if existing is not None and _where(existing.handler) == _where(definition.handler):
            self.by_key[definition.key] = definition  # the same module loaded again
            return definition
        if existing is not None and explicit_key:
            raise DefinitionError(f"duplicate monitor key {definition.key!r}: "
                                  f"{_where(existing.handler)} and {_where(definition.handler)}")
        base, n = definition.key, 2
        while definition.key in self.by_key:
            definition.key = f"{base}-{n}"
            n += 1
        self.by_key[definition.key] = definition
        return definition

    def get(self, key: str) -> MonitorDef:
        try:
            return self.by_key[key]
        except KeyError:
            known = ", ".join(sorted(self.by_key)) or "none declared"
            raise UnknownMonitorError(f"unknown monitor {key!r} (known: {known})") from None


MONITORS = Monitors()
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def monitor_key(source: str) -> str:
    """``slug(source)-sha6(source)`` (Marbles §5.A.5); ``-2``... is added on duplicates."""
    slug = re.sub(r"[^a-z0-9]+", "-", source.lower()).strip("-")[:40].strip("-") or "monitor"
    return f"{slug}-{hashlib.sha256(source.encode()).hexdigest()[:6]}"


def monitor(source: str, *, root: str | Path | None = None,
            interval_s: float = DEFAULT_INTERVAL_S, allow_hosts: Sequence[str] = (),
            timeout_s: float = DEFAULT_TIMEOUT_S,
            key: str | None = None) -> Callable[[Callable[[Any], Launch | None]], MonitorDef]:
    """Declare a monitor whose handler gets a `FileChange` or an `HttpChange` and returns a
    `Launch` or None. HTTP sources need `allow_hosts` (host names or addresses, exact)."""
    if not 0 < interval_s <= 86400 * 366:
        raise DefinitionError(f"monitor {source!r}: interval_s must be in (0, 1 year]")
    if not 0 < timeout_s <= 300:
        raise DefinitionError(f"monitor {source!r}: timeout_s must be in (0, 300]")
    if key is not None and not _KEY_PATTERN.fullmatch(key):
        raise DefinitionError(f"invalid monitor key {key!r}: use 1 to 100 of A-Z a-z 0-9 _ . -")
    if source.startswith(("http://", "https://")):
        kind = "http"
        hosts = tuple(h.lower() for h in allow_hosts)
        if not hosts:
            raise DefinitionError(f"HTTP monitor {source!r} needs allow_hosts: the hosts it "
                                  f"may fetch from")
        host = _host(source)
        if host not in hosts:
            raise DefinitionError(f"HTTP monitor {source!r}: host {host!r} is not in its "
                                  f"allow_hosts {list(hosts)}")
        base = None
    else:
        kind, hosts = "files", ()
        if not source or source.startswith("/") or ".." in Path(source).parts:
            raise DefinitionError(f"monitor glob {source!r} must be relative to its root, "
                                  f"without '..'")
        base = Path(root) if root is not None else Path.cwd()

    def register(handler: Callable[[Any], Launch | None]) -> MonitorDef:
        if not callable(handler):
            raise DefinitionError("@monitor decorates the handler function")
        definition = MonitorDef(key or monitor_key(source), source, kind, handler,
                                float(interval_s), base, hosts, float(timeout_s))
        return MONITORS.add(definition, key is not None)

    return register


def _host(url: str) -> str:
    import httpx  # here, not at the top: a process without an HTTP monitor never needs it

    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL as exc:
        raise DefinitionError(f"invalid monitor URL {url!r}: {exc}") from None
    return host.lower()


# -- polling --------------------------------------------------------------------------------

def digest_files(definition: MonitorDef) -> dict[str, str]:
    """Every regular file under the root matching the glob (not through links out of the
    root) -> sha256 of its content."""
    assert definition.root is not None
    root = definition.root.resolve()
    if not root.is_dir():
        raise OSError(f"monitor root {str(root)!r} is not a folder")
    files: dict[str, str] = {}
    for path in sorted(root.glob(definition.source)):
        try:
            real = path.resolve()
            if not real.is_file() or not real.is_relative_to(root):
                continue
            digest = hashlib.sha256()
            with real.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 16), b""):
                    digest.update(block)
        except OSError:
            continue  # removed or unreadable between the listing and the read
        files[path.relative_to(root).as_posix()] = digest.hexdigest()
    return files


def fetch(definition: MonitorDef, *, max_bytes: int | None = None) -> tuple[int, bytes]:
    """GET the source; redirects are followed only to allowed hosts. Returns (status, body);
    raises on a refused host, a transport error, a status other than 2xx, a body too large."""
    import httpx

    limit = ops.max_payload() if max_bytes is None else max_bytes
    url = httpx.URL(definition.source)
    timeout = httpx.Timeout(definition.timeout_s)
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            if url.scheme not in ("http", "https"):
                raise HostNotAllowedError(f"refusing scheme {url.scheme!r} ({url})")
            if url.host.lower() not in definition.allow_hosts:
                raise HostNotAllowedError(f"host {url.host!r} is not in the monitor's "
                                          f"allow_hosts {list(definition.allow_hosts)}")
            with client.stream("GET", url) as response:
                if response.is_redirect and "location" in response.headers:
                    url = url.join(response.headers["location"])
                    continue
                if not 200 <= response.status_code < 300:
                    raise MarblesError(f"HTTP {response.status_code}")
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise MarblesError(f"body larger than {limit} bytes")
                return response.status_code, bytes(body)
    raise MarblesError(f"more than {MAX_REDIRECTS} redirects")


def _poll_failures() -> tuple[type[Exception], ...]:
    """What a failed poll raises: httpx's transport and status errors only once `fetch` has
    imported httpx (before that nothing can have raised one)."""
    httpx = sys.modules.get("httpx")
    http: tuple[type[Exception], ...] = () if httpx is None else (httpx.HTTPError,)
    return (OSError, *http, MarblesError, ValueError)


def body_hash(body: bytes) -> str:
    """sha256 of the stable JSON of the body (sorted keys, compact) if it is JSON, else of
    its text."""
    text = body.decode("utf-8", errors="replace")
    try:
        value = json.loads(text)
    except ValueError:
        stable = text
    else:
        stable = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(stable.encode()).hexdigest()


@dataclass(frozen=True)
class Outcome:
    """What one poll of a monitor did.

    status: unchanged | changed (the handler returned None) | launched (a run was asked
    for; `run_id`) | started (a pending launch was started; `run_id`) | dropped (a pending
    launch's target is gone) | start_failed (left pending) | poll_failed | handler_failed |
    conflict (another poll recorded first) | fenced (a newer controller) | error (the
    duty's catch-all: Redis unreachable, a corrupt state).
    """

    key: str
    status: str
    run_id: str = ""
    detail: str = ""


@dataclass(frozen=True)
class _State:
    rev: str
    obs: bytes | None
    pending: bytes | None
    pending_run: str
    seq: int


class Poller:
    """Polls monitors against the store; `ctl_epoch` 0 means a manual roll (not fenced)."""

    def __init__(self, runs: RunStore, rq: RQLike, *, registry: Registry = REGISTRY,
                 monitors: Monitors = MONITORS) -> None:
        self.runs, self.rq = runs, rq
        self.store: RedisStore = runs.store
        self.keys = runs.keys
        self.registry, self.monitors = registry, monitors

    def _state(self, key: str) -> _State:
        f = self.store.client.hmget(self.keys.monitor(key),
                                    ["rev", "obs", "pending", "pending_run", "seq"])
        return _State(as_text(f[0] or b""), _b(f[1]), _b(f[2]), as_text(f[3] or b""),
                      int(f[4] or 0))

    def _fence(self, key: str) -> tuple[str, str, str]:
        bucket = self.keys.bucket_of(key)
        return (self.keys.monitor(key), self.keys.monitor_due(bucket),
                self.keys.controller_fence(bucket))

    def _observe(self, d: MonitorDef, state: _State, epoch: int, *, obs: bytes = b"",
                 launch: bytes = b"", launch_run: str = "", seq: int | None = None,
                 error: str = "") -> str:
        mon, due, fence = self._fence(d.key)
        reply = self.store.scripts.observe_monitor(
            monitor_key=d.key, monitor_hash=mon, due_key=due, fence_key=fence,
            ctl_epoch=epoch, expected_rev=state.rev, obs=obs, launch=launch,
            launch_run=launch_run, seq=state.seq if seq is None else seq,
            interval_ms=d.interval_ms, error=error[:500])
        return reply.status

    def _hand_out(self, d: MonitorDef, pending: bytes, run_id: str, epoch: int) -> Outcome:
        """Start a pending launch (the same run id each time), then acknowledge it."""
        mon, _, fence = self._fence(d.key)
        workflow, error, run_id_started = "", "", run_id
        try:
            launch = _Observation.decode(pending)
            workflow = str(launch.get("workflow", ""))
            raw = msgspec.json.encode(launch.get("input"))
            request = ops.RunRequest(workflow, raw, run_id, origin="monitor")
            started = ops.enqueue(self.runs, self.rq, request, self.registry)
            if not started.created and (started.record.origin not in ("", "monitor") or (
                    started.record.name != workflow) or bytes(
                    started.record.input) != bytes(ops.prepare(request, self.registry).input)):
                # The id belongs to another launch: this monitor's numbering started again
                # (its state was lost or deleted). Start it under an id derived from this
                # launch, the same on every retry, so it still starts exactly once.
                other = f"{run_id}.{hashlib.sha256(pending).hexdigest()[:8]}"
                log.warning("monitor %s: run %s is another launch's (was the monitor's state "
                            "reset?); starting this one as %s", d.key, run_id, other)
                ops.enqueue(self.runs, self.rq,
                            ops.RunRequest(workflow, raw, other, origin="monitor"), self.registry)
                run_id_started = other
            else:
                run_id_started = run_id
        except msgspec.DecodeError as exc:
            error = f"pending launch unreadable: {exc}"
        except (UnknownWorkflowError, InputError, InvalidIdError) as exc:  # for good
            error = f"launch target {workflow!r} cannot start: {exc}"
        except redis.RedisError as exc:
            if is_outage(exc):
                raise
            log.warning("monitor %s: starting run %s failed (%s); it stays pending", d.key,
                        run_id, one_line(exc))
            return Outcome(d.key, "start_failed", run_id, one_line(exc))
        reply = self.store.scripts.ack_monitor(monitor_hash=mon, fence_key=fence,
                                               ctl_epoch=epoch, launch_run=run_id, error=error)
        if reply.status == "fenced":
            return Outcome(d.key, "fenced", run_id)
        if error:
            log.error("monitor %s: %s; dropped", d.key, error)
            return Outcome(d.key, "dropped", run_id, error)
        log.info("monitor %s: run %s started (%s)", d.key, run_id_started, workflow)
        return Outcome(d.key, "started", run_id_started)

    def poll(self, key: str, *, epoch: int = 0) -> Outcome:
        """One poll of monitor `key` now: hand out a pending launch first; then poll the
        source, call the handler on a change, and record the observation (with the launch
        it returned, which is then handed out at once)."""
        d = self.monitors.get(key)
        state = self._state(key)
        if state.pending is not None:
            handed = self._hand_out(d, state.pending, state.pending_run, epoch)
            if handed.status != "started":
                if handed.status in ("start_failed", "dropped"):
                    self._observe(d, self._state(key), epoch, error=handed.detail)
                return handed
            state = self._state(key)
        try:
            new_obs, change = self._look(d, state.obs)
        except _poll_failures() as exc:
            detail = one_line(exc)
            log.warning("monitor %s: poll failed: %s", key, detail)
            return Outcome(key, self._settled(self._observe(d, state, epoch, error=detail),
                                              "poll_failed"), detail=detail)
        if not change:
            return Outcome(key, self._settled(self._observe(d, state, epoch), "unchanged"))
        try:
            result = d.handler(change)
            if result is not None and not isinstance(result, Launch):
                raise TypeError(f"the handler returned {type(result).__name__}; expected "
                                f"mr.Launch or None")
            launch = b"" if result is None else msgspec.json.encode(
                {"workflow": result.workflow, "input": result.input})
        except Exception as exc:  # the observation stays: the same change comes back
            detail = one_line(exc)
            log.warning("monitor %s: handler failed: %s", key, detail)
            return Outcome(key, self._settled(self._observe(d, state, epoch, error=detail),
                                              "handler_failed"), detail=detail)
        seq = state.seq + (1 if launch else 0)
        run_id = f"mon.{key}.{seq}" if launch else ""
        status = self._observe(d, state, epoch, obs=new_obs, launch=launch, launch_run=run_id,
                               seq=seq)
        if status != "ok":
            return Outcome(key, status, run_id)
        if not launch:
            return Outcome(key, "changed")
        handed = self._hand_out(d, launch, run_id, epoch)
        return Outcome(key, "launched", handed.run_id) if handed.status == "started" else handed

    @staticmethod
    def _settled(status: str, outcome: str) -> str:
        return outcome if status == "ok" else status

    def _look(self, d: MonitorDef, stored: bytes | None) -> tuple[bytes, Any]:
        """(the new observation JSON, the change, falsy when nothing changed)."""
        baseline = _baseline(d.key, stored)
        if d.kind == "files":
            files = digest_files(d)
            old: dict[str, str] = {}
            if baseline is not None:
                old = baseline.get("files", {})
            change = FileChange(
                added={p: h for p, h in files.items() if p not in old},
                modified={p: h for p, h in files.items() if p in old and old[p] != h},
                removed={p: h for p, h in old.items() if p not in files})
            return msgspec.json.encode({"files": files}), change
        status, body = fetch(d)
        current = body_hash(body)
        previous = None if baseline is None else baseline.get("hash")
        if previous == current:
            return b"", None
        return (msgspec.json.encode({"hash": current, "status": status}),
                HttpChange(status, previous, current, body))


_Observation = msgspec.json.Decoder(dict[str, Any])


def _baseline(key: str, stored: bytes | None) -> dict[str, Any] | None:
    """The stored observation; an unreadable one counts as none (the next poll is a change)."""
    if stored is None:
        return None
    try:
        return _Observation.decode(stored)
    except msgspec.DecodeError as exc:
        log.warning("monitor %s: stored observation unreadable (%s); polling afresh", key, exc)
        return None


# -- a manual roll and the listing (for the CLI) -------------------------------------------

def roll_monitor(runs: RunStore, rq: RQLike, key: str, *, registry: Registry = REGISTRY,
                 monitors: Monitors = MONITORS) -> Outcome:
    """Poll monitor `key` once, now, in this process (not fenced: a roll racing the
    controller's poll is decided by the monitor's revision, and a launch keeps its run id).
    Raises UnknownMonitorError for a key that is not declared."""
    return Poller(runs, rq, registry=registry, monitors=monitors).poll(key, epoch=0)


@dataclass(frozen=True)
class MonitorView:
    key: str
    kind: str
    source: str
    interval_s: float
    next_due_ms: int | None      # None: never armed (no controller has led since it was added)
    last_poll_ms: int | None
    last_change_ms: int | None
    last_error: str
    pending_run: str

    def to_json(self) -> dict[str, Any]:
        def iso(ms: int | None) -> str | None:
            return None if ms is None else time.strftime(
                "%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"

        return {"key": self.key, "kind": self.kind, "source": self.source,
                "interval_s": self.interval_s, "next_due": iso(self.next_due_ms),
                "last_poll": iso(self.last_poll_ms), "last_change": iso(self.last_change_ms),
                "last_error": self.last_error or None, "pending_run": self.pending_run or None}


def list_monitors(store: RedisStore, monitors: Monitors = MONITORS) -> list[MonitorView]:
    """The declared monitors, by key, with their state in Redis (reads only)."""
    defs = [monitors.by_key[k] for k in sorted(monitors.by_key)]
    pipe = store.client.pipeline(transaction=False)
    for d in defs:
        pipe.hmget(store.keys.monitor(d.key), ["next_ms", "last_poll_ms", "last_change_ms",
                                               "last_error", "pending_run"])
        pipe.zscore(store.keys.monitor_due(store.keys.bucket_of(d.key)), d.key)
    replies = pipe.execute(raise_on_error=False)
    views = []

    def num(v: Any) -> int | None:
        try:
            return None if v is None else int(v)
        except (TypeError, ValueError):
            return None

    for i, d in enumerate(defs):
        f, due = replies[2 * i], replies[2 * i + 1]
        if isinstance(f, Exception) or isinstance(due, Exception):
            bad = f if isinstance(f, Exception) else due
            if is_outage(bad):
                raise bad
            # One broken monitor costs only itself: shown with the reason, not an exit.
            views.append(MonitorView(d.key, d.kind, d.source, d.interval_s, None, None, None,
                                     f"unreadable state: {one_line(bad)}", ""))
            continue
        views.append(MonitorView(d.key, d.kind, d.source, d.interval_s,
                                 num(due) if due is not None else num(f[0]), num(f[1]),
                                 num(f[2]), as_text(f[3] or b""), as_text(f[4] or b"")))
    return views


# -- the controller's duty ------------------------------------------------------------------

class MonitorsDuty:
    """Arms every declared monitor on election, then each pass polls those due, on a small
    thread pool (a monitor is never polled twice at once). Writes are fenced by the epoch the
    leader had when it handed the poll out."""

    kind = "monitors"

    def __init__(self, registry: Registry = REGISTRY, monitors: Monitors = MONITORS) -> None:
        self.registry, self.monitors = registry, monitors
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[str, Future[Outcome]] = {}
        self._lock = threading.Lock()

    def recover(self, ctl: DutyContext) -> int:
        if not self.monitors.by_key:
            return 0
        armed = 0
        for key in sorted(self.monitors.by_key):
            if ctl.keys.bucket_of(key) not in ctl.buckets:
                continue  # another lane's: its controller arms it
            status = self._arm(ctl, key, "arm")
            if status == "fenced":
                ctl.step_down("a newer controller acts on monitors")
                break
            armed += status == "ok"
        return armed

    def _arm(self, ctl: DutyContext, key: str, mode: str) -> str:
        """arm_monitor for one monitor; a key of the wrong type costs only that monitor."""
        mon, due, fence = self._keys(ctl, key)
        try:
            return ctl.store.scripts.arm_monitor(monitor_key=key, monitor_hash=mon,
                                                 due_key=due, fence_key=fence,
                                                 ctl_epoch=ctl.epoch, mode=mode).status
        except redis.ResponseError as exc:
            if is_outage(exc):
                raise
            log.warning("monitor %s: cannot %s it (%s)", key, mode, one_line(exc))
            return "error"

    @staticmethod
    def _keys(ctl: DutyContext, key: str) -> tuple[str, str, str]:
        bucket = ctl.keys.bucket_of(key)
        return (ctl.keys.monitor(key), ctl.keys.monitor_due(bucket),
                ctl.keys.controller_fence(bucket))

    def tick(self, ctl: DutyContext) -> None:
        if not self.monitors.by_key:
            return
        with self._lock:
            self._running = {k: f for k, f in self._running.items() if not f.done()}
        for _, key in ctl.due(ctl.keys.monitor_due, ctl.server_ms(), PER_BUCKET):
            if key in self._running:
                continue
            if key not in self.monitors.by_key:
                if self._arm(ctl, key, "disarm") == "ok":
                    log.warning("monitor %s is no longer declared; it is not polled", key)
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(POLL_THREADS, thread_name_prefix="monitor")
            poller = Poller(ctl.runs, ctl.rq, registry=self.registry, monitors=self.monitors)
            self._running[key] = self._pool.submit(self._poll, poller, key, ctl.epoch)

    def close(self) -> None:
        """The controller stopped leading this lane: polls not started are dropped (they
        stay due for the lane's next leader); one in flight finishes, fenced by its epoch."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @staticmethod
    def _poll(poller: Poller, key: str, epoch: int) -> Outcome:
        try:
            outcome = poller.poll(key, epoch=epoch)
        except Exception as exc:  # Redis errors included: the monitor stays due
            log.warning("monitor %s: %s: %s", key, type(exc).__name__, one_line(exc))
            return Outcome(key, "error", detail=one_line(exc))
        if outcome.status == "fenced":
            log.warning("monitor %s: a newer controller acts on it; not recorded", key)
        return outcome


def _b(value: Any) -> bytes | None:
    return value.encode() if isinstance(value, str) else value
