"""Benchmark (not a test): RedisStore.claim / compare_and_set against raw ``SET key val NX``.

Run from the repo root::

    .venv/bin/python bench/store.py [--seconds S] [--ops N] [--warmup W] [--clients 1,16]
                                    [--rounds R] [--payload-bytes B] [--no-profile]

It starts its own redis-server with the durable ``ops/redis.conf`` (appendonly yes,
appendfsync always) in a temporary directory (``tests/redis_procs.py``), then measures one
cell per (operation, concurrency):

* ``SET NX``  raw ``SET key val NX`` through redis-py, value as large as a claim's document;
* ``claim``   ``RedisStore.claim(EventRecord(...))``, a fresh id per call;
* ``CAS``     ``RedisStore.compare_and_set``, each client advancing its own entry's updated_at.

Every client is its own OS process (multiprocessing "spawn") with its own connection from
``marbles_rq.store.connection.connect``. Clients connect, do one untimed call, meet at a barrier,
then run a warm-up and a fixed wall-clock window whose bounds are the same absolute
CLOCK_MONOTONIC instants in every process. An op counts if it *completes* inside the window;
ops/s = completed ops / window. ``--ops N`` additionally caps each client at N measured ops:
the window then ends when the first client reaches its cap (so every counted op ran at full
concurrency).

``--rounds R`` repeats every cell R times (rounds interleave the cells) and reports the
median round.

Besides the table, it reports where the time goes, measured over the same windows: client CPU
per op (sum of the client processes' CPU time) and context switches, redis-server CPU per op
(all its threads, from /proc), the server-side command time from ``INFO commandstats``
(usec_per_call of evalsha vs set, and of the commands the scripts run), and the host's CPU
utilisation including the share used by other processes (cells disturbed by other load are
flagged). Unless ``--no-profile``: the client-side Python cost of one claim with the network
stubbed out; one client's CPU and wall time per call for a no-fsync round trip, SET NX, a bare
EVALSHA of claim_record and RedisStore.claim; the server-side time per call of pipelined SET NX,
trivial and one-write scripts, claim_record as EVALSHA and as a Function, and cas_entry; and a
short cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import math
import multiprocessing as mp
import os
import platform
import pstats
import resource
import shlex
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/store.py` puts bench/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402

from marbles_rq.store import RedisStore, new_request_id  # noqa: E402
from marbles_rq.store.connection import connect  # noqa: E402
from marbles_rq.store.keys import Keyspace  # noqa: E402
from marbles_rq.store.records import EventRecord, WorkspaceEntry, encode  # noqa: E402

PREFIX = "bench"
WORKLOADS = ("setnx", "claim", "cas")
LABEL = {"setnx": "SET NX", "claim": "claim", "cas": "CAS"}
MAIN_COMMAND = {"setnx": "set", "claim": "evalsha", "cas": "evalsha"}
CLK_TCK = os.sysconf("SC_CLK_TCK")  # unit of /proc/stat
AIM = 0.8  # the project's stated aim: claim >= 0.8x raw SET NX
OTHER_LOAD_WARN = 20.0  # % of the machine used by others during a window: flag the cell
RECEIVED_AT_MS = 1_796_000_000_000


# --------------------------------------------------------------------------------------------
# what one client does


def make_payload(size: int) -> bytes:
    """A JSON object of exactly `size` bytes (at least 16), shaped like a webhook body."""
    head = b'{"type":"order.paid","data":"'
    tail = b'"}'
    fill = max(0, size - len(head) - len(tail))
    return head + (b"x" * fill) + tail


def event(rid: str, payload: msgspec.Raw) -> EventRecord:
    return EventRecord(version=1, id=rid, source="bench", payload=payload,
                       received_at_ms=RECEIVED_AT_MS)


def entry(workspace: str, updated_at: str, value: msgspec.Raw) -> WorkspaceEntry:
    return WorkspaceEntry(version=1, workspace_id=workspace, key="state",
                          updated_at=updated_at, value=value)


def stamp(i: int) -> str:
    return f"2026-11-29T00:00:{i:012d}Z"


def setnx_key_prefix(keys: Keyspace) -> str:
    """A key prefix as long as a claim's record key minus the id: same bytes on the wire."""
    return keys.record("event", "x")[:-1]


@dataclass(frozen=True)
class Spec:
    workload: str
    cell: str  # unique per cell; part of every id, so ids are fresh in every cell
    worker: int
    url: str
    payload_bytes: int
    cap: int  # 0 = no cap
    warmup_ns: int
    window_ns: int


