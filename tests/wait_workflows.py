"""Workflows used only by tests/test_waiting_questions.py (loaded by workers with --source).

Every step counts its executions: it HINCRBYs field <name> of ``wq:exec:<run id>`` when its
body runs (a replayed step returns its recorded result without running, so a count of 1
after kills, wakes and replays means "never re-run").

* `wq_approval`: a step, an approval ``ship``, a step; returns the approval it received.
* `wq_question`: a step, a question (choices, key, timeout and default from the input), a
  step; returns the answer.
* `wq_step_question`: a question asked inside a step (default key ``wq_review#0/ask:0``).
* `wq_reports`: a milestone and a result report, then a question (so the body replays and
  reports again after the answer).
* `wq_steps`: `steps` steps; with `gate`, step i waits until the test pushes a token to
  ``wq:gate:<run id>:<i>``, so a test decides when each step ends.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import redis

import marbles_rq as mr

EXEC_PREFIX = "wq:exec:"
GATE_PREFIX = "wq:gate:"
GATE_TIMEOUT_S = 60


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _count(name: str) -> None:
    _client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1)


@mr.step
def wq_prepare() -> str:
    _count("prepare")
    return "prepared"


@mr.step
def wq_finish(answer: Any) -> str:
    _count("finish")
    return f"finished with {answer!r}"


@mr.workflow
def wq_approval(ctx: mr.RunContext) -> dict[str, Any]:
    prepared = wq_prepare()
    decision = ctx.ask.approval("Ship it?", body="build 42", key="ship")
    wq_finish(decision)
    return {"prepared": prepared, "decision": decision}


class QuestionInput(msgspec.Struct):
    choices: list[str] | None = None
    key: str | None = None
    timeout_s: float | None = None
    default: str | None = None
    has_default: bool = False


@mr.workflow
def wq_question(ctx: mr.RunContext, inp: QuestionInput) -> dict[str, Any]:
    prepared = wq_prepare()
    options: dict[str, Any] = {"timeout_s": inp.timeout_s}
    if inp.has_default:
        options["default"] = inp.default
    answer = mr.ask.question("Which colour?", "for the logo", inp.choices, inp.key, **options)
    wq_finish(answer)
    return {"prepared": prepared, "answer": answer}


@mr.step
def wq_review() -> str:
    _count("review")
    return mr.ask.question("Looks good?", choices=["yes", "no"])


@mr.workflow
def wq_step_question(ctx: mr.RunContext) -> str:
    return str(wq_review())


@mr.workflow
def wq_reports(ctx: mr.RunContext) -> str:
    _count("body")
    ctx.report.milestone({"stage": "built"})
    mr.report.result({"artifact": "app.tgz"})
    return ctx.ask.question("Publish?", key="publish")


class StepsInput(msgspec.Struct):
    steps: int = 3
    gate: bool = False


@mr.step
def wq_work(i: int, gate: bool) -> int:
    run = mr.current()
    _count(f"work#{i}")
    if gate:
        key = f"{GATE_PREFIX}{run.run_id}:{i}"
        if _client().blpop([key], timeout=GATE_TIMEOUT_S) is None:
            raise TimeoutError(f"nobody opened {key}")
    return i


@mr.workflow
def wq_steps(ctx: mr.RunContext, inp: StepsInput) -> list[int]:
    return [wq_work(i, inp.gate) for i in range(inp.steps)]
