"""Helpers of bench/runs.py: child processes (started in their own sessions, killed as whole
trees), CPU accounting from /proc, Redis server counters, percentiles and tables."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import resource
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = REPO_ROOT / ".venv" / "bin"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- numbers --------------------------------------------------------------------------------

def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def median(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ratio(a: float, b: float) -> str:
    if not b or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        lines.append(indent + "  ".join(parts).rstrip())
        if n == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- machine --------------------------------------------------------------------------------

def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def mem_total() -> str:
    with contextlib.suppress(OSError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return "?"


def load_line() -> str:
    """Load average and CPU pressure (PSI): how busy the host is apart from us."""
    one, five, _ = os.getloadavg()
    psi = "n/a"
    with contextlib.suppress(OSError, IndexError, ValueError), open("/proc/pressure/cpu") as fh:
        some = fh.readline().split()
        psi = f"{float(some[1].split('=')[1]):.0f}%/{float(some[2].split('=')[1]):.0f}%"
    return f"loadavg 1m {one:.2f} 5m {five:.2f}; CPU pressure 'some' avg10/avg60 {psi}"


# -- /proc ----------------------------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    # comm may contain spaces: everything after the last ')' is space separated
    return text[text.rindex(")") + 2:].split()


def proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a live process (all its threads)."""
    fields = _stat(pid)
    if fields is None:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_cpu_s() -> float:
    """CPU seconds of all terminated, waited-for descendants of this process."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (by parent pid), deepest last."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


# -- child processes ------------------------------------------------------------------------

@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Procs:
    """Every process the benchmark starts: own session (so its group can be killed), output
    to a log file, killed as a whole tree (RQ's horses leave the group with setpgrp)."""

    logdir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)  # every pid we started or saw below one
    _n: int = 0

    def start(self, name: str, argv: list[str]) -> Child:
        self._n += 1
        log = self.logdir / f"{self._n:03d}-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        child = Child(name, argv, proc, log)
        self.children.append(child)
        self.seen.add(proc.pid)
        return child

    def note_tree(self, child: Child) -> list[int]:
        below = descendants(child.pid)
        self.seen.update(below)
        return below

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        """`sig` to the process, its group and everything below it; then reap it."""
        below = self.note_tree(child) if child.proc.poll() is None else []
        for target in (child.pid, *below):
            with contextlib.suppress(OSError):
                os.kill(target, sig)
        with contextlib.suppress(OSError):
            os.killpg(child.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=10)

    def stop(self, child: Child, timeout: float = 10.0) -> None:
        """SIGTERM (a warm shutdown), then SIGKILL of the whole tree if it lingers."""
        if child.proc.poll() is None:
            self.note_tree(child)
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=timeout)
        self.kill(child)

    def cleanup(self) -> list[int]:
        """Kill everything ever started; return the pids still alive afterwards (strays)."""
        for child in self.children:
            if child.proc.poll() is None:
                self.note_tree(child)
        for child in self.children:
            self.kill(child)
        for pid in list(self.seen):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in self.seen):
            time.sleep(0.05)
        return sorted(p for p in self.seen if alive(p))


# -- Redis counters -------------------------------------------------------------------------

@dataclass
class ServerStats:
    commands: int
    reads: int
    net_in: int
    net_out: int
    calls: dict[str, int]
    usec: dict[str, int]

    def minus(self, before: ServerStats) -> ServerStats:
        return ServerStats(
            self.commands - before.commands, self.reads - before.reads,
            self.net_in - before.net_in, self.net_out - before.net_out,
            {k: v - before.calls.get(k, 0) for k, v in self.calls.items()
             if v - before.calls.get(k, 0)},
            {k: v - before.usec.get(k, 0) for k, v in self.usec.items()
             if v - before.usec.get(k, 0)})


def server_stats(client: Any) -> ServerStats:
    pipe = client.pipeline(transaction=False)
    pipe.info("stats")
    pipe.info("commandstats")
    stats, cmds = pipe.execute()
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in cmds.items()}
    usec = {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in cmds.items()}
    return ServerStats(int(stats["total_commands_processed"]),
                       int(stats["total_reads_processed"]), int(stats["total_net_input_bytes"]),
                       int(stats["total_net_output_bytes"]), calls, usec)
