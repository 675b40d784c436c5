"""marbles-rq test suite (a package so that ``from tests.redis_procs import ...`` works)."""