def build_op(spec: Spec) -> Callable[[int], bool]:
    """The operation under test: op(i) performs the i-th call and says whether it did what
    was expected (a won claim, an applied CAS, a set key)."""
    payload = msgspec.Raw(make_payload(spec.payload_bytes))
    tag = f"{spec.cell}.w{spec.worker:02d}"
    if spec.workload == "claim":
        store = RedisStore(connect(spec.url), Keyspace(PREFIX), url=spec.url)

        def claim(i: int) -> bool:
            return store.claim(event(f"{tag}.{i}", payload)).won

        return claim
    if spec.workload == "cas":
        store = RedisStore(connect(spec.url), Keyspace(PREFIX), url=spec.url)
        workspace = tag
        if not store.compare_and_set(entry(workspace, stamp(0), payload), None).ok:
            raise RuntimeError(f"could not create the CAS entry of {workspace}")

        def cas(i: int) -> bool:  # advances updated_at from stamp(i) to stamp(i + 1)
            return store.compare_and_set(entry(workspace, stamp(i + 1), payload), stamp(i)).ok

        return cas
    if spec.workload == "setnx":
        client = connect(spec.url)
        keys = Keyspace(PREFIX)
        prefix = setnx_key_prefix(keys)
        value = encode(event(f"{tag}.0", payload))  # the bytes a claim would store

        def setnx(i: int) -> bool:
            return client.set(f"{prefix}{tag}.{i}", value, nx=True) is True

        return setnx
    raise ValueError(spec.workload)


