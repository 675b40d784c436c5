"""`marbles-rq web`: the dashboard (runs, a run's live output, the feed of questions, schedules,
monitors, events, the system) and signed inbound webhooks, served by Starlette and uvicorn."""
