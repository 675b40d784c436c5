import marbles_rq as mr

mr.schedule(every="0s", workflow="sx_note")
