"""One interval schedule every 2 s, with an explicit key."""

import marbles_rq as mr

mr.schedule(every="2s", workflow="sx_note", input={"gap": True}, key="gap")
