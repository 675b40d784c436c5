"""CI runs the chaos test's short mode on every change (issue 9): `ops/chaos` with a fixed
seed must end with "violations: 0" and exit 0. Real processes, real signals: a durable
redis-server, two controllers, forking and --pool workers, 500 runs, 30 worker kills, 5
leader kills, 2 Redis kills and 4 SIGSTOPs (see tests/chaos/). A few minutes on 2 cores.

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


@pytest.mark.timeout(900)
def test_chaos_short_mode() -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found on PATH: the chaos test runs a real one")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(REPO_ROOT / "ops" / "chaos"), "--seed", str(SEED)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=840,
                          stdin=subprocess.DEVNULL)
    print(done.stdout)  # pytest shows it on failure (and with -s)
    print(done.stderr, file=sys.stderr)
    assert f"seed {SEED}" in done.stdout
    assert "violations: 0" in done.stdout, done.stdout[-6000:]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
