import marbles_rq as mr

mr.schedule(cron="0 9 * * *", tz="Mars/Olympus_Mons", workflow="sx_note")
