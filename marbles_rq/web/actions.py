"""What the dashboard's buttons do: the same engine calls as the CLI commands, each returning
the one line the CLI would print (or raising the error it would print).

cancel -> `marbles-rq cancel`, pause/resume -> `pause`/`resume`, answer/approve/reject ->
`answer`/`approve`/`reject` (WaitStore.answer: compare-and-set on the question's revision,
then the woken delivery is enqueued), schedule pause/resume -> `schedules pause/resume`.
rerun -> `rerun` (engine/rerun.py, with the page's new id: see Actions.rerun).
"""

from __future__ import annotations

from typing import Any

import redis

from ..deployment import Settings
from ..engine.execution import RunNotFoundError
from ..engine.rerun import rerun as rerun_run
from ..engine.waits import WaitStore
from ..errors import MarblesError
from ..store.ids import check_id
from ..store.redis_errors import one_line
from ..triggers.schedules import KEY_PATTERN, SCHEDULES, UnknownScheduleError, set_paused


class Actions:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def _waits(self) -> WaitStore:
        return WaitStore(self.settings.runs())

    def _enqueue(self, run_id: str, attempt: int, queue: str) -> str:
        """Enqueue a woken run's delivery now; the controller dispatches it if this fails."""
        try:
            self.settings.rq().enqueue(queue, run_id, attempt)
        except redis.RedisError as exc:
            return f"; the controller will dispatch it ({one_line(exc)})"
        return ""

    def cancel(self, run_id: str) -> str:
        runs = self.settings.runs()
        outcome = runs.cancel(check_id(run_id, "run id"))
        if outcome == "missing":
            raise RunNotFoundError(f"no run with id {run_id!r}")
        line = {"cancelled": f"run {run_id} cancelled",
                "requested": f"run {run_id} is running; cancel requested, it stops at its "
                             f"next step boundary",
                "settled": f"run {run_id} has already finished; nothing to cancel"}[outcome]
        if outcome != "settled":
            children = WaitStore(runs).cancel_children(run_id)
            if children:
                line += f"; cancelled {len(children)} child runs"
        return line

    def pause(self, run_id: str) -> str:
        outcome = self._waits().pause(check_id(run_id, "run id"))
        if outcome == "settled":
            raise MarblesError(f"run {run_id} has already finished; nothing to pause")
        return {"paused": f"run {run_id} paused",
                "requested": f"run {run_id} will park at its next step boundary (paused)",
                "already": f"run {run_id} is already paused"}[outcome]

    def resume(self, run_id: str) -> str:
        outcome, attempt, queue = self._waits().resume(check_id(run_id, "run id"))
        if outcome == "woken":
            return f"run {run_id} resumed (delivery {attempt})" + self._enqueue(run_id, attempt,
                                                                               queue)
        if outcome == "resumed":
            return f"run {run_id} resumed before it parked; it carries on"
        raise MarblesError(f"run {run_id} has already finished; nothing to resume")

    def answer(self, run_id: str, key: str, value: Any, *, kind: str, what: str) -> str:
        waits = self._waits()
        done = waits.answer(check_id(run_id, "run id"), key, value, kind=kind)
        if done.woken_attempt:
            tail = "; run woken" + self._enqueue(run_id, done.woken_attempt, done.queue)
        else:
            tail = "; the run sees it when it next replays"
        return f"run {run_id}: {done.question.key} {what}{tail}"

    def rerun(self, run_id: str, from_step: str | None = None,
              new_id: str | None = None) -> tuple[str, str]:
        """`marbles-rq rerun RUN [--from-step PATH] [--id NEW_ID]`: the same engine call
        (engine/rerun.py), so the same refusals (a run that has not finished, a step it does
        not have, an id taken by another run). The page's form carries the new id, minted
        when the page was drawn, so a repeated POST returns the rerun the first one made.
        Returns (the new run's id, the CLI's line)."""
        done = rerun_run(self.settings.runs(), self.settings.rq(), check_id(run_id, "run id"),
                         from_step=from_step or None, new_id=new_id or None)
        return done.run_id, done.summary()

    def pause_schedule(self, key: str, paused: bool) -> str:
        if not KEY_PATTERN.fullmatch(key):
            raise UnknownScheduleError(f"unknown schedule {key!r}")
        was = set_paused(self.settings.runs(), key, paused, SCHEDULES)
        word = "paused" if paused else "resumed"
        return f"schedule {key} {'was already ' if was == paused else ''}{word}"
