"""The workflow bench/event_match.py parks: one wait for a "shop"/"paid" event of its order."""

from __future__ import annotations

import marbles_rq as mr


@mr.workflow
def em_wait(ctx: mr.RunContext, order: str) -> str:
    return ctx.wait_for_event("shop", type="paid", match={"order": order}).id
