"""Names shared by the workloads, the harness and the checker (importing this module
registers no workflow)."""

SOURCE = "tests.chaos.workloads"  # --source of every chaos process

# Receipts the workloads write (see workloads.py).
EXEC_KEY = "cx:exec"
CLAIMS_KEY = "cx:claims"
APPLIED_KEY = "cx:applied"
EFFECTS_KEY = "cx:effects"
FLAKY_KEY = "cx:flaky"

COLOURS = ["red", "green", "blue"]
QUESTION_KEY = "q"
TICK_KEY, TICK_EVERY_MS = "cx-tick", 1000
TOCK_KEY, TOCK_EVERY_MS = "cx-tock", 2000
SCHEDULES = {TICK_KEY: ("cx_tick", TICK_EVERY_MS), TOCK_KEY: ("cx_tock", TOCK_EVERY_MS)}
EVENT_SOURCE = "chaos"
EVENT_TYPE = "tick"

# Flow control workloads (cx_limited, cx_limited_key): their limits and key values.
LIMIT_GLOBAL = 2
LIMIT_PER_KEY = 1
CUSTOMERS = ["acme", "globex", "initech"]
PRIORITIES = [-5, 5, 10]

# Signals (cx_signals): the name the runs wait for, and how long each wait may take (longer
# than the harness retries a send through Redis outages).
SIGNAL_NAME = "nudge"
SIGNAL_TIMEOUT_S = 180.0

# Published state and event waits (cx_publish_wait): the source and type of the events the
# runs wait for (no trigger: a plain event, matched by its "order" field), the published key,
# and how long a wait may take (longer than the harness retries a send through outages).
ORDER_SOURCE = "chaos-orders"
ORDER_TYPE = "paid"
STATE_KEY = "state"
ORDER_TIMEOUT_S = 180.0

# Compensation (cx_saga): a run that waits this long for a signal nobody sends (the harness
# cancels it with compensation meanwhile), then fails.
SAGA_WAIT_S = 60.0
SAGA_SIGNAL = "never"

# Retry policies (cx_retry): the step's tries per idempotency key (a durable counter the
# step reads to decide whether this try fails), its policy, and the input patch the harness
# gives a run paused on the step once its tries ran out.
RETRY_KEY = "cx:retry_tries"
RETRY_INITIAL = "0.6s"  # parked between tries, not slept in the worker
RETRY_MAX_ATTEMPTS = 6
RETRY_EXHAUST = 99  # failures planned by a run whose tries run out (pause or fail)
RETRY_PATCH = {"fails": 0}

# Rate limits (cx_rate): its limit per key, and the key values the runs carry.
RATE_PER_S = 10
RATE_KEYS = ["north", "south"]

# Sessions (cx_session): a run appends to its own session in its body and in its steps, and
# some to one session they all share.
SESSION_SHARED = "chaos-shared"

# Artifacts (cx_artifact): a step puts a version of one shared artifact (a plain put), or of
# another one by compare-and-set (expect_version: the latest it read, again on a conflict).
ARTIFACT_PLAIN = "chaos-art"
ARTIFACT_CAS = "chaos-art-cas"
PUTS_KEY = "cx:puts"  # one entry per put answered inside cx_put (run, step, version, pid)
PUT_LINGER_MS = 400  # a compare-and-set put's step naps this long before it returns
CAS_THINK_MS = 40  # between reading the latest version and putting with it

# The durable mutex (cx_lock): the lock every run takes, its lease, and the receipts its
# critical sections leave: the counter they increment by a read (on entering) and a write
# (on leaving), each checked against the lock's holder in the store (a fenced write), the
# runs whose increment was accepted, and one entry per entry into and exit from the section.
LOCK_NAME = "chaos-lock"
LOCK_LEASE_S = 4.0
LOCK_COUNTER_KEY = "cx:lock_counter"
LOCK_DONE_KEY = "cx:lock_done"
LOCK_HOLDS_KEY = "cx:lock_holds"
