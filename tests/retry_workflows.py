"""Workflows used only by tests/test_retry_policies.py (loaded by workers with --source).

Every counted step HINCRBYs field <name> of ``rt:exec:<run id>`` when its body runs, and
reads the new count as its try number: the count is what ran, whatever was killed between.

* `rt_flaky`: a step with Retry(initial 4 s, fixed, 5 tries) that fails its first `fails`
  tries; with `gate_try`, that try waits for a token the test pushes to
  ``rt:gate:<run id>`` before it goes on (so the test can kill its worker mid-try).
* `rt_patient`: a step that fails and waits a minute for its next try.
* `rt_quick`: one step that succeeds at once.
* `rt_nonretry`: a step with 5 tries that raises ValueError (non_retryable) or
  mr.NonRetryable: either fails at once.
* `rt_order`: a charge step (2 tries, 0.1 s apart) that refuses an amount over 100; the
  workflow says on_exhausted="pause", so the run waits for `retry` / `fail`.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

import marbles_rq as mr

EXEC_PREFIX = "rt:exec:"
GATE_PREFIX = "rt:gate:"


def _client() -> Any:
    # The store's own connect: a cluster URL too (redis+cluster://).
    from marbles_rq.store.connection import connect

    return connect(os.environ.get("MARBLES_REDIS_URL", "redis://127.0.0.1:6379/0"),
                   socket_timeout=130)  # the gate's BLPOP waits up to 120 s


def _count(name: str) -> int:
    return int(_client().hincrby(EXEC_PREFIX + mr.current().run_id, name, 1))


class FlakyInput(msgspec.Struct):
    fails: int = 2
    gate_try: int = 0


@mr.step(retry=mr.Retry(initial="4s", backoff=1.0, max_interval="4s", max_attempts=5,
                        jitter=False))
def rt_flaky_step(fails: int, gate_try: int) -> int:
    n = _count("flaky")
    if n == gate_try:
        _client().blpop([GATE_PREFIX + mr.current().run_id], timeout=120)
    if n <= fails:
        raise RuntimeError(f"try {n} fails")
    return n


@mr.workflow()
def rt_flaky(ctx: mr.RunContext, inp: FlakyInput) -> int:
    return rt_flaky_step(inp.fails, inp.gate_try)


@mr.step(retry=mr.Retry(initial="1m", max_attempts=2, jitter=False))
def rt_patient_step() -> None:
    raise RuntimeError("down for a while")


@mr.workflow()
def rt_patient(ctx: mr.RunContext) -> None:
    rt_patient_step()


@mr.step
def rt_quick_step() -> str:
    return "quick"


@mr.workflow()
def rt_quick(ctx: mr.RunContext) -> str:
    return rt_quick_step()


@mr.step(retry=mr.Retry(initial="1s", max_attempts=5, non_retryable=(ValueError,)))
def rt_invalid(kind: str) -> None:
    _count("invalid")
    if kind == "value":
        raise ValueError("bad value")
    raise mr.NonRetryable("card declined for good")


@mr.workflow()
def rt_nonretry(ctx: mr.RunContext, kind: str = "value") -> None:
    rt_invalid(kind)


class Card(msgspec.Struct):
    number: str
    cvc: str = ""


@mr.step(retry=mr.Retry(initial="100ms", max_attempts=2, jitter=False))
def rt_charge(amount: int, card: Card) -> dict[str, Any]:
    _count("charge")
    if amount > 100:
        raise ValueError(f"amount {amount} is over the limit")
    return {"charged": amount, "card": card.number, "cvc": card.cvc}


@mr.workflow(on_exhausted="pause")
def rt_order(ctx: mr.RunContext, amount: int = 500) -> dict[str, Any]:
    return rt_charge(amount, Card("4242", "123"))
