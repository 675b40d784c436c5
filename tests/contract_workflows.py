"""Workflows of the contract suite (tests/test_contract.py): each is run by real workers on
Redis and by the in-process engines (`run --dry-run`, the test kit), and the ledgers and
results must agree. Step bodies are pure functions of their arguments, so every engine
records the same values.

* `ct_steps`: three steps, the last one's argument built from the first two.
* `ct_ask`: a step, a question (key ``colour``) and an approval (key ``ship``), a step.
* `ct_timer`: a step, ``mr.sleep(1)``, a step.
* `ct_children`: two children of `ct_steps` under stable keys, gathered.
* `ct_parallel`: ``ctx.parallel`` over three steps, then one more.
* `ct_signal`: a step, a wait for signal ``go``, a step with its payload.
* `ct_patch`: a patch marker, a step on each branch.
* `ct_async`: an async body: a step, two gathered, a sleep, a step.
* `ct_fails`: a step, then one that raises: the run fails with its error.
"""

from __future__ import annotations

import asyncio
from typing import Any

import marbles_rq as mr


@mr.step
def ct_add(a: int, b: int) -> int:
    return a + b


@mr.step
def ct_label(value: Any) -> str:
    return f"<{value}>"


@mr.step
def ct_boom(n: int) -> int:
    raise ValueError(f"boom {n}")


@mr.step
async def ct_aadd(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@mr.workflow
def ct_steps(ctx: mr.RunContext, n: int = 1) -> str:
    a = ct_add(n, 1)
    b = ct_add(a, 2)
    return ct_label([a, b])


@mr.workflow
def ct_ask(ctx: mr.RunContext) -> dict[str, Any]:
    first = ct_add(1, 1)
    colour = ctx.ask.question("Which colour?", choices=["red", "blue"], key="colour")
    ship = ctx.ask.approval("Ship it?", key="ship")
    return {"first": first, "colour": colour, "ship": ship["approved"],
            "last": ct_label(colour)}


@mr.workflow
def ct_timer(ctx: mr.RunContext) -> str:
    a = ct_add(2, 3)
    mr.sleep(1)
    return ct_label(a)


@mr.workflow
def ct_children(ctx: mr.RunContext) -> list[Any]:
    kids = [mr.start_child("ct_steps", n, key=f"kid{n}") for n in (1, 5)]
    return list(mr.gather(*kids))


@mr.workflow
def ct_parallel(ctx: mr.RunContext) -> dict[str, Any]:
    got = ctx.parallel(lambda: ct_add(1, 2), lambda: ct_add(3, 4), lambda: ct_label("p"))
    return {"branches": got, "after": ct_add(got[0], got[1])}


@mr.workflow
def ct_signal(ctx: mr.RunContext) -> str:
    ct_add(0, 1)
    payload = mr.wait_for_signal("go", timeout_s=3600)
    return ct_label(payload)


@mr.workflow
def ct_patch(ctx: mr.RunContext) -> str:
    if mr.patched("ct-new"):
        return ct_label("new")
    return ct_label("old")


@mr.workflow
async def ct_async(ctx: mr.AsyncRunContext) -> list[int]:
    first = await ct_aadd(1, 2)
    pair = await asyncio.gather(ct_aadd(first, 1), ct_aadd(first, 2))
    await mr.sleep(1)
    return [first, *pair, await ct_aadd(pair[0], pair[1])]


@mr.workflow
def ct_fails(ctx: mr.RunContext) -> int:
    a = ct_add(1, 1)
    return int(ct_boom(a))
