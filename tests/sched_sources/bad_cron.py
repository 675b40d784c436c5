import marbles_rq as mr

mr.schedule(cron="61 * * * *", workflow="sx_note")
