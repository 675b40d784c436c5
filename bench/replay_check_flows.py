"""The workflow bench/replay_check.py replays: three steps, a question, a fourth step."""

from __future__ import annotations

import marbles_rq as mr


@mr.step
def rc_fetch(n: int) -> int:
    return n + 1


@mr.step
def rc_check(n: int) -> int:
    return n * 2


@mr.step
def rc_weigh(n: int) -> int:
    return n - 3


@mr.step
def rc_pack(n: int, colour: str) -> str:
    return f"{n}-{colour}"


@mr.workflow()
def rc_order(ctx: mr.RunContext, n: int) -> dict[str, str]:
    c = rc_weigh(rc_check(rc_fetch(n)))
    colour = ctx.ask.question("Colour?", choices=["red", "blue"], key="colour")
    return {"label": rc_pack(c, colour)}
