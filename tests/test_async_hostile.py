"""Async workflows and `worker --concurrency`, used the way a careless or hostile user may:
each test names what a user relies on. Real redis-server, real `marbles-rq worker` /
`controller` processes; the workflows are in tests/async_hostile.py.
"""

from __future__ import annotations

from typing import Any

from tests.async_hostile import EXEC_PREFIX
from tests.procs import REPO_ROOT, Observer, Procs
from tests.test_waiting_questions import final

PROCS_SOURCES = (REPO_ROOT / "tests" / "async_hostile.py",)


def executions(obs: Observer, run_id: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in obs.client.hgetall(EXEC_PREFIX + run_id).items()}


def test_gathered_helpers_get_their_own_results_after_a_replay(procs: Procs) -> None:
    """Two gathered helper coroutines each await two steps; they reach their second step in
    the other order than their first. After the durable sleep the body is replayed from the
    top: each helper must get its own recorded results back, not its sibling's."""
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("ah_helpers", None, "help")
    data: dict[str, Any] = final(obs, "help")
    assert data["result"] == ["item-0", "item-1"], obs.dump("help")
    assert executions(obs, "help") == {"fetch0": 1, "fetch1": 1, "label0": 1, "label1": 1}
    view = obs.view("help")
    assert view is not None
    # Each helper's calls are recorded in the frame of its task (in order of creation).
    assert {s.key for s in view.steps if not s.name.startswith("|")} == {
        "ah_helpers.|task#0.ah_fetch#0", "ah_helpers.|task#0.ah_label#0",
        "ah_helpers.|task#1.ah_fetch#0", "ah_helpers.|task#1.ah_label#0"}
