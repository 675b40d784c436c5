"""Redis failing under a client call, as the client's own typed error.

The stores are opened with a check that already raises RedisUnavailableError; a server that
goes away (or starts refusing writes) after that surfaces inside redis-py as
ConnectionError, TimeoutError or a refusal reply. An application catches MarblesError, so
those must arrive as RedisUnavailableError too, one line naming the server, never as
redis-py's exceptions with a traceback through the client.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisClusterException

from ..errors import RedisUnavailableError
from ..store.connection import refused, unavailable
from ..store.redis_errors import TRANSIENT, is_refusal

C = TypeVar("C", bound=type)


def as_unavailable(url: str, exc: BaseException) -> RedisUnavailableError | None:
    """The typed error for `exc`, or None when it is not Redis failing."""
    if isinstance(exc, (*TRANSIENT, RedisClusterException)):
        return unavailable(url, exc)
    if isinstance(exc, redis.ResponseError) and is_refusal(exc):
        return refused(exc)
    return None


def typed_outages(url_of: Callable[[Any], str]) -> Callable[[C], C]:
    """Wrap every public method of a client class (functions, coroutines, generators and
    async generators) so Redis failing raises RedisUnavailableError. `url_of(self)` names
    the server in the message."""

    def wrap_class(cls: C) -> C:
        for name, fn in list(vars(cls).items()):
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            setattr(cls, name, _wrap(fn, url_of))
        return cls

    return wrap_class


def _wrap(fn: Callable[..., Any], url_of: Callable[[Any], str]) -> Callable[..., Any]:
    def translate(self: Any, exc: BaseException) -> BaseException:
        typed = as_unavailable(url_of(self), exc)
        return exc if typed is None else typed

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def agen(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, *args, **kwargs):
                    yield item
            except Exception as exc:
                typed = translate(self, exc)
                if typed is exc:
                    raise
                raise typed from None
        return agen
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def coro(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(self, *args, **kwargs)
            except Exception as exc:
                typed = translate(self, exc)
                if typed is exc:
                    raise
                raise typed from None
        return coro
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            try:
                yield from fn(self, *args, **kwargs)
            except Exception as exc:
                typed = translate(self, exc)
                if typed is exc:
                    raise
                raise typed from None
        return gen

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            typed = translate(self, exc)
            if typed is exc:
                raise
            raise typed from None
    return call
