"""bench/.peers: the venv of the peers bench/concurrency.py measures (Dramatiq, Huey), and of
py-spy for its --profile, made on first use with pip from PyPI; the project's own venv stays
without them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from .runs_util import REPO_ROOT

PEERS_DIR = REPO_ROOT / "bench" / ".peers"
PEERS_BIN = PEERS_DIR / "bin"
PEERS_PY = PEERS_BIN / "python"
PACKAGES = ("dramatiq[redis]", "huey", "redis", "hiredis", "httpx", "py-spy")
PY_SPY = PEERS_BIN / "py-spy"
_PROBE = """
import importlib, importlib.metadata
for mod in ("dramatiq", "huey", "redis", "hiredis", "httpx"):
    try:
        importlib.import_module(mod)
        print(mod, importlib.metadata.version(mod))
    except Exception:
        pass
"""


def installed() -> dict[str, str]:
    """Module -> version, for the modules bench/.peers can import."""
    if not PEERS_PY.exists():
        return {}
    out = subprocess.run([str(PEERS_PY), "-c", _PROBE], capture_output=True, text=True,
                         timeout=120).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def ensure(say: Callable[[str], None]) -> dict[str, str]:
    """bench/.peers with every peer package, made and installed if need be; what it has.
    A failed install (no route to PyPI) is said in one line, not raised: the bench then
    skips the peers it lacks."""
    have = installed()
    if {"dramatiq", "huey", "redis", "httpx"} <= have.keys() and PY_SPY.exists():
        return have
    if not PEERS_PY.exists():
        say(f"peers: creating the venv {PEERS_DIR.relative_to(REPO_ROOT)}")
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_DIR)], check=True,
                       capture_output=True, timeout=300)
    say(f"peers: pip install {' '.join(PACKAGES)} (from PyPI, once)")
    try:
        proc = subprocess.run([str(PEERS_PY), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", "--timeout", "20", "--retries",
                               "1", *PACKAGES], capture_output=True, text=True, timeout=900)
        failed = proc.returncode != 0
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
    except subprocess.TimeoutExpired:
        failed, why = True, "pip did not finish in 900 s"
    if failed:
        say(f"peers: pip could not install them (can it reach PyPI?): {why}")
    return installed()