def worker_main(spec: Spec, ready: Any, go: Any, start_ns: Any, out: Any) -> None:
    """One client process: connect, one untimed call, barrier, warm-up, timed window."""
    try:
        op = build_op(spec)
        if not op(0):  # connects, loads the script into this connection's path, etc.
            raise RuntimeError(f"{spec.workload}: the untimed first call did not succeed")
        ready.wait(timeout=300)
    except BaseException as exc:
        ready.abort()
        out.put({"worker": spec.worker, "error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        if not go.wait(timeout=300):
            raise RuntimeError("never got the start signal")
        window_start = start_ns.value + spec.warmup_ns
        window_end = window_start + spec.window_ns
        lat = array("q")  # latency of each op completed inside the window
        fin = array("q")  # its completion time, relative to the window start
        errors = 0
        cpu0 = cpu1 = 0
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        clock, cpu_clock = time.monotonic_ns, time.process_time_ns
        i = 1
        while True:
            t1 = clock()
            if t1 >= window_end:
                break
            if not cpu0 and t1 >= window_start:
                cpu0 = cpu_clock()
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
            ok = op(i)
            t2 = clock()
            i += 1
            if window_start <= t2 <= window_end:
                lat.append(t2 - t1)
                fin.append(t2 - window_start)
                errors += not ok
                if spec.cap and len(lat) >= spec.cap:
                    break
        cpu1 = cpu_clock()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        out.put({"worker": spec.worker, "lat": lat.tobytes(), "fin": fin.tobytes(),
                 "errors": errors, "cpu_ns": cpu1 - cpu0 if cpu0 else 0,
                 "vcsw": ru1.ru_nvcsw - ru0.ru_nvcsw if cpu0 else 0,
                 "ivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw if cpu0 else 0,
                 "capped": bool(spec.cap and len(lat) >= spec.cap)})
    except BaseException as exc:
        out.put({"worker": spec.worker, "error": f"{type(exc).__name__}: {exc}"})


# --------------------------------------------------------------------------------------------
# server-side and host-side counters


@dataclass
class Snapshot:
    at_ns: int
    commands: dict[str, tuple[int, int]]  # command -> (calls, usec)
    server_cpu_ns: int
    host_busy: int
    host_total: int


def server_cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` (first field of /proc/<pid>/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
    return total


def host_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - idle, total


def snapshot(client: redis.Redis, pid: int) -> Snapshot:
    stats = client.info("commandstats")
    commands = {}
    for name, row in stats.items():
        if isinstance(row, dict) and str(name).startswith("cmdstat_"):
            commands[str(name)[8:]] = (int(row["calls"]), int(row["usec"]))
    busy, total = host_cpu()
    return Snapshot(time.monotonic_ns(), commands, server_cpu_ns(pid), busy, total)


# --------------------------------------------------------------------------------------------
# one cell


@dataclass
class Cell:
    workload: str
    clients: int
    window_s: float
    ops: int
    errors: int
    lat_ns: list[int]
    per_client: list[int]
    client_cpu_ns: int
    before: Snapshot
    after: Snapshot
    capped: bool = False
    client_cpu_raw_ns: int = 0  # all client CPU in the window, also after a cap
    measured_ops: int = 0  # all ops the clients completed in the window, also after a cap
    vcsw: int = 0  # client context switches in the window: voluntary (blocked in recv) ...
    ivcsw: int = 0  # ... and involuntary (preempted)
    round_rates: list[float] = field(default_factory=list)  # with --rounds > 1

    @property
    def rate(self) -> float:
        return self.ops / self.window_s if self.window_s > 0 else 0.0

    def pct(self, q: float) -> float:
        """Nearest-rank percentile of the latencies, in ms."""
        if not self.lat_ns:
            return math.nan
        rank = min(len(self.lat_ns) - 1, max(0, math.ceil(q * len(self.lat_ns)) - 1))
        return self.lat_ns[rank] / 1e6

    def command_delta(self, name: str) -> tuple[int, int]:
        c0, u0 = self.before.commands.get(name, (0, 0))
        c1, u1 = self.after.commands.get(name, (0, 0))
        return c1 - c0, u1 - u0

    @property
    def server_ops(self) -> int:
        """Calls of the command under test between the two snapshots."""
        return self.command_delta(MAIN_COMMAND[self.workload])[0]

    def usec_per_call(self, name: str) -> float:
        calls, usec = self.command_delta(name)
        return usec / calls if calls else math.nan

    def inner_usec_per_op(self) -> float:
        """Time of the commands a script ran (they are counted in commandstats too), per
        script call; nan for plain SET NX."""
        if MAIN_COMMAND[self.workload] != "evalsha" or not self.server_ops:
            return math.nan
        inner = 0
        for name in set(self.before.commands) | set(self.after.commands):
            if name not in ("evalsha", "eval", "info", "set", "config|resetstat"):
                inner += self.command_delta(name)[1]
        return inner / self.server_ops

    def server_cpu_us_per_op(self) -> float:
        ops = self.server_ops
        return (self.after.server_cpu_ns - self.before.server_cpu_ns) / ops / 1e3 if ops else 0.0

    def switches_per_op(self) -> str:
        if not self.measured_ops:
            return "-"
        return f"{self.vcsw / self.measured_ops:.2f}+{self.ivcsw / self.measured_ops:.2f}"

    def client_cpu_us_per_op(self) -> float:
        return self.client_cpu_ns / self.ops / 1e3 if self.ops else 0.0

    def host_busy_pct(self) -> float:
        total = self.after.host_total - self.before.host_total
        return 100.0 * (self.after.host_busy - self.before.host_busy) / total if total else 0.0

    def other_cpu_pct(self) -> float:
        """Share of the machine busy with anything but these clients and redis-server (other
        sessions, this script's parent, kernel time not charged to a process)."""
        total = self.after.host_total - self.before.host_total
        if not total:
            return 0.0
        busy_s = (self.after.host_busy - self.before.host_busy) / CLK_TCK
        ours_s = (self.client_cpu_raw_ns
                  + self.after.server_cpu_ns - self.before.server_cpu_ns) / 1e9
        return max(0.0, 100.0 * (busy_s - ours_s) / (total / CLK_TCK))


def merge(runs: list[Cell]) -> Cell:
    """Several rounds of one cell: the median-throughput round, with every round's latencies."""
    if len(runs) == 1:
        return runs[0]
    mid = sorted(runs, key=lambda c: c.rate)[len(runs) // 2]
    return dataclasses.replace(
        mid, lat_ns=sorted(x for c in runs for x in c.lat_ns),
        errors=sum(c.errors for c in runs), capped=any(c.capped for c in runs),
        round_rates=[c.rate for c in runs])


def sleep_until(deadline_ns: int) -> None:
    while True:
        left = deadline_ns - time.monotonic_ns()
        if left <= 0:
            return
        time.sleep(left / 1e9)


def run_cell(ctx: Any, url: str, server_pid: int, workload: str, clients: int,
             args: argparse.Namespace, cell_no: int) -> Cell:
    cell = f"r{os.getpid()}.{cell_no}.{workload}.c{clients}"
    warmup_ns, window_ns = int(args.warmup * 1e9), int(args.seconds * 1e9)
    ready = ctx.Barrier(clients + 1)
    go = ctx.Event()
    start_ns = ctx.Value("q", 0, lock=False)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker_main, daemon=True, args=(
            Spec(workload, cell, w, url, args.payload_bytes, args.ops, warmup_ns, window_ns),
            ready, go, start_ns, out))
        for w in range(clients)
    ]
    for p in procs:
        p.start()
    monitor = connect(url)
    try:
        try:
            ready.wait(timeout=300)
        except threading.BrokenBarrierError:
            msgs = [out.get(timeout=10) for _ in procs if not out.empty()]
            raise RuntimeError(f"{workload} x{clients}: a client failed to start: {msgs}") from None
        base = time.monotonic_ns() + 20_000_000  # everyone is past the barrier by then
        start_ns.value = base
        go.set()
        sleep_until(base + warmup_ns)
        before = snapshot(monitor, server_pid)
        if not args.ops:
            sleep_until(base + warmup_ns + window_ns)
            after = snapshot(monitor, server_pid)
        results = [out.get(timeout=args.warmup + args.seconds + 120) for _ in procs]
        if args.ops:
            after = snapshot(monitor, server_pid)
    finally:
        monitor.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"{workload} x{clients}: {failed}")

    window = window_ns
    capped = False
    if args.ops:  # end the window when the first client reached its cap
        for r in results:
            fin = array("q", r["fin"])
            if r["capped"] and fin:
                window = min(window, fin[-1])
                capped = True
    lat: list[int] = []
    per_client: list[int] = []
    errors = cpu = 0
    for r in results:
        lats, fins = array("q", r["lat"]), array("q", r["fin"])
        kept = [la for la, fi in zip(lats, fins, strict=True) if fi <= window]
        lat.extend(kept)
        per_client.append(len(kept))
        errors += r["errors"]
        cpu += r["cpu_ns"]
    lat.sort()
    # client CPU covers every measured op of each client, not only those before a cap
    measured = sum(len(array("q", r["lat"])) for r in results)
    cpu_for_kept = cpu * (sum(per_client) / measured) if measured else 0
    return Cell(workload, clients, window / 1e9, len(lat), errors, lat, per_client,
                int(cpu_for_kept), before, after, capped, cpu, measured,
                sum(r["vcsw"] for r in results), sum(r["ivcsw"] for r in results))


# --------------------------------------------------------------------------------------------
# client-side breakdown of one claim, without the network


class _StubClient:
    """Stands in for redis-py under Scripts.call: answers evalsha like claim_record does."""

    def evalsha(self, *args: Any) -> list[Any]:
        return [b"ok", 1_796_000_000_000]


def per_call_us(fn: Callable[[int], object], seconds: float = 0.3) -> float:
    n, i = 0, 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(200):
            fn(i)
            i += 1
        n += 200
        now = time.perf_counter()
        if now >= deadline:
            return (now - start) / n * 1e6


def client_breakdown(url: str, payload_bytes: int) -> list[tuple[str, float]]:
    payload = msgspec.Raw(make_payload(payload_bytes))
    store = RedisStore(connect(url), Keyspace(PREFIX), url=url)
    keys = store.keys
    rec = event("bd.0", payload)
    real_client = store.scripts.client
    store.scripts.client = _StubClient()  # type: ignore[assignment]
    try:
        rows = [
            ("EventRecord(...) construction", per_call_us(lambda i: event(f"bd.{i}", payload))),
            ("encode(record)  (msgspec JSON)", per_call_us(lambda i: encode(rec))),
            ("new_request_id()  (uuid4().hex)", per_call_us(lambda i: new_request_id())),
            ("key names: record+listing+owned (3x crc32)",
             per_call_us(lambda i: (keys.record("event", "bd.1"), keys.listing("event", 3),
                                    keys.owned("", keys.bucket_of("bd.1"))))),
            ("RedisStore.claim, redis-py stubbed out",
             per_call_us(lambda i: store.claim(event(f"bd.{i}", payload)))),
        ]
    finally:
        store.scripts.client = real_client
    client = connect(url)
    conn = client.connection_pool.get_connection()
    try:
        sha = store.scripts.scripts["claim_record"].sha
        doc = encode(rec)
        rid = new_request_id()
        rows += [
            ("redis-py pack_command(EVALSHA ... 3 keys, 4 args)",
             per_call_us(lambda i: conn.pack_command(
                 "EVALSHA", sha, 3, keys.record("event", "bd.1"), keys.listing("event", 3),
                 keys.owned("", 3), "bd.1", doc, rid, ""))),
            ("redis-py pack_command(SET key val NX)",
             per_call_us(lambda i: conn.pack_command(
                 "SET", keys.record("event", "bd.1"), doc, "NX"))),
        ]
    finally:
        client.connection_pool.release(conn)
        client.close()
        store.client.close()
    return rows


def _stats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    out = {}
    for name, row in client.info("commandstats").items():
        if isinstance(row, dict) and str(name).startswith("cmdstat_"):
            out[str(name)[8:]] = (int(row["calls"]), int(row["usec"]))
    return out


def _function_library(scripts: dict[str, Any]) -> str:
    """claim_record's exact body, registered as a Redis Function (7.0+) for comparison."""
    body = scripts["claim_record"].source.split("\n", 1)[1]  # drop the #!lua shebang
    return ("#!lua name=marbles_bench_probe\n"
            "redis.register_function('bench_noop', function(KEYS, ARGV) return {'ok', 1} end)\n"
            "redis.register_function('bench_claim_record', function(KEYS, ARGV)\n"
            f"{body}\nend)\n")


def server_probe(url: str, payload_bytes: int, calls: int = 600, batch: int = 100,
                 rounds: int = 5) -> list[tuple[str, str, float, float]]:
    """Server-side time per call from INFO commandstats. Each variant is sent from one
    connection in pipelines of `batch` (so fsync and client speed do not matter, and
    redis-server is not preempted by 16 clients), `calls` per round, variants interleaved,
    median of `rounds`: (label, command, usec per call, usec of the commands it ran)."""
    client = connect(url)
    store = RedisStore(client, Keyspace(PREFIX), url=url)
    keys, scripts = store.keys, store.scripts.scripts
    payload = msgspec.Raw(make_payload(payload_bytes))
    noop_sha = str(client.script_load("#!lua\nreturn {'ok', 1}"))
    set_sha = str(client.script_load(
        "#!lua\nif redis.call('SET', KEYS[1], ARGV[1], 'NX') then return {'ok', 1} end\n"
        "return {'exists', 0}"))
    client.function_load(_function_library(scripts), replace=True)
    tag = f"probe{os.getpid()}"
    value = encode(event(f"{tag}.0", payload))
    claim_sha, cas_sha = scripts["claim_record"].sha, scripts["cas_entry"].sha
    ws = f"{tag}.ws"
    store.compare_and_set(entry(ws, stamp(0), payload), None)

    def claim_args(v: str, i: int) -> list[Any]:
        rid = f"{tag}.{v}.{i}"
        return [3, keys.record("event", rid), keys.listing("event", keys.bucket_of(rid)),
                keys.owned("", keys.bucket_of(rid)), rid, encode(event(rid, payload)),
                new_request_id(), ""]

    variants: list[tuple[str, str, Callable[[Any, int], Any]]] = [
        ("SET key val NX", "set",
         lambda p, i: p.set(f"{setnx_key_prefix(keys)}{tag}.{i}", value, nx=True)),
        ("EVALSHA trivial script (return {'ok',1})", "evalsha",
         lambda p, i: p.evalsha(noop_sha, 0)),
        ("FCALL trivial function", "fcall", lambda p, i: p.fcall("bench_noop", 0)),
        ("EVALSHA script doing one SET key val NX", "evalsha",
         lambda p, i: p.evalsha(set_sha, 1, f"{setnx_key_prefix(keys)}{tag}.s{i}", value)),
        ("EVALSHA claim_record", "evalsha",
         lambda p, i: p.evalsha(claim_sha, *claim_args("e", i))),
        ("FCALL claim_record body as a Function", "fcall",
         lambda p, i: p.fcall("bench_claim_record", *claim_args("f", i))),
        ("EVALSHA cas_entry (update path)", "evalsha",
         lambda p, i: p.evalsha(cas_sha, 3, keys.entry(ws, "state"), keys.entries(ws),
                                keys.owned("", keys.bucket_of(ws)), stamp(i), stamp(i + 1),
                                encode(entry(ws, stamp(i + 1), payload)),
                                new_request_id(), "", "state")),
    ]
    samples: list[list[tuple[float, float]]] = [[] for _ in variants]
    for r in range(rounds):
        for v, (_, command, call) in enumerate(variants):
            before = _stats(client)
            for start in range(r * calls, (r + 1) * calls, batch):
                pipe = client.pipeline(transaction=False)
                for i in range(start, start + batch):
                    call(pipe, i)
                pipe.execute()
            after = _stats(client)
            delta = {k: (c1 - before.get(k, (0, 0))[0], u1 - before.get(k, (0, 0))[1])
                     for k, (c1, u1) in after.items()}
            n, usec = delta.get(command, (0, 0))
            inner = sum(u for k, (_, u) in delta.items()
                        if k not in ("info", "evalsha", "fcall") and k != command)
            if n:
                samples[v].append((usec / n, inner / n if command != "set" else math.nan))
    rows = []
    for (label, command, _), got in zip(variants, samples, strict=True):
        got.sort()
        usec, inner = got[len(got) // 2] if got else (math.nan, math.nan)
        rows.append((label, command, usec, inner))
    client.function_delete("marbles_bench_probe")
    client.close()
    return rows


def single_client_costs(url: str, payload_bytes: int, slice_s: float = 0.5,
                        rounds: int = 3) -> list[tuple[str, float, float]]:
    """One client in this process, variants interleaved in `slice_s` slices, median of
    `rounds`: (label, client CPU us per call, wall us per call). Separates the redis-py round
    trip, the fsync wait, the script, and the marbles_rq layer on top of redis-py."""
    payload = msgspec.Raw(make_payload(payload_bytes))
    client = connect(url)
    store = RedisStore(connect(url), Keyspace(PREFIX), url=url)
    keys = store.keys
    claim_src = store.scripts.scripts["claim_record"]
    client.script_load(claim_src.source)
    noop_sha = str(client.script_load("#!lua\nreturn {'ok', 1}"))
    tag = f"one{os.getpid()}"
    value = encode(event(f"{tag}.0", payload))
    prefix = setnx_key_prefix(keys)

    def raw_claim(i: int) -> object:
        rid = f"{tag}.r{i}"
        bucket = keys.bucket_of(rid)
        return client.evalsha(claim_src.sha, 3, keys.record("event", rid),
                              keys.listing("event", bucket), keys.owned("", bucket), rid,
                              value, new_request_id(), "")

    variants: list[tuple[str, Callable[[int], object]]] = [
        ("EVALSHA trivial script (round trip, no write, no fsync)",
         lambda i: client.evalsha(noop_sha, 0)),
        ("SET key val NX", lambda i: client.set(f"{prefix}{tag}.s{i}", value, nx=True)),
        ("EVALSHA claim_record via bare redis-py", raw_claim),
        ("RedisStore.claim", lambda i: store.claim(event(f"{tag}.c{i}", payload))),
    ]
    got: list[list[tuple[float, float]]] = [[] for _ in variants]
    i = 0
    for _ in range(rounds):
        for v, (_, fn) in enumerate(variants):
            n = 0
            t0, c0 = time.perf_counter(), time.process_time()
            while time.perf_counter() - t0 < slice_s:
                fn(i)
                i += 1
                n += 1
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            got[v].append((cpu / n * 1e6, wall / n * 1e6))
    client.close()
    store.client.close()
    rows = []
    for (label, _), samples in zip(variants, got, strict=True):
        samples.sort()
        cpu_us, wall_us = samples[len(samples) // 2]
        rows.append((label, cpu_us, wall_us))
    return rows


def profile_claims(url: str, payload_bytes: int, seconds: float, top: int) -> str:
    """cProfile of one client claiming against the live server (c=1), top `top` by tottime."""
    payload = msgspec.Raw(make_payload(payload_bytes))
    store = RedisStore(connect(url), Keyspace(PREFIX), url=url)
    tag = f"prof{os.getpid()}"
    store.claim(event(f"{tag}.0", payload))
    prof = cProfile.Profile()
    deadline = time.monotonic() + seconds
    i = n = 0
    prof.enable()
    while time.monotonic() < deadline:
        i += 1
        store.claim(event(f"{tag}.{i}", payload))
        n += 1
    prof.disable()
    store.client.close()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((k for k, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    body = [f"  {ln}" for ln in lines[start:]]
    return "\n".join([f"  {n} claims profiled (cProfile inflates Python-heavy code)", *body])


# --------------------------------------------------------------------------------------------
# output


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt(x: float, digits: int = 1) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def add(self, text: str = "") -> None:
        self.lines.append(text)
        print(text, flush=True)


def table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        cells = [c.rjust(w) if k in right else c.ljust(w)
                 for k, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  " + "  ".join(cells).rstrip())
        if n == 0:
            out.append(("  " + "  ".join("-" * w for w in widths)).rstrip())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="measured window per cell (default 3)")
    parser.add_argument("--ops", type=int, default=0,
                        help="also cap each client at N measured ops per cell (default: no cap)")
    parser.add_argument("--warmup", type=float, default=0.5,
                        help="warm-up before each window, all clients running (default 0.5)")
    parser.add_argument("--clients", default="1,16",
                        help="comma-separated concurrency levels (default 1,16)")
    parser.add_argument("--payload-bytes", type=int, default=256,
                        help="size of the EventRecord / WorkspaceEntry JSON payload (default 256)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every cell R times; report the median round (default 1)")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the client-side breakdown and the cProfile section")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.clients.split(",") if x.strip()]
    if (not levels or min(levels) < 1 or args.rounds < 1 or args.seconds <= 0 or args.ops < 0
            or args.warmup < 0):
        parser.error("need --clients >= 1, --rounds >= 1, --seconds > 0, --ops >= 0, "
                     "--warmup >= 0")

    from tests.redis_procs import RedisServer  # only the parent starts a server

    rep = Report()
    with tempfile.TemporaryDirectory(prefix="marbles-bench-") as tmp:
        server = RedisServer.start(dir=Path(tmp) / "redis")
        try:
            run(args, levels, server, rep)
        finally:
            server.stop()
    return 0


def run(args: argparse.Namespace, levels: list[int], server: Any, rep: Report) -> None:
    admin = connect(server.url)
    info = admin.info("server")
    conf = {str(k): str(v) for k, v in admin.config_get("append*").items()}
    conf.update({str(k): str(v) for k, v in admin.config_get("no-appendfsync-on-rewrite").items()})
    admin.close()
    payload = msgspec.Raw(make_payload(args.payload_bytes))
    keys = Keyspace(PREFIX)
    claim_doc = len(encode(event("claim-c16.w15.123456", payload)))
    cas_doc = len(encode(entry("cas-c16.w15", stamp(123456), payload)))
    key_len = len(keys.record("event", "claim-c16.w15.123456"))
    ncpu = os.cpu_count() or 0
    load = os.getloadavg()

    rep.add("marbles-rq store benchmark: RedisStore.claim / compare_and_set vs raw SET NX")
    rep.add(f"command  : {shlex.join([Path(sys.executable).name, *sys.argv])}")
    rep.add(f"redis    : {info.get('redis_version')} ({info.get('redis_build_id', '')}), "
            f"pid {server.pid}, {server.url}")
    rep.add(f"           started as: {shlex.join(server.command())}")
    rep.add(f"durability (CONFIG GET): appendonly={conf.get('appendonly')} "
            f"appendfsync={conf.get('appendfsync')} "
            f"no-appendfsync-on-rewrite={conf.get('no-appendfsync-on-rewrite')}")
    rep.add(f"machine  : {ncpu} CPUs, SHARED by redis-server, all client processes and anything "
            f"else running; load avg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
    rep.add(f"clients  : python {platform.python_version()}, redis-py {redis.__version__} "
            f"(hiredis parser: {'yes' if redis.utils.HIREDIS_AVAILABLE else 'no'}), "
            "marbles_rq.store.connection.connect; one OS process + one connection per client "
            "(multiprocessing spawn), start barrier")
    cap = f", capped at {args.ops} ops/client" if args.ops else ""
    rep.add(f"timing   : per cell {args.warmup:g} s warm-up then a {args.seconds:g} s wall-clock "
            f"window{cap}; ops counted when they complete inside the window")
    rep.add(f"sizes    : claim doc {claim_doc} B, CAS doc {cas_doc} B, SET NX value {claim_doc} B "
            f"(a claim's doc), keys ~{key_len} B; payload {args.payload_bytes} B; "
            "claim owner=''")
    rep.add()

    ctx = mp.get_context("spawn")
    runs: dict[tuple[str, int], list[Cell]] = {}
    n = 0
    for _ in range(args.rounds):
        for clients in levels:
            for workload in WORKLOADS:
                n += 1
                runs.setdefault((workload, clients), []).append(
                    run_cell(ctx, server.url, server.pid, workload, clients, args, n))
    cells = {k: merge(v) for k, v in runs.items()}

    rows = [["clients", "op", "ops/s", "p50 ms", "p99 ms", "x SET NX", "errors",
             "ops/s of each round" if args.rounds > 1 else ""]]
    for clients in levels:
        base = cells["setnx", clients].rate
        for workload in WORKLOADS:
            c = cells[workload, clients]
            ratio = c.rate / base if base else math.nan
            rows.append([str(clients), LABEL[workload], fmt_rate(c.rate), fmt(c.pct(0.5), 3),
                         fmt(c.pct(0.99), 3), fmt(ratio, 2), str(c.errors),
                         " ".join(fmt_rate(r) for r in c.round_rates)])
    rep.add("results (appendfsync always)")
    for line in table(rows, right={0, 2, 3, 4, 5, 6}):
        rep.add(line)
    if any(c.capped for c in cells.values()):
        rep.add("  (some windows ended early: a client reached --ops)")
    rep.add()

    rep.add(f"aim: claim >= {AIM}x raw SET NX (verdict on measured ops/s; the two estimates "
            "beside it are less sensitive to other load on the machine)")
    for clients in levels:
        ref = cells["setnx", clients]
        ref_cpu = ref.client_cpu_us_per_op() + ref.server_cpu_us_per_op()
        for workload in ("claim", "cas"):
            c = cells[workload, clients]
            ratio = c.rate / ref.rate if ref.rate else math.nan
            cpu = c.client_cpu_us_per_op() + c.server_cpu_us_per_op()
            by_cpu = ref_cpu / cpu if cpu else math.nan
            by_p50 = ref.pct(0.5) / c.pct(0.5)
            verdict = "met" if ratio >= AIM else "NOT MET"
            rep.add(f"  {LABEL[workload]:5s} at {clients:2d} client(s): {ratio:.2f}x  {verdict:7s}"
                    f"  [by CPU per op {by_cpu:.2f}x, by p50 latency {by_p50:.2f}x]")
    rep.add("  by CPU per op: SET NX's (client + server) CPU per op / this op's, the throughput "
            "ratio when the CPUs are saturated")
    rep.add("  by p50 latency: SET NX's p50 / this op's, the throughput ratio of closed-loop "
            "clients when latency, not CPU, limits them")
    rep.add()

    rows = [["clients", "op", "client CPU", "server CPU", "server cmd", "script inner",
             "CPU total", "CPU-bound max", "host busy", "other", "ctx sw/op",
             "ops/client"]]
    for clients in levels:
        for workload in WORKLOADS:
            c = cells[workload, clients]
            main_cmd = MAIN_COMMAND[workload]
            total = c.client_cpu_us_per_op() + c.server_cpu_us_per_op()
            bound = ncpu * 1e6 / total if total else math.nan
            spread = (f"{min(c.per_client)}..{max(c.per_client)}" if c.per_client else "-")
            rows.append([str(clients), LABEL[workload], fmt(c.client_cpu_us_per_op()),
                         fmt(c.server_cpu_us_per_op()),
                         f"{main_cmd} {fmt(c.usec_per_call(main_cmd), 2)}",
                         fmt(c.inner_usec_per_op(), 2), fmt(total), fmt_rate(bound),
                         f"{c.host_busy_pct():.0f}%", f"{c.other_cpu_pct():.0f}%",
                         c.switches_per_op(), spread])
    rep.add("where the time goes (same windows; CPU in us per op)")
    for line in table(rows, right={0, 2, 3, 5, 6, 7, 8, 9, 10}):
        rep.add(line)
    rep.add("  client CPU  : sum of the client processes' CPU time / ops (Python, redis-py, "
            "syscalls)")
    rep.add("  server CPU  : redis-server CPU time, all threads (/proc schedstat) / calls; "
            "includes networking, AOF write")
    rep.add("  server cmd  : INFO commandstats usec_per_call: time executing the command "
            "(for evalsha: the whole script)")
    rep.add("  script inner: of that, the commands the script ran (HMGET, TIME, HSET, "
            "ZADD, ...) per script call")
    rep.add(f"  CPU-bound max: {ncpu} CPUs / (client + server CPU per op), the ceiling "
            "when the CPUs, not fsync, are the limit")
    rep.add("  host busy / other: all CPUs' utilisation (/proc/stat, tick-sampled), and the part "
            "of it not used by these clients or redis-server (other sessions, kernel)")
    rep.add("  ctx sw/op   : client context switches per op, voluntary (waiting for the reply) + "
            "involuntary (preempted)")
    noisy = [c for c in cells.values() if c.other_cpu_pct() > OTHER_LOAD_WARN]
    for c in noisy:
        rep.add(f"  WARNING: {LABEL[c.workload]} x{c.clients}: {c.other_cpu_pct():.0f}% of the "
                "machine was busy with other work during the window; its ops/s and ratio are "
                "not trustworthy (re-run, or use --rounds 3)")
    rep.add()

    if not args.no_profile:
        rep.add("client-side cost of one claim without the network (one process, us per call)")
        for name, us in client_breakdown(server.url, args.payload_bytes):
            rep.add(f"  {name:52s} {us:7.2f}")
        rep.add()
        rep.add("one client, back to back (variants interleaved, median of 3 x 0.5 s): "
                "client CPU and wall time per call, us")
        rows = [["call", "client CPU", "wall"]]
        for label, cpu_us, wall_us in single_client_costs(server.url, args.payload_bytes):
            rows.append([label, fmt(cpu_us), fmt(wall_us)])
        for line in table(rows, right={1, 2}):
            rep.add(line)
        rep.add()
        rep.add("server-side time per call: one connection, pipelines of 100, variants "
                "interleaved, median of 5 x 600 calls (INFO commandstats)")
        rows = [["call", "cmd", "us/call", "of which inner cmds"]]
        for label, command, usec, inner in server_probe(server.url, args.payload_bytes):
            rows.append([label, command, fmt(usec, 2), fmt(inner, 2)])
        for line in table(rows, right={2, 3}):
            rep.add(line)
        rep.add()
        rep.add("cProfile of RedisStore.claim, 1 client, live server, top 14 by tottime")
        rep.add(profile_claims(server.url, args.payload_bytes, 1.5, 14))
        rep.add()


if __name__ == "__main__":
    sys.exit(main())
