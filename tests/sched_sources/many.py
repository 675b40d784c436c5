"""Twenty interval schedules of one workflow, keyed by their input."""

import marbles_rq as mr

for n in range(20):
    mr.schedule(every="1s", workflow="sx_note", input={"n": n})
