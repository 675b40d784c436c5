"""Building redis-py clients the way the store needs them.

redis-py (>= 6) resends a command after a timeout or a dropped connection, which can
apply a write twice while the caller sees one success. Every client built here has that
automatic retry switched off; `scripts.py` retries instead, and only scripts that carry a
request id, so a resend is answered from the first attempt's effect (see README).
"""

from __future__ import annotations

import math
import os
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from ..errors import ConfigError, RedisUnavailableError

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV = "MARBLES_REDIS_URL"
TIMEOUT_ENV = "MARBLES_SOCKET_TIMEOUT"
# Long enough for an fsyncing Redis under load; short enough that a hung server is reported
# within seconds. Script calls that time out are resent with the same request id.
DEFAULT_SOCKET_TIMEOUT_S = 3.0
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

Client = redis.Redis | RedisCluster


def default_url() -> str:
    return os.environ.get(URL_ENV) or DEFAULT_URL


def redact(url: str) -> str:
    """The URL without its password, for messages and logs. Works on the raw text: a
    password holding '#', '?' or '/' is cut short by a URL parser, which would then leave the
    rest of it in the "path" or "fragment" and so in the message."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, hostpart = rest.rpartition("@")
    if ":" not in userinfo:
        return url  # a user name alone is no secret
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hostpart}"


def _password_needs_quoting(url: str) -> bool:
    """True when an '@' comes after the first '/', '?' or '#' of the authority: the user
    info (a password) holds one of them unencoded, and parsers split the URL there."""
    rest = url.partition("://")[2]
    if "@" not in rest:
        return False
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    return bool(ends) and rest.rfind("@") > min(ends)


def socket_timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_SOCKET_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    # nan and inf pass a plain comparison; a socket timeout of either never fires.
    if not math.isfinite(value) or not 0 < value <= 3600:
        raise ConfigError(f"{TIMEOUT_ENV} must be a number of seconds in (0, 3600], not "
                          f"{raw!r}")
    return value


def check_url(url: str) -> SplitResult:
    """Parse a Redis URL, or raise ConfigError with one line that never shows its password."""
    if _password_needs_quoting(url):
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: the password holds '#', '?' or "
                          f"'/'; percent-encode them (%23, %3F, %2F)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        # Our own words: the parser's message quotes the text it could not read.
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: the port must be a number "
                          f"from 1 to 65535") from None
    if port == 0:
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: the port must be a number "
                          f"from 1 to 65535")
    return parts


# No CLIENT SETINFO on connecting: redis-py sends LIB-NAME and LIB-VER as two round trips on
# every new connection (a forked work-horse opens one per run), and redis-py 7+ looks its
# own version up in the installed package metadata for every Connection it builds (tens of
# milliseconds in a horse on a loaded machine). Every client marbles-rq builds takes these.
NO_CLIENT_INFO: dict[str, Any] = (
    {"driver_info": None} if hasattr(redis, "DriverInfo")
    else {"lib_name": None, "lib_version": None})


def connect(url: str | None = None, *, socket_timeout: float | None = None,
            connect_timeout: float = 2.0) -> Client:
    """A client for `url`: ``redis://``, ``rediss://``, ``unix://``, or
    ``redis+cluster://host:port`` for a Redis Cluster. Raises ConfigError on a malformed
    URL; does not touch the network."""
    url = url or default_url()
    if socket_timeout is None:
        socket_timeout = socket_timeout_from_env()
    parts = check_url(url)
    options: dict[str, object] = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
        # RESP2 needs no HELLO, and no health-check PING: each forked work-horse opens a fresh
        # connection per run, and both would be round trips on its hot path. A dead
        # connection is found by the call itself, which scripts.py resends safely.
        protocol=2,
        **NO_CLIENT_INFO,
    )
    try:
        if parts.scheme in CLUSTER_SCHEMES:
            plain = urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme]))
            return RedisCluster.from_url(plain, **options)  # retry: none, as for one server
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                "scheme must be redis://, rediss://, unix:// or redis+cluster://"
            )
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("no host")
        return redis.Redis.from_url(url, **options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: {exc}") from None
    except redis.RedisError as exc:  # RedisCluster.from_url connects eagerly
        raise unavailable(url, exc) from None
    except RedisClusterException as exc:  # not a RedisError: it would escape as a traceback
        if "Cluster mode is not enabled" in str(exc):
            raise ConfigError(f"{redact(url)} names a Redis Cluster, but that server is not "
                              f"in cluster mode; use redis:// for a single server") from None
        raise unavailable(url, exc) from None


def refused(exc: redis.ResponseError, *, doctor_hint: bool = True) -> RedisUnavailableError:
    """One line for a command Redis answered with an error: out of memory, cannot persist,
    read-only replica, denied by an ACL, or anything else."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    code = first.split(" ", 1)[0]
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or code == "OOM":
        return RedisUnavailableError("Redis refused the write: out of memory (maxmemory "
                                     "reached)")
    if code == "MISCONF":
        return RedisUnavailableError("Redis refused the write: it cannot persist to disk "
                                     "(MISCONF; see its log)")
    if isinstance(exc, redis.exceptions.ReadOnlyError) or code == "READONLY":
        return RedisUnavailableError("Redis refused the write: the server is a read-only "
                                     "replica (READONLY); point the URL at the primary")
    if isinstance(exc, redis.exceptions.NoPermissionError) or code == "NOPERM":
        hint = "; run 'marbles-rq doctor'" if doctor_hint else ""
        return RedisUnavailableError(f"Redis refused the command: the ACL user lacks a "
                                     f"permission (NOPERM: {first.removeprefix('NOPERM ')})"
                                     f"{hint}")
    return RedisUnavailableError(f"Redis refused the command: {first}")


def unavailable(url: str, exc: BaseException) -> RedisUnavailableError:
    """One clear line for a failure to talk to Redis."""
    if "Authentication required" in str(exc) or "NOAUTH" in str(exc):
        return RedisUnavailableError(f"Redis at {redact(url)} requires a password: {exc}")
    if isinstance(exc, redis.AuthenticationError | redis.AuthenticationWrongNumberOfArgsError):
        return RedisUnavailableError(f"Redis at {redact(url)} refused the credentials: {exc}")
    if isinstance(exc, redis.TimeoutError):
        return RedisUnavailableError(f"Redis at {redact(url)} did not answer in time: {exc}")
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RedisUnavailableError(f"cannot reach Redis at {redact(url)}: {detail}")


def connect_async(url: str | None = None, *, socket_timeout: float | None = None,
                  connect_timeout: float = 2.0) -> Any:
    """`connect`'s asyncio twin (redis.asyncio), for the blocking reads of the asyncio
    client. Raises ConfigError on a malformed URL; does not touch the network."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    url = url or default_url()
    if socket_timeout is None:
        socket_timeout = socket_timeout_from_env()
    parts = check_url(url)
    options: dict[str, Any] = dict(socket_timeout=socket_timeout,
                                      socket_connect_timeout=connect_timeout, protocol=2,
                                      **NO_CLIENT_INFO)
    try:
        if parts.scheme in CLUSTER_SCHEMES:
            plain = urlunsplit(parts._replace(scheme=CLUSTER_SCHEMES[parts.scheme]))
            return AsyncRedisCluster.from_url(plain, **options)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("scheme must be redis://, rediss://, unix:// or redis+cluster://")
        return aioredis.Redis.from_url(url, **options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: {exc}") from None
