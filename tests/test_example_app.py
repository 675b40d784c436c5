"""examples/app/: the shop's client demos (sync and asyncio) end to end against a real
redis-server, a real worker and controller running examples/app/shop.py. The demos run as
another service would: their own process, no workflow source, only MARBLES_REDIS_URL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT, Procs

SHOP_SOURCE = REPO_ROOT / "examples" / "app" / "shop.py"
PROCS_SOURCES = (SHOP_SOURCE,)


def _run_demo(procs: Procs, script: str, cwd: Path) -> list[str]:
    env = {k: v for k, v in procs.env.items() if k != "MARBLES_SOURCE"}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "app" / script)],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


@pytest.fixture
def shop(procs: Procs) -> Procs:
    procs.controller()
    procs.worker(pool=2)
    return procs


def test_the_sync_demo(shop: Procs, tmp_path: Path) -> None:
    lines = _run_demo(shop, "client_demo.py", tmp_path)
    by = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines}
    assert by["placed"].startswith("{'status': 'placed', 'total': 36,")
    assert by["started again"] == "the same run, nothing new"
    assert by["batch"] == "[45, 12]"
    assert by["failed"] == "ValueError unknown sku 'unicorn'"
    assert by["waiting for"] == "[('big-order', 'Approve an order of 2400?')]"
    assert by["approve"].endswith("big-order approved; run woken")
    assert by["big order"].startswith("{'status': 'placed', 'total': 2400,")
    assert by["cancel"] in ("cancelled", "requested")
    assert by["restock"] == "cancelled"
    assert by["timeout"] == "timeout"
    assert by["recent orders"] == "5"  # order 1, the batch's two, unicorn, the big one
    # What the demo printed is what the store holds.
    big_id = by["approve"].split()[1].rstrip(":")
    view = shop.observer.view(big_id)
    assert view is not None and view.status == "succeeded" and view.resumptions == 1


def test_the_asyncio_demo(shop: Procs, tmp_path: Path) -> None:
    lines = _run_demo(shop, "client_demo_async.py", tmp_path)
    assert lines[0] == "totals: " + str([(12 if i % 2 else 45) * i for i in range(1, 11)])
    assert lines[1].startswith("approve: run a-") and lines[1].endswith("approved; run woken")
    assert lines[2] == "big order: placed 1200"
    assert lines[3] == "failed: unknown sku 'unicorn'"
