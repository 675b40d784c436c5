"""`retry RUN --input-patch JSON`: a change to a paused step's arguments before it runs again.

A patch is an RFC 7396 JSON merge patch over the step's arguments bound by name (its
signature, defaults filled in): `{"amount": 5}` sets the argument `amount`, `{"card":
{"cvc": null}}` removes the field `cvc` of the argument `card`. Its top-level keys must be
parameters of the step, and none may be null (an argument cannot be removed). The patched
value of an argument is converted to the parameter's annotation (msgspec), so an object
patched into a Struct argument is a Struct again. Patches are recorded in the step's ledger
entry and applied in order by every later replay, so the run does the same on every worker.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from .authoring import InputError


class PatchRefusedError(InputError):
    """An input patch that does not fit the step it would change."""

    code = "patch_refused"


def decode_patch(text: str, what: str) -> Any:
    """A patch given as JSON text (`what` names where: `--input-patch`). JSON null is
    refused, not taken for "no patch": whoever typed it meant to change something."""
    import json

    try:
        patch = json.loads(text)
    except ValueError as exc:
        raise PatchRefusedError(f"{what} is not valid JSON: {exc}") from None
    if patch is None:
        raise PatchRefusedError(f"{what} is null: a patch is a JSON object of the step's "
                                f"arguments by name (leave it out to retry as it is)")
    return patch


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: apply `patch` to `target` (neither is modified)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _bind(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
          ) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def bound_args(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> dict[str, Any] | None:
    """The arguments of a call by parameter name, as JSON values; None when they are not
    JSON (such a step can be retried, not patched)."""
    try:
        value = msgspec.to_builtins(dict(_bind(fn, args, kwargs).arguments))
        return msgspec.json.decode(msgspec.json.encode(value))  # type: ignore[no-any-return]
    except (TypeError, ValueError, msgspec.EncodeError):
        return None


def check_patch(step: str, args: Any, patch: Any,
                fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The arguments `patch` makes of `args` (the step's recorded arguments), or
    PatchRefusedError saying why it does not fit. `fn`: the step's function when this
    process has it, to check the patched values against its annotations too."""
    if not isinstance(patch, dict) or not patch:
        raise PatchRefusedError(f"an input patch is a non-empty JSON object of step {step!r}'s "
                                f"arguments by name, not {_short(patch)}")
    _check_json(step, patch)
    if not isinstance(args, dict):
        raise PatchRefusedError(f"step {step!r} was called with arguments that are not JSON: "
                                f"it can be retried as it is, not patched")
    for key, value in patch.items():
        if key not in args:
            known = ", ".join(args) or "none"
            raise PatchRefusedError(f"step {step!r} has no argument {key!r} (its arguments: "
                                    f"{known})")
        if value is None:
            raise PatchRefusedError(f"the patch removes argument {key!r} of step {step!r}; "
                                    f"give it a value instead")
    merged = merge_patch(args, patch)
    if fn is not None:
        _convert(fn, merged, list(patch), step)
    return merged  # type: ignore[no-any-return]


def _check_json(step: str, patch: dict[Any, Any]) -> None:
    """Refuse a patch that would not be recorded as given: a value JSON has no form for,
    NaN or an infinity (written as null, which would then read as removing an argument, on
    every later try), or one over the payload limit."""
    from .json_values import changed_by_json
    from .ops import MAX_PAYLOAD_ENV, max_payload

    try:
        encoded = msgspec.json.encode(patch)
    except (TypeError, UnicodeEncodeError, msgspec.EncodeError, RecursionError) as exc:
        raise PatchRefusedError(f"the input patch of step {step!r} is not JSON: "
                                f"{_short(str(exc))}") from None
    if changed_by_json(patch, encoded):
        raise PatchRefusedError(f"the input patch of step {step!r} is not JSON: it holds NaN "
                                f"or an infinity")
    limit = max_payload()
    if len(encoded) > limit:
        raise PatchRefusedError(f"the input patch of step {step!r} is {len(encoded)} bytes; "
                                f"the limit is {limit} (set {MAX_PAYLOAD_ENV} to change it)")


def _convert(fn: Callable[..., Any], values: dict[str, Any], names: list[str], step: str
             ) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: the values go as JSON
        hints = {}
    out = {}
    for name in names:
        try:
            out[name] = msgspec.convert(values[name], hints.get(name, Any))
        except msgspec.ValidationError as exc:
            raise PatchRefusedError(f"the patched argument {name!r} does not fit step "
                                    f"{step!r}: {exc}") from None
    return out


def apply_patches(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  patches: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with `patches` applied in order (PatchRefusedError when they no
    longer fit: the body now calls the step otherwise than when it was patched)."""
    name = getattr(fn, "__name__", "step")
    try:
        bound = _bind(fn, args, kwargs)
    except TypeError as exc:
        raise PatchRefusedError(f"cannot patch step {name!r}: {exc}") from None
    current = bound_args(fn, args, kwargs)
    merged = current
    touched: list[str] = []
    for patch in patches:
        merged = check_patch(name, merged, patch)
        touched += [k for k in patch if k not in touched]
    assert merged is not None
    for key, value in _convert(fn, merged, touched, name).items():
        bound.arguments[key] = value
    return bound.args, bound.kwargs


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
