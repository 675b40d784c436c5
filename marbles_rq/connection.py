"""Building redis-py clients the way the store needs them.

redis-py (>= 6) resends a command after a timeout or a dropped connection, which can
apply a write twice while the caller sees one success. Every client built here has that
automatic retry switched off; `scripts.py` retries instead, and only scripts that carry a
request id, so a resend is answered from the first attempt's effect (see README).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from .errors import ConfigError, RedisUnavailableError

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
    """The URL without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str | None = None, *, socket_timeout: float | None = None,
            connect_timeout: float = 2.0) -> Client:
    """A client for `url`: ``redis://``, ``rediss://``, ``unix://``, or
    ``redis+cluster://host:port`` for a Redis Cluster. Raises ConfigError on a malformed
    URL; does not touch the network."""
    url = url or default_url()
    if socket_timeout is None:
        socket_timeout = float(os.environ.get(TIMEOUT_ENV) or DEFAULT_SOCKET_TIMEOUT_S)
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL {redact(url)!r}: {exc}") from None
    options: dict[str, object] = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
        # RESP2 needs no HELLO, and no health-check PING: each forked work-horse opens a fresh
        # connection per run, and both would be round trips on its hot path. A dead
        # connection is found by the call itself, which scripts.py resends safely.
        protocol=2,
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
