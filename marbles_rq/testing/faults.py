"""The test kit's overrides of step bodies: injected failures (`fail_step`) and mocks
(`mock_step`). The executor asks for them at each step call (Execution.override_step) and
runs what it gets as the step's body: retries, recording and replay stay the real ones."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.authoring import StepDef

_NONE = object()


@dataclass
class _Failure:
    left: int
    error: BaseException | type[BaseException] | None

    def exception(self, key: str) -> BaseException:
        if self.error is None:
            return RuntimeError(f"failure injected into step {key}")
        return self.error() if isinstance(self.error, type) else self.error


class Faults:
    def __init__(self) -> None:
        self.failures: dict[str, _Failure] = {}
        self.mocks: dict[str, Any] = {}

    def fail(self, key: str, times: int,
             error: BaseException | type[BaseException] | None) -> None:
        if times < 1:
            raise ValueError("times must be at least 1")
        self.failures[key] = _Failure(times, error)

    def mock(self, name_or_key: str, replacement: Any) -> None:
        self.mocks[name_or_key] = replacement

    def override(self, key: str, definition: StepDef) -> StepDef:
        """The definition the step call at `key` runs (the one given when nothing is
        injected there)."""
        mock = self.mocks.get(key, self.mocks.get(definition.name, _NONE))
        failure = self.failures.get(key)
        if mock is _NONE and failure is None:
            return definition
        fn: Callable[..., Any] = definition.fn
        if mock is not _NONE:
            fn = mock if callable(mock) else _returning(mock)
        if failure is not None:
            fn = _failing(fn, key, failure)
        return dataclasses.replace(definition, fn=fn)


def _returning(value: Any) -> Callable[..., Any]:
    def mocked(*args: Any, **kwargs: Any) -> Any:
        return value

    return mocked


def _failing(fn: Callable[..., Any], key: str, failure: _Failure) -> Callable[..., Any]:
    """`fn`, whose next `failure.left` attempts raise instead of running."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def failing_async(*args: Any, **kwargs: Any) -> Any:
            if failure.left > 0:
                failure.left -= 1
                raise failure.exception(key)
            return await fn(*args, **kwargs)

        return failing_async

    @functools.wraps(fn)
    def failing(*args: Any, **kwargs: Any) -> Any:
        if failure.left > 0:
            failure.left -= 1
            raise failure.exception(key)
        return fn(*args, **kwargs)

    return failing


__all__ = ["Faults"]
