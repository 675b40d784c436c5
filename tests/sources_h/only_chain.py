"""A source without the hardening workflows: a worker started with it lacks them."""

import marbles_rq as mr


@mr.workflow
def h_other(ctx: mr.RunContext) -> str:
    return "other"
