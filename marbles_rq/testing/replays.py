"""`check_replays`: `marbles-rq replay --check` from a test. A CI job exports the runs in
flight from production (`marbles-rq export --workflow W > runs.jsonl`, or
`client.export(...)`), keeps the file with the change, and a test asserts that the new code
replays every one of them:

    report = check_replays("tests/histories/orders.jsonl")
    assert report.failing == 0, [v.summary for v in report.verdicts if not v.ok]
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..engine.authoring import REGISTRY, Registry
from ..engine.history import History, read_file
from ..engine.replay_check import Report, check_all


def check_replays(histories: Iterable[History] | str | Path, *,
                  registry: Registry = REGISTRY) -> Report:
    """Replay `histories` (History records, or the path of a file `export` wrote) against
    the workflows `registry` declares (those this process imported), in memory, without
    running step bodies. The report has a verdict per run (`ok`, `summary`, `problems`)
    and, per patch, the runs in flight still on its old branch (`old_branch`)."""
    source = read_file(str(histories)) if isinstance(histories, (str, Path)) else histories
    return check_all(source, registry)


__all__ = ["check_replays"]
