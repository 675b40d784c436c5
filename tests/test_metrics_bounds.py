"""The metrics endpoint under hostile neighbours (issue 16, items 12 and 13): idle
connections by the hundred, label values chosen by whoever enqueues, a multiprocess
directory another local user creates first. Real processes, real sockets, scraped over
HTTP."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import REPO_ROOT, Procs, wait_for
from tests.redis_procs import free_port
from tests.test_metrics import PROCS_SOURCES, await_metric, scrape, value

__all__ = ["PROCS_SOURCES"]  # the procs fixture reads it from this module


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def test_idle_connections_cost_no_thread_and_are_closed(procs: Procs) -> None:
    """Each connection to a metrics endpoint held a thread for as long as the client kept
    it open, with no timeout: 400 idle connections were 405 threads (48 -> 109 MB). Idle
    connections now cost no thread, at most 64 stay open, each is closed after 5 s, and
    scrapes are answered meanwhile."""
    port = free_port()
    ctl = procs.controller(extra=["--metrics-port", str(port)])
    await_metric(port, lambda s: True, "a first scrape")
    before = _threads(ctl.pid)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(400)]
    try:
        # Answered after the 400 were accepted (it connected after them).
        assert value(scrape(port), "marbles_rq_horse_deaths_total") == 0
        assert _threads(ctl.pid) <= before + 6, (before, _threads(ctl.pid))
        for s in idle:
            s.settimeout(30)

        def closed(s: socket.socket) -> bool | None:
            try:
                return True if s.recv(1) == b"" else None
            except ConnectionResetError:
                return True

        for s in idle:
            wait_for(lambda s=s: closed(s), timeout=30, what="the server to close an idle "
                     "connection")
        assert value(scrape(port), "marbles_rq_horse_deaths_total") == 0
    finally:
        for s in idle:
            s.close()


LABELS = """
import sys, urllib.request
import marbles_rq as mr
from marbles_rq import metrics

@mr.workflow
def known(ctx: mr.RunContext) -> None:
    return None

metrics.serve_metrics(int(sys.argv[1]), "127.0.0.1")
for i in range(300):
    metrics.run_enqueued(f"made-up-{i}", f"queue-{i}")
    metrics.run_started(f"made-up-{i}")
    metrics.redelivered(f"queue.{i}" if i % 2 else f"queue-{i}", "lease_expired")
metrics.run_enqueued("known", "default")
metrics.run_started("known")
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5) as reply:
    sys.stdout.write(reply.read().decode())
"""


def test_label_values_are_bounded_whatever_is_enqueued(tmp_path: Path) -> None:
    """Workflow and queue labels took any name an enqueuer gave: every unknown workflow and
    every queue name was a new series of several metrics, for the life of the process. A
    workflow the process does not know is counted as `_other`, an invalid queue name too,
    and a label has at most 100 distinct values (the rest: `_other`)."""
    done = subprocess.run([sys.executable, "-c", LABELS, str(free_port())], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    values: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(done.stdout):
        for sample in family.samples:
            for label in ("workflow", "queue"):
                if label in sample.labels:
                    values.setdefault((family.name, label), set()).add(sample.labels[label])
    assert values[("marbles_rq_runs_started", "workflow")] == {"known", "_other"}
    assert values[("marbles_rq_runs_enqueued", "workflow")] == {"known", "_other"}
    for metric in ("marbles_rq_runs_enqueued", "marbles_rq_redeliveries"):
        queues = values[(metric, "queue")]
        assert len(queues) <= 101 and "_other" in queues, (metric, len(queues))
        assert not any("." in q for q in queues), metric


@pytest.mark.parametrize("planted", ["another-users-dir", "symlink"])
def test_a_metrics_directory_planted_first_changes_nothing(procs: Procs, tmp_path: Path,
                                                           planted: str) -> None:
    """A worker's multiprocess directory had a predictable name: another local user could
    create it first (a directory of theirs, or a link to one) and the worker refused to
    start with metrics (or, had it accepted, would count into a place they read). It is a
    new private directory now (random name, 0700, ours): the planted one is left alone."""
    base = tmp_path / "shm"
    base.mkdir(mode=0o1777)
    base.chmod(0o1777)
    port = free_port()
    name = f"marbles-rq-metrics.{os.getuid()}.127.0.0.1.{port}"
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    if planted == "symlink":
        (base / name).symlink_to(elsewhere)
    else:
        (base / name).mkdir()
        os.chown(base / name, 65534, 65534)  # (the tests run as root)
    procs.env["MARBLES_METRICS_DIR"] = str(base)
    worker = procs.worker(ready=False, extra=["--queues", "default", "--metrics-port",
                                              str(port)])
    worker.wait_log("*** Listening on")
    procs.controller()
    procs.enqueue("mok", None, "planted-1")
    await_metric(port, lambda s: value(s, "marbles_rq_runs_finished_total", workflow="mok",
                                       status="succeeded") == 1, "the run counted")
    ours = [p for p in base.iterdir() if p.name.startswith(name + ".")]
    assert len(ours) == 1, list(base.iterdir())
    info = os.lstat(ours[0])
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700
    assert any(ours[0].glob("*.db"))
    assert list(elsewhere.iterdir()) == []
    assert (base / name).is_symlink() == (planted == "symlink")


def test_queue_gauges_leave_out_another_prefixs_queues(procs: Procs) -> None:
    """The controller's queue gauges matched RQ queues by `<prefix>.` alone, and a prefix may
    hold a dot: the controller of prefix `sec` reported prefix `sec.x`'s queue `held` as its
    own queue `x.held`."""
    def enqueue(prefix: str, run_id: str, queue: str) -> None:
        done = subprocess.run(procs.cli_argv("enqueue", "mok", "--input", "null", "--id",
                                             run_id, "--queue", queue),
                              env=dict(procs.env, MARBLES_PREFIX=prefix),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    enqueue("sec", "mine-1", "mine")
    enqueue("sec.x", "theirs-1", "held")
    procs.env["MARBLES_PREFIX"] = "sec"
    port = free_port()
    procs.controller(extra=["--metrics-port", str(port)])
    samples = await_metric(port, lambda s: value(s, "marbles_rq_queue_depth", queue="mine",
                                                 lane="0") == 1, "the depth of queue mine")
    queues = {dict(labels)["queue"] for name, labels in samples
              if name == "marbles_rq_queue_depth"}
    assert queues == {"mine"}, queues
