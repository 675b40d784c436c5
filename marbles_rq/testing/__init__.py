"""The test kit: workflows run in memory on a virtual clock, by the same executor as on a
worker (engine/memory_engine.py), without Redis.

    from marbles_rq.testing import Environment

    env = Environment()
    run = env.start(my_workflow, {"n": 1})
    env.advance(timedelta(days=30))
    assert run.result() == ...

With pytest, the `mr_env` fixture (marbles_rq/testing/pytest_plugin.py, registered through
the pytest11 entry point) yields one. This package imports nothing heavy until
`Environment` is used: pytest loads the plugin in every session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .environment import Environment
    from .replays import check_replays
    from .schedules import Fired

__all__ = ["Environment", "Fired", "check_replays"]


def __getattr__(name: str) -> Any:
    if name == "Environment":
        from .environment import Environment

        return Environment
    if name == "check_replays":
        from .replays import check_replays

        return check_replays
    if name == "Fired":
        from .schedules import Fired

        return Fired
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
