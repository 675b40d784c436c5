"""The command line's exit codes besides 0 (ok), in a module of their own so that every
command's module can use them without importing the command group that registers it."""

# 1: the thing asked about is not ok (a doctor problem, a failed run) or an unexpected error;
# 2: bad input; 3: Redis unreachable, refused or unsafe.
EXIT_PROBLEM, EXIT_INPUT, EXIT_REDIS = 1, 2, 3
# `enqueue` of a workflow with a throttle or a singleton that made no run: 4 dropped (the
# throttle is full: retry later), 5 skipped (the singleton's run is unfinished).
EXIT_DROPPED, EXIT_SKIPPED = 4, 5
