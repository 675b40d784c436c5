"""A workflow's version: the one its author gives (`@mr.workflow(version="2")`), or by default a
fingerprint of its code, so that a run records which code it started on.

The fingerprint is 10 hex digits of a SHA-256 over the workflow function's source and the
sources of the steps it uses: the `@mr.step` definitions among the global names its code
refers to (in nested functions, lambdas and comprehensions too, and as attributes of an
imported module: `steps.charge`), sorted by step name. The decorator lines, blank lines
and whole-line comments are left out, so a change of `retries=` or of a comment's wording
does not make a new version; any other edit of the body or of one of its steps does.
Source text, not bytecode or an AST dump: two workers on different Python versions must
agree on it.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Any

FINGERPRINT_HEX = 10
VERSION_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DEF_LINE = re.compile(r"(async\s+)?def\s")


def version_problem(version: object) -> str | None:
    """Why `version` cannot be a workflow version, or None when it can."""
    if isinstance(version, str) and VERSION_PATTERN.fullmatch(version):
        return None
    return (f"invalid workflow version {version!r}: use 1 to 64 of A-Z a-z 0-9 . _ - "
            f"(or leave it out for a fingerprint of the code)")


def body_source(fn: Callable[..., Any]) -> str:
    """The function's source from its `def` line, dedented, without blank lines and
    whole-line comments; its bytecode's text when the source cannot be read (a function
    made by exec)."""
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        return "" if code is None else f"{code.co_code.hex()} {code.co_names}"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _DEF_LINE.match(line)), 0)
    return "\n".join(line.rstrip() for line in lines[start:]
                     if line.strip() and not line.lstrip().startswith("#"))


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def steps_used(fn: Callable[..., Any], step_type: type[Any]) -> dict[str, Any]:
    """Step name -> the step definitions (instances of `step_type`) that `fn`'s code refers
    to by a global name, or as an attribute of a module it refers to."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    scope: dict[str, Any] = getattr(fn, "__globals__", {})
    names = {name for c in _codes(code) for name in c.co_names}
    found: dict[str, Any] = {}
    for name in names:
        value = scope.get(name)
        if isinstance(value, step_type):
            found[value.name] = value
        elif isinstance(value, types.ModuleType):
            for attr in names:
                member = getattr(value, attr, None)
                if isinstance(member, step_type):
                    found[member.name] = member
    return found


def fingerprint(fn: Callable[..., Any], step_type: type[Any]) -> str:
    """The default version of the workflow whose body is `fn` (see the module's note)."""
    digest = hashlib.sha256(body_source(fn).encode())
    for name, step in sorted(steps_used(fn, step_type).items()):
        digest.update(b"\0step " + name.encode() + b"\0" + body_source(step.fn).encode())
    return digest.hexdigest()[:FINGERPRINT_HEX]
