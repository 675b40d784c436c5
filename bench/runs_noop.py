"""The plain-RQ job of bench/runs.py: a no-op, importable by `rq worker` as
``bench.runs_noop.noop`` (run from the repo root)."""

from __future__ import annotations


def noop() -> None:
    return None
