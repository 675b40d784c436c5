"""Error replies that mean "Redis refuses writes right now", not "this call was wrong".

Under `noeviction` at `maxmemory` every write is refused with OOM; a failing AOF gives
MISCONF; a replica READONLY; a restarting server LOADING; a missing ACL permission NOPERM.
Long-running processes treat these like an outage (one line, back off, carry on); a run
stops unsettled and is redelivered once its lease expires.
"""

from __future__ import annotations

import redis

REFUSAL_PREFIXES = ("OOM", "MISCONF", "READONLY", "LOADING", "NOPERM", "BUSY", "MASTERDOWN",
                    "CLUSTERDOWN", "TRYAGAIN", "NOREPLICAS")

# Errors after which a call may simply be tried again later.
TRANSIENT = (redis.ConnectionError, redis.TimeoutError)


def is_refusal(exc: BaseException) -> bool:
    # redis-py turns some codes into classes and strips the code from the message.
    if isinstance(exc, redis.exceptions.NoPermissionError | redis.exceptions.BusyLoadingError
                  | redis.exceptions.ReadOnlyError | redis.exceptions.OutOfMemoryError):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(REFUSAL_PREFIXES)


def is_outage(exc: BaseException) -> bool:
    """Redis cannot be reached, or refuses to do work for now."""
    return isinstance(exc, TRANSIENT) or is_refusal(exc)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
