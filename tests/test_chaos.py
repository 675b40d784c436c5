"""CI runs the chaos test's short mode on every change (issue 9): `ops/chaos` with a fixed
seed must end with "violations: 0" and exit 0. Real processes, real signals: a durable
redis-server, two controllers, forking and --pool workers, 500 runs of every workload (the
combinations of issue 16 included: pause/resume storms, children gathered late, cancels
while children start, concurrency limits, reruns from a step, priorities; and runs that
wait for signals sent while processes die, and runs that publish their state and wait for a
matching event among decoys; compensating runs, steps under a retry policy paused when
their tries run out and retried with a patched input, bursts of rate-limited runs;
sessions, artifacts put by compare-and-set, a durable mutex with its holder stopped), 30
worker kills,
5 leader kills, 2 Redis kills and 5 SIGSTOPs (see tests/chaos/). Then the same on three
lanes, smaller (300 runs, 18 worker kills). A few minutes each on 2 cores.

A failure prints the summary (each violation, with its run) and keeps the work dir (process
logs, harness log, Redis data; `ops/chaos --recheck DIR` checks it again).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.procs import REPO_ROOT

SEED = 4242
LANES_SEED = 4243
# Names in the summary's "checked:" line that must each count something.
COVERED = ("runs", "steps", "effects", "questions", "timers", "children", "events",
           "schedule cx-tick", "paused runs", "paused runs parked", "children gathered late",
           "children of cancelled parents", "limit samples cx_limited",
           "limit samples cx_limited_key customer=acme", "reruns", "priority bands",
           "runs started later", "signals", "event waits", "event waits parked",
           "event waits taken at once", "decoy events",
           "published values", "compensated runs", "retry runs", "retries patched",
           "rate-limited starts lane=north", "rate-limited starts lane=south",
           "session runs", "session messages", "artifact puts",
           "artifact puts by compare-and-set", "lock runs", "lock passes written")


def _chaos(*args: str) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found on PATH: the chaos test runs a real one")
    env = {k: v for k, v in os.environ.items() if k != "MARBLES_CHAOS_LANES"}
    env["PYTHON"] = sys.executable
    done = subprocess.run([str(REPO_ROOT / "ops" / "chaos"), *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=840,
                          stdin=subprocess.DEVNULL)
    print(done.stdout)  # pytest shows it on failure (and with -s)
    print(done.stderr, file=sys.stderr)
    assert f"seed {args[1]}" in done.stdout
    # Every workload was exercised and checked, not only planned.
    checked = next((line for line in done.stdout.splitlines()
                    if line.startswith("checked: ")), "")
    counts = {name: int(n) for name, n in (item.rsplit(" ", 1) for item in
                                            checked[len("checked: "):].split(", ") if item)}
    for what in COVERED:
        assert counts.get(what, 0) > 0, f"nothing checked for {what!r}: {checked}"
    assert "violations: 0" in done.stdout, done.stdout[-6000:]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


@pytest.mark.timeout(900)
def test_chaos_short_mode() -> None:
    _chaos("--seed", str(SEED))


@pytest.mark.timeout(900)
def test_chaos_short_mode_three_lanes() -> None:
    _chaos("--seed", str(LANES_SEED), "--lanes", "3", "--runs", "300", "--kills", "18")
