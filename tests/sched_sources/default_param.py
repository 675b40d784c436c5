"""A schedule without input= on a workflow whose input parameter has a Python default: the
runs get that default (issue 16, item 10)."""

from __future__ import annotations

import marbles_rq as mr

# By name, before the workflow is defined: its default is resolved when the schedule fires.
mr.schedule(every="1s", workflow="sx_defaulted", key="by-name")


@mr.schedule(every="1s", key="defaulted")
@mr.workflow("sx_defaulted")
def sx_defaulted(ctx: mr.RunContext, n: int = 5) -> int:
    return n * 2
