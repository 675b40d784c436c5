"""How an undo (a compensation) is named so that any worker can run it, and the ledger
names the compensation machinery writes under.

An undo is a registered step (`step:<name>`) or a plain function defined at the top level
of a module (`py:<module>:<qualname>`): a worker resolves the name against its own
registry or imports, never a pickled callable. Lambdas, functions nested in another
function, and anything that does not resolve back to itself are refused.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from ..errors import MarblesError

# The ledger key of the phase marker: its presence says the run is compensating and how it
# ends (the marker's status: failed, with its error, or cancelled).
MARKER_KEY = "|compensate"
# The frame the undos run in, as recorded steps: `|compensate.<name>#<n>`.
FRAME = "|compensate"
# The name of a registration made with ctx.compensate / mr.compensate, at its position.
UNDO = "|undo"
# Retries of an undo that is a plain function (a registered step keeps its own policy).
DEFAULT_RETRIES = 3


class CompensationError(MarblesError):
    """An undo or its arguments cannot be recorded (a lambda, a nested function, a step not
    registered, arguments that are not JSON)."""

    code = "invalid_compensation"


def _is_step(fn: Any) -> bool:
    return type(fn).__name__ == "StepDef" and hasattr(fn, "retries") and hasattr(fn, "name")


def undo_ref(fn: Any, steps: dict[str, Any]) -> tuple[str, str]:
    """(the reference another worker resolves, the undo's name) of `fn`, or
    CompensationError saying why it cannot be one. `steps`: the registered steps."""
    if _is_step(fn):
        step_name = str(fn.name)
        if steps.get(step_name) is not fn:
            raise CompensationError(f"undo {step_name!r} is not a registered step (register "
                                    f"it with @mr.step at the top level of a module)")
        return f"step:{step_name}", step_name
    if type(fn).__name__ == "WorkflowDef":
        raise CompensationError(f"workflow {getattr(fn, 'name', fn)!r} cannot be an undo: "
                                f"give a step or a module-level function")
    if not callable(fn):
        raise CompensationError(f"an undo must be a step or a function, not "
                                f"{type(fn).__name__}")
    name = getattr(fn, "__name__", "")
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if name == "<lambda>":
        raise CompensationError("a lambda cannot be an undo (another worker could not find "
                                "it): define a function at the top level of a module, or a "
                                "step")
    if not inspect.isfunction(fn) or not module or "<locals>" in qualname or "." in qualname:
        raise CompensationError(f"undo {qualname or fn!r} is not a module-level function "
                                f"(another worker could not find it): define it at the top "
                                f"level of a module, or register it as a step")
    try:
        found = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise CompensationError(f"undo {module}:{qualname} cannot be found by its name: "
                                f"define it at the top level of a module")
    return f"py:{module}:{qualname}", qualname


def name_in_frame(ref: str) -> str:
    """The step name an undo runs under in the compensate frame."""
    return ref.rsplit(":", 1)[1]
