"""The chaos test of the whole system (issue 9): ``ops/chaos`` runs it.

Layout:

* ``workloads.py`` -- the workflows the chaos runs (chains with effects, questions, durable
  timers, child runs, parallel steps, schedules, an event trigger; and for features in
  combination, issue 16: short-lived children gathered late, parents that start children
  while they are cancelled, concurrency limits global and per key, quick steps to rerun
  from, priority bands; pause/resume storms hit chains; runs that wait for signals, and
  runs that publish their state and wait for a matching event; compensating runs, steps
  under a retry policy (some paused when their tries run out, retried with a patched
  input), rate-limited bursts; sessions appended from bodies and steps, artifact versions
  put plainly and by compare-and-set, a durable mutex around a fenced read-then-write).
  Loaded by every worker
  and controller with ``--source tests.chaos.workloads``. Every step body leaves receipts
  in Redis (see its docstring), so the checker can count executions and effects.
* ``plan.py`` -- the seeded plan: what is submitted (and paused, resumed, cancelled, rerun)
  when, and which fault strikes when.
  Pure and deterministic: the same seed gives the same plan.
* ``harness.py`` -- runs the plan against real processes: a durable redis-server, two
  controllers, forking, ``--pool`` and ``--concurrency`` workers, each in its own process
  group; SIGKILLs,
  SIGSTOPs and restarts them; answers questions; pauses, resumes and reruns runs; sends
  signals, and events matching a waiting run (or decoys); samples
  the concurrency limits' holds; waits for quiescence.
* ``history.py`` -- the history: what the system recorded (runs, ledgers, output
  journals, questions, effect receipts, published state, schedules, events) plus the
  workloads' receipts and the harness's own log (submissions, answers, signals and events
  sent, faults). Read from Redis after the run.
* ``checker.py`` -- ``check(history)``: the assertions over a history, and the summary. Pure:
  ``tests/test_chaos_checker.py`` feeds it hand-made histories.
* ``__main__.py`` -- the command line (``python -m tests.chaos``; ``ops/chaos`` wraps it).
"""
