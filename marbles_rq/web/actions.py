"""What the dashboard's buttons do: the same engine calls as the CLI commands, each returning
the one line the CLI would print (or raising the error it would print).

cancel -> `marbles-rq cancel`, pause/resume -> `pause`/`resume`, retry/fail -> `retry`/`fail`
(a run paused on a failed step), answer/approve/reject ->
`answer`/`approve`/`reject` (WaitStore.answer: compare-and-set on the question's revision,
then the woken delivery is enqueued), schedule pause/resume -> `schedules pause/resume`.
rerun -> `rerun` (engine/rerun.py, with the page's new id: see Actions.rerun).
"""

from __future__ import annotations

from typing import Any

from ..client import Client
from ..deployment import Settings
from ..errors import InvalidIdError
from ..store.ids import check_id
from ..triggers.schedules import KEY_PATTERN, SCHEDULES, UnknownScheduleError, set_paused


class Actions:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = Client(settings)

    def cancel(self, run_id: str, *, compensate: bool = False) -> str:
        done = self.client.cancel(check_id(run_id, "run id"), compensate=compensate)
        return done.message + (f"; cancelled {len(done.children)} child runs"
                               if done.children else "")

    def pause(self, run_id: str) -> str:
        return self.client.pause(check_id(run_id, "run id")).message

    def resume(self, run_id: str) -> str:
        return self.client.resume(check_id(run_id, "run id")).message

    def retry(self, run_id: str, input_patch: str | None = None) -> str:
        """`marbles-rq retry RUN [--input-patch JSON]`."""
        from ..engine.input_patch import decode_patch

        patch = None if input_patch is None else decode_patch(input_patch, "the input patch")
        return self.client.retry(check_id(run_id, "run id"), patch).message

    def fail(self, run_id: str, reason: str | None = None) -> str:
        """`marbles-rq fail RUN [--reason TEXT]`."""
        return self.client.fail(check_id(run_id, "run id"), reason).message

    def answer(self, run_id: str, key: str, value: Any, *, kind: str, what: str) -> str:
        """`answer` (kind question) or `approve`/`reject` (kind approval: `value` is
        {"approved": bool, "note": ...})."""
        check_id(run_id, "run id")
        if kind == "approval":
            act = self.client.approve if value.get("approved") else self.client.reject
            return act(run_id, key, value.get("note")).message
        return self.client.answer(run_id, key, value).message

    def rerun(self, run_id: str, from_step: str | None = None,
              new_id: str | None = None) -> tuple[str, str]:
        """`marbles-rq rerun RUN [--from-step PATH] [--id NEW_ID]`: the same engine call
        (engine/rerun.py), so the same refusals (a run that has not finished, a step it does
        not have, an id taken by another run). The page's form carries the new id, minted
        when the page was drawn, so a repeated POST returns the rerun the first one made.
        Returns (the new run's id, the CLI's line)."""
        done = self.client.rerun(check_id(run_id, "run id"), from_step=from_step or None,
                                 new_id=new_id or None)
        return done.run_id, done.summary()

    def bulk(self, action: str, target: Any, *, key: str | None = None,
             note: str | None = None) -> str:
        """The runs list's batch bar: `marbles-rq ACTION --filter ... --yes` (a RunFilter)
        or of the ids ticked; the summary line it prints."""
        from ..client.bulk import ACTIONS, rerun_key

        if action not in ACTIONS:
            raise InvalidIdError(f"unknown batch action {action!r}")
        options: dict[str, Any] = {}
        if action in ("approve", "reject"):
            if not key:
                raise InvalidIdError(f"{action}: give the approval's key")
            options = {"key": key, "note": note or None}
        elif action == "rerun":
            options = {"rerun_key": rerun_key(target, None)}
        return self.client.bulk(action, target, **options).line()

    def pause_schedule(self, key: str, paused: bool) -> str:
        if not KEY_PATTERN.fullmatch(key):
            raise UnknownScheduleError(f"unknown schedule {key!r}")
        was = set_paused(self.settings.runs(), key, paused, SCHEDULES)
        word = "paused" if paused else "resumed"
        return f"schedule {key} {'was already ' if was == paused else ''}{word}"
