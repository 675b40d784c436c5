"""A run's timeline on its page (marbles_rq/web/reads.py), from its output journal: each time
it parked is a wait span to what ended it, and the rows keep the journal's order."""

from __future__ import annotations

from typing import Any

from marbles_rq.engine.runs import OutputEvent
from marbles_rq.web.reads import RunPage, timeline, waits_of


def ev(ms: int, type: str, data: dict[str, Any], attempt: int = 1) -> OutputEvent:
    return OutputEvent(f"{ms}-0", type, attempt, data)


JOURNAL = [
    ev(1000, "attempt_started", {}),
    # The executor's reckoning of a step's start errs late: after the park that followed.
    ev(1001, "step_started", {"step": "wf.price#0", "attempt": 1, "started_ms": 1003}),
    ev(1002, "step_succeeded", {"step": "wf.price#0"}),
    ev(1002, "parked", {"reason": "question", "questions": ["big-order"]}),
    ev(9000, "woken", {"cause": "answer"}, 2),
    ev(9100, "attempt_started", {}, 2),
    ev(9200, "parked", {"reason": "child", "children": ["r.a", "r.b"]}, 2),
]


def test_each_park_is_a_span_to_what_ended_it() -> None:
    spans = waits_of(JOURNAL, finished=False)
    assert [(s.reason, s.started_ms, s.ended_ms, s.cause) for s in spans] == [
        ("question", 1002, 9000, "answer"), ("child", 9200, None, "")]
    assert spans[0].what == "an answer to big-order"
    assert spans[0].duration_ms == 7998
    assert spans[1].children == ["r.a", "r.b"]


def test_a_finished_run_closes_its_last_wait() -> None:
    journal = [*JOURNAL, ev(9500, "final", {"status": "cancelled"}, 2)]
    spans = waits_of(journal, finished=True)
    assert (spans[1].ended_ms, spans[1].cause) == (9500, "finished")


def test_rows_follow_the_journal_not_the_reckoned_start() -> None:
    page = RunPage(view=None, data={}, questions=[], reports=[], lines=[],  # type: ignore[arg-type]
                   last_id="0-0", tries=timeline(JOURNAL, False),
                   waits=waits_of(JOURNAL, False))
    assert [(kind, getattr(item, "step", getattr(item, "reason", ""))) for kind, item
            in page.rows] == [("step", "wf.price#0"), ("wait", "question"), ("wait", "child")]
