"""A schedule that a later source drops (it becomes orphaned)."""

import marbles_rq as mr

mr.schedule(every="3s", workflow="sx_note", input={"orphan": True}, key="orphan")
