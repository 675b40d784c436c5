"""Retry policies of steps: how often a failing step is tried, how long it waits between
tries, which failures are final, and what happens when the tries run out.

    @mr.step(retry=mr.Retry(initial="1s", backoff=2.0, max_interval="5m", max_attempts=10,
                            non_retryable=(ValueError,)), on_exhausted="pause")
    def charge(order: str) -> dict: ...

A step's own `retry=` wins, then its workflow's `retry=` (the default of its steps), then the
older shorthand (`retries=`, `backoff=`, `delay_s=` ...), which is a Retry too. Between two
tries the run parks on a durable timer (reason `retry`, no worker held) unless the wait is
shorter than INLINE_RETRY_S: such a wait is slept in the worker (see docs/how-to/retries.md
for the measurement).
"""

from __future__ import annotations

import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import MarblesError

# A wait between tries below this is slept in the worker holding the run; from it on, the run
# parks on a durable timer. Parking costs a park, a wake and a new delivery that replays the
# ledger (bench/retry_park.py measures both ways). MARBLES_RETRY_INLINE_MS sets it per
# worker process.
INLINE_RETRY_S = 0.5
INLINE_ENV = "MARBLES_RETRY_INLINE_MS"


def inline_limit_s() -> float:
    """The wait below which a retry sleeps in the worker (INLINE_RETRY_S, or the env's)."""
    raw = os.environ.get(INLINE_ENV)
    if not raw:
        return INLINE_RETRY_S
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        from ..errors import ConfigError

        raise ConfigError(f"{INLINE_ENV} must be a whole number of milliseconds >= 0, not "
                          f"{raw!r}")
    return value / 1000
MAX_ATTEMPTS = 1000
MAX_INTERVAL_S = 366 * 86400.0
DEFAULT_MAX_INTERVAL_S = 300.0
EXHAUSTED = ("fail", "pause")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class RetryPolicyError(MarblesError):
    """A Retry that cannot be: a bad interval, backoff or attempt count."""

    code = "invalid_retry"


class NonRetryable(Exception):
    """Raised by a step body: this failure is final, whatever the step's retry policy says
    (it fails, or pauses the run with on_exhausted="pause", at once)."""


def seconds_of(value: Any, what: str) -> float:
    """'250ms', '1s', '1.5m', '2h', '1d', or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise RetryPolicyError(f"{what} must be a duration such as '1s' or a number of "
                               f"seconds, not {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise RetryPolicyError(f"{what} must be a duration such as '1s', '500ms', '5m' or a "
                               f"number of seconds, not {value!r}")
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_INTERVAL_S:
        raise RetryPolicyError(f"{what} must be between 0 and a year, not {value!r}")
    return seconds


@dataclass(frozen=True, init=False)
class Retry:
    """How a step is retried. `initial`: the wait before the second try; each next wait is
    `backoff` times the one before, at most `max_interval`; `max_attempts`: tries in all (1:
    no retry); `non_retryable`: exception types that fail at once; `jitter`: each wait is
    drawn uniformly from its half to its whole (spreads retries of many runs)."""

    initial_s: float
    backoff: float
    max_interval_s: float
    max_attempts: int
    non_retryable: tuple[type[BaseException], ...]
    jitter: bool

    def __init__(self, initial: Any = "1s", backoff: float = 2.0, max_interval: Any = None,
                 max_attempts: int = 10,
                 non_retryable: tuple[type[BaseException], ...] | list[type[BaseException]] = (),
                 jitter: bool = True) -> None:
        initial_s = seconds_of(initial, "initial")
        # Not given: 5 minutes, or the first wait when that is longer (a policy that asks
        # for hourly retries must not be refused for a ceiling nobody wrote).
        max_interval_s = (max(DEFAULT_MAX_INTERVAL_S, initial_s) if max_interval is None
                          else seconds_of(max_interval, "max_interval"))
        if isinstance(backoff, bool) or not isinstance(backoff, int | float) or not (
                1.0 <= backoff <= 100.0):
            raise RetryPolicyError(f"backoff must be a number from 1 (fixed waits) to 100, "
                                   f"not {backoff!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not (
                1 <= max_attempts <= MAX_ATTEMPTS):
            raise RetryPolicyError(f"max_attempts must be a whole number from 1 to "
                                   f"{MAX_ATTEMPTS}, not {max_attempts!r}")
        if max_interval_s < initial_s:
            raise RetryPolicyError(f"max_interval ({max_interval!r}) is shorter than initial "
                                   f"({initial!r})")
        types = tuple(non_retryable) if isinstance(non_retryable, list | tuple) else None
        if types is None or not all(isinstance(t, type) and issubclass(t, BaseException)
                                    for t in types):
            raise RetryPolicyError(f"non_retryable must be a tuple of exception types, not "
                                   f"{non_retryable!r}")
        if not isinstance(jitter, bool):
            raise RetryPolicyError(f"jitter must be True or False, not {jitter!r}")
        object.__setattr__(self, "initial_s", initial_s)
        object.__setattr__(self, "backoff", float(backoff))
        object.__setattr__(self, "max_interval_s", max_interval_s)
        object.__setattr__(self, "max_attempts", max_attempts)
        object.__setattr__(self, "non_retryable", types)
        object.__setattr__(self, "jitter", jitter)

    def delay_for(self, attempt: int, draw: Callable[[float, float], float] = random.uniform
                  ) -> float:
        """Seconds to wait after failed try `attempt` (from 1) before the next."""
        delay = min(self.initial_s * self.backoff ** min(attempt - 1, 200), self.max_interval_s)
        return draw(delay / 2, delay) if self.jitter else delay

    def retryable(self, exc: BaseException) -> bool:
        """False for a failure that is final: NonRetryable, or one of `non_retryable`."""
        return not isinstance(exc, (NonRetryable, *self.non_retryable))

    def describe(self) -> dict[str, Any]:
        return {"initial_s": self.initial_s, "backoff": self.backoff,
                "max_interval_s": self.max_interval_s, "max_attempts": self.max_attempts,
                "non_retryable": [t.__name__ for t in self.non_retryable],
                "jitter": self.jitter}


NO_RETRY = Retry(initial=0, max_interval=0, max_attempts=1, jitter=False)


def shorthand(retries: int, backoff: str, delay_s: float, max_delay_s: float,
              jitter: bool) -> Retry:
    """The Retry that `retries=`, `backoff=`, `delay_s=`, `max_delay_s=`, `jitter=` mean."""
    if retries == 0:
        return NO_RETRY
    return Retry(initial=delay_s, backoff=1.0 if backoff == "fixed" else 2.0,
                 max_interval=max(delay_s, max_delay_s), max_attempts=retries + 1,
                 jitter=jitter)


def check_retry(retry: Any, where: str) -> Retry | None:
    if retry is None or isinstance(retry, Retry):
        return retry
    raise RetryPolicyError(f"{where}: retry= takes mr.Retry(...), not {retry!r}")


def check_exhausted(value: Any, where: str) -> str | None:
    if value is None or value in EXHAUSTED:
        return value  # type: ignore[no-any-return]
    raise RetryPolicyError(f"{where}: on_exhausted must be 'fail' or 'pause', not {value!r}")
