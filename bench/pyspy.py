"""py-spy (from bench/.peers) on a worker's process tree over a measured window, and the
summary of where its Python time went: the functions most often running (self), the frames
most often on the stack (inclusive), and self time by package. Only the thread holding the
GIL is sampled (--gil): shares are of the time the worker runs Python (and C holding the
GIL, e.g. hiredis's parser), not of its waits on sockets or locks, nor of kernel time."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

from .peer_venv import PY_SPY

_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^()]*?)(?::(?P<line>\d+))?\)$")


class Recorder:
    def __init__(self, pid: int, out: Path, rate: int = 400) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [str(PY_SPY), "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--gil",
             "--rate", str(rate), "--format", "raw", "--output", str(out), "--duration",
             "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> str:
        """Stops it (SIGINT: py-spy writes what it has); its error text, if any."""
        with contextlib.suppress(OSError):
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "py-spy did not stop"
        return "" if self.out.exists() else (err or b"").decode(errors="replace")[-500:]


def _where(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3.11/", "/lib/python3.12/", "/lib/python3.13/"):
        if marker in path:
            return path.split(marker, 1)[1]
    for marker in ("/marbles_rq/", "/bench/", "/tests/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path


def _package(where: str) -> str:
    head = where.split("/", 1)[0]
    if head.endswith(".py") or head == where:
        return "stdlib" if not where.startswith(("<", "bench")) else where
    return head


def summarize(path: Path, top: int = 12) -> list[str]:
    self_: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    pkgs: Counter[str] = Counter()
    total = 0
    with contextlib.suppress(OSError), path.open() as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = []
            for raw in stack.split(";"):
                found = _FRAME.match(raw)
                if found is None:  # "process N:..." / "thread ..." roots
                    continue
                frames.append((found["func"], _where(found["path"])))
            if not frames:
                continue
            total += n
            func, where = frames[-1]
            self_[f"{func} ({where})"] += n
            pkgs[_package(where)] += n
            for f in {f"{fn} ({w})" for fn, w in frames}:
                incl[f] += n
    if not total:
        return ["  (no samples)"]
    out = [f"  {total} samples holding the GIL; self time by package: "
           + ", ".join(f"{k} {v / total:.0%}" for k, v in pkgs.most_common(8))]
    out.append("  most often running (self):")
    out += [f"    {v / total:5.1%}  {k}" for k, v in self_.most_common(top)]
    # Thread and event-loop roots are on nearly every stack and say nothing.
    roots = ("threading.py", "runpy.py", "click/", "concurrent/futures/thread.py")
    shown = [(k, v) for k, v in incl.most_common() if v < 0.95 * total
             and not k.rsplit(" (", 1)[1].startswith(roots)]
    out.append("  most often on the stack (inclusive, roots left out):")
    out += [f"    {v / total:5.1%}  {k}" for k, v in shown[:top * 2]]
    return out
