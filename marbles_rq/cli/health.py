"""`marbles-rq health controller|worker`: liveness for container healthchecks and
supervisors, from what is cheap to read and hard to fake.

A controller is healthy when Redis answers and a `marbles-rq controller` process runs on this
host (found in /proc) that either holds the controller lease (the lease token names this
host and that pid, and a lease only stays held while its loop renews it) or waits for it
while another controller holds it. A standby's loop leaves no trace in Redis, so for a
standby this proves the process and Redis, not that its loop is not wedged.

A worker is healthy when a worker of this deployment registered in RQ's worker registry
under this host's name (`<host>.<8 hex>.<pid>`) still has its registration (RQ lets it
expire when heartbeats stop) and its pid is a live `marbles-rq worker` process here.

Exit 0 healthy, 1 not (one line saying why), 3 Redis unreachable.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from ..deployment import Settings
from ..store.replies import as_text
from ..terminal import safe
from .exits import EXIT_PROBLEM

# Global options of `marbles-rq` that take a value: skipped when finding a subcommand.
_VALUED = {"--redis-url", "--prefix", "--buckets", "--lane-count", "--source", "--rq-url"}


def subcommand(argv: list[str]) -> str | None:
    """The marbles-rq subcommand of a command line (`marbles-rq worker ...`, `python -m
    marbles_rq controller ...`, `python .../bin/marbles-rq ...`), or None if it is not one."""
    start = None
    for i, arg in enumerate(argv):
        if Path(arg).name == "marbles-rq":
            start = i + 1
            break
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "marbles_rq":
            start = i + 2
            break
    if start is None:
        return None
    i = start
    while i < len(argv):
        arg = argv[i]
        if arg in _VALUED:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg
    return None


def local_processes(role: str) -> list[int]:
    """Pids of live `marbles-rq <role>` processes visible here (a forked work-horse or pool
    executor shows its parent's command line, and counts too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2:].split()[0] in ("Z", "X"):
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if subcommand(argv) == role:
            found.append(int(entry.name))
    return sorted(found)


def _unhealthy(message: str) -> None:
    if _as_json():
        click.echo(json.dumps({"ok": False, "detail": message}))
    else:
        click.echo(safe(f"unhealthy: {message}"), err=True)
    sys.exit(EXIT_PROBLEM)


def _healthy(message: str) -> None:
    if _as_json():
        click.echo(json.dumps({"ok": True, "detail": message}))
    else:
        click.echo(safe(f"ok: {message}"))


def _as_json() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.params.get("as_json"))


_JSON = click.option("--json", "as_json", is_flag=True,
                     help='Print {"ok": true|false, "detail": "..."} on stdout.')


@click.group()
def health() -> None:
    """Is this host's controller or worker alive? Exit 0 yes, 1 no, 3 Redis unreachable."""


@health.command("controller")
@_JSON
@click.pass_obj
def controller_health(settings: Settings, as_json: bool) -> None:
    """A controller process runs here and leads, or waits while another one leads."""
    from ..controller.loop import LEASE_NAME

    store = settings.reader()
    store.client.ping()
    here = socket.gethostname()
    mine = local_processes("controller")
    if settings.keys.lanes > 1:
        _lanes_health(store, here, mine)
        return
    info = store.lease_holder(LEASE_NAME)
    if not mine:
        _unhealthy(f"no marbles-rq controller process runs on this host ({here})")
    if info is None:
        _unhealthy(f"controller pid {', '.join(map(str, mine))} runs but nobody holds the "
                   f"lease (it should take it within one lease)")
    assert info is not None
    host, _, rest = info.token.partition(":")
    pid = rest.partition(":")[0]
    if host == here and pid.isdigit() and int(pid) in mine:
        _healthy(f"controller pid {pid} leads (epoch {info.epoch}, lease left "
                 f"{info.ttl_ms} ms)")
        return
    _healthy(f"controller pid {', '.join(map(str, mine))} waits; {host}:{pid} "
             f"leads (epoch {info.epoch})")


def _lanes_health(store: Any, here: str, mine: list[int]) -> None:
    """Several lanes: healthy when a controller process runs here and every lane is led
    (by it or by another); it says which lanes it leads."""
    from ..controller.share import lane_leaders

    if not mine:
        _unhealthy(f"no marbles-rq controller process runs on this host ({here})")
    leaders = lane_leaders(store)
    unled = [ll.lane for ll in leaders if ll.info is None]
    if unled:
        _unhealthy(f"no controller leads lane{'s' if len(unled) > 1 else ''} "
                   f"{', '.join(map(str, unled))} (controller pid {', '.join(map(str, mine))} "
                   f"runs here; a lane is taken within one lease)")
    local = {f"{here}:{pid}" for pid in mine}
    ours = [ll.lane for ll in leaders if ll.holder in local]
    others = sorted({ll.holder or "" for ll in leaders if ll.holder not in local})
    click.echo(safe(f"ok: controller pid {', '.join(map(str, mine))} leads "
                    f"{len(ours)} of {len(leaders)} lanes ({', '.join(map(str, ours)) or '-'})"
                    + (f"; the others: {', '.join(others)}" if others else "")))


@health.command("worker")
@_JSON
@click.pass_obj
def worker_health(settings: Settings, as_json: bool) -> None:
    """A worker registered from this host is alive: RQ still holds its registration and its
    pid is a live marbles-rq worker process here."""
    from ..transport.dispatch import queue_of, rq_worker_keys

    rq = settings.rq().registration
    here = socket.gethostname()
    workers_key, worker_prefix = rq_worker_keys()
    keys = sorted(as_text(k) for k in rq.smembers(workers_key))
    keys = [k for k in keys if k.startswith(f"{worker_prefix}{here}.")]
    local = set(local_processes("worker"))
    pipe = rq.pipeline(transaction=False)
    for key in keys:
        pipe.hmget(key, "pid", "queues", "state", "last_heartbeat")
    alive = []
    for key, (pid, queues, state, beat) in zip(keys, pipe.execute(), strict=True):
        if pid is None or queues is None:
            continue  # registration expired: no heartbeat for RQ's worker TTL
        if not all(queue_of(settings.prefix, q) for q in as_text(queues).split(",")):
            continue  # another deployment's worker on this host
        if not as_text(pid).isdigit() or int(as_text(pid)) not in local:
            continue  # killed hard: RQ keeps its registration for minutes
        age = ""
        if beat is not None:
            try:
                seen = datetime.strptime(as_text(beat), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
                age = f", heartbeat {time.time() - seen.timestamp():.0f} s ago"
            except ValueError:
                pass
        alive.append(f"{key.removeprefix(worker_prefix)} ({as_text(state or b'?')}{age})")
    if not alive:
        _unhealthy(f"no live worker of prefix {settings.prefix!r} from this host ({here}) is "
                   f"registered with RQ (local worker processes: "
                   f"{', '.join(map(str, sorted(local))) or 'none'})")
    _healthy(f"{len(alive)} worker(s) alive: {'; '.join(alive)}")
