"""What debounce, throttle and singleton are, without the store: the checks of a workflow's
options (durations, rates, keys), the key value of a run's input, and the decision an enqueue
gets back. flow/enqueue_gates.py applies them; this module imports nothing of the engine,
so definitions (engine/authoring.py), the client and the web faces can use it cheaply.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OUTCOMES = ("started", "merged", "dropped", "skipped", "cancelled_running")
SINGLETON_MODES = ("skip", "cancel_running")
MAX_KEY_VALUE = 256  # characters of a gate key's value
MAX_WINDOW_MS = 7 * 86_400_000
MAX_THROTTLE = 100_000  # runs per period: the throttle keeps one entry per run let through
_UNITS = {"ms": 1, "s": 1000, "sec": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000,
          "hour": 3_600_000, "d": 86_400_000, "day": 86_400_000}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|m|min|h|hour|d|day)\s*")
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*(ms|s|sec|m|min|h|hour|d|day)\s*")

Key = str | Callable[[Any], str] | None


class GateSpecError(ValueError):
    """A debounce, throttle or singleton option is invalid (one line)."""


def duration_ms(value: Any, what: str) -> int:
    """Milliseconds of "250ms", "5s", "1.5m", "2h", "1d", or a number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise GateSpecError(f"invalid {what} {value!r}: use a duration such as '5s', '1m' "
                            f"or a number of seconds")
    if isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if match is None:
            raise GateSpecError(f"invalid {what} {value!r}: use a number and a unit (ms, s, "
                                f"m, h, d), e.g. '5s'")
        ms = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        ms = float(value) * 1000
    if not 1 <= ms <= MAX_WINDOW_MS:
        raise GateSpecError(f"invalid {what} {value!r}: it must be between 1 ms and 7 days")
    return int(ms)


def rate(value: Any, what: str = "throttle") -> tuple[int, int]:
    """(runs, period ms) of "10/min", "5/s", "100/h", "3/10s"."""
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise GateSpecError(f"invalid {what} {value!r}: use '<runs>/<period>', e.g. '10/min', "
                            f"'5/s', '100/h' or '3/10s'")
    count = int(match.group(1))
    period = float(match.group(2) or 1) * _UNITS[match.group(3)]
    if not 1 <= count <= MAX_THROTTLE:
        raise GateSpecError(f"invalid {what} {value!r}: the number of runs must be 1 to "
                            f"{MAX_THROTTLE}")
    if not 1 <= period <= MAX_WINDOW_MS:
        raise GateSpecError(f"invalid {what} {value!r}: the period must be between 1 ms and "
                            f"7 days")
    return count, int(period)


@dataclass(frozen=True)
class Gate:
    """A workflow's enqueue gate: at most one of debounce, throttle, singleton."""

    kind: str  # debounce | throttle | singleton
    key: Key = None  # an input field's name, a callable of the input, or None: one gate
    window_ms: int = 0  # debounce: the quiet time that closes a window
    max_ms: int = 0  # debounce: a window closes at the latest this long after it opened
    reduce: Callable[[Any, Any], Any] | None = None  # debounce: merges inputs
    runs: int = 0  # throttle: at most this many runs ...
    period_ms: int = 0  # ... per this period (a sliding window)
    mode: str = ""  # singleton: skip | cancel_running

    def describe(self) -> str:
        key = "" if self.key is None else (f" per {self.key}" if isinstance(self.key, str)
                                           else " per key")
        if self.kind == "debounce":
            return (f"debounce {_ms_text(self.window_ms)}" + (
                f" (at most {_ms_text(self.max_ms)})" if self.max_ms else "") + key)
        if self.kind == "throttle":
            return f"throttle {self.runs}/{_ms_text(self.period_ms)}{key}"
        return f"singleton {self.mode}{key}"

    def to_json(self) -> dict[str, Any]:
        """The catalog's form (a callable key is only named: a caller without the source
        cannot compute it)."""
        return {"kind": self.kind, "key": self.key if isinstance(self.key, str) or
                self.key is None else None, "key_callable": callable(self.key),
                "window_ms": self.window_ms, "max_ms": self.max_ms,
                "reduce": self.reduce is not None, "runs": self.runs,
                "period_ms": self.period_ms, "mode": self.mode}


def _ms_text(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def gate_of(*, debounce: Any = None, debounce_key: Key = None, debounce_max: Any = None,
            debounce_reduce: Any = None, throttle: Any = None, throttle_key: Key = None,
            singleton: Any = None, singleton_key: Key = None,
            takes_input: bool = True) -> Gate | None:
    """The gate these workflow options declare, or None; GateSpecError names a bad one."""
    chosen = [k for k, v in (("debounce", debounce), ("throttle", throttle),
                             ("singleton", singleton)) if v is not None]
    for kind, key, base in (("debounce", debounce_key, debounce),
                            ("throttle", throttle_key, throttle),
                            ("singleton", singleton_key, singleton)):
        if key is not None and base is None:
            raise GateSpecError(f"{kind}_key needs {kind}= as well")
        if key is not None and not (callable(key) or (isinstance(key, str) and key)):
            raise GateSpecError(f"invalid {kind}_key {key!r}: name a field of the input, or "
                                f"pass a function of the input returning a string")
        if isinstance(key, str) and not takes_input:
            raise GateSpecError(f"{kind}_key {key!r} names an input field, but the workflow "
                                f"takes no input")
    if debounce is None and (debounce_max is not None or debounce_reduce is not None):
        raise GateSpecError("debounce_max and debounce_reduce need debounce= as well")
    if len(chosen) > 1:
        raise GateSpecError(f"choose one of debounce, throttle, singleton (given: "
                            f"{', '.join(chosen)})")
    if not chosen:
        return None
    if debounce is not None:
        window = duration_ms(debounce, "debounce")
        most = 0 if debounce_max is None else duration_ms(debounce_max, "debounce_max")
        if most and most < window:
            raise GateSpecError(f"debounce_max {debounce_max!r} is shorter than debounce "
                                f"{debounce!r}: the window could never wait its quiet time")
        if debounce_reduce is not None and not callable(debounce_reduce):
            raise GateSpecError("debounce_reduce must be a function (previous_input, "
                                "new_input) -> input")
        return Gate("debounce", debounce_key, window_ms=window, max_ms=most,
                    reduce=debounce_reduce)
    if throttle is not None:
        runs, period = rate(throttle)
        return Gate("throttle", throttle_key, runs=runs, period_ms=period)
    if singleton not in SINGLETON_MODES:
        raise GateSpecError(f"invalid singleton {singleton!r}: use 'skip' or "
                            f"'cancel_running'")
    return Gate("singleton", singleton_key, mode=singleton)


def from_json(data: dict[str, Any] | None) -> Gate | None:
    """A gate from its catalog form; a callable key becomes a function that refuses."""
    if not data:
        return None
    key: Key = data.get("key")
    if data.get("key_callable"):
        key = _callable_elsewhere
    return Gate(data["kind"], key, window_ms=data.get("window_ms", 0),
                max_ms=data.get("max_ms", 0),
                reduce=_callable_elsewhere if data.get("reduce") else None,
                runs=data.get("runs", 0), period_ms=data.get("period_ms", 0),
                mode=data.get("mode", ""))


class GateInputError(ValueError):
    """A run's input cannot give its gate's key (one line)."""


def _callable_elsewhere(*_args: Any) -> Any:
    raise GateInputError("its gate uses a Python function (a key or a reducer): enqueue it "
                         "from a process that imports the workflow's source")


def key_value(gate: Gate, workflow: str, raw_input: Any, typed_input: Callable[[], Any]
              ) -> str:
    """The key value of a run with this (decoded JSON) input: "" without a key. Raises
    GateInputError when the input lacks the field, or the key is not a short string."""
    if gate.key is None:
        return ""
    if isinstance(gate.key, str):
        if not isinstance(raw_input, dict) or gate.key not in raw_input:
            raise GateInputError(f"workflow {workflow!r} is {gate.kind}d per {gate.key!r}, "
                                 f"but the input has no field {gate.key!r}")
        value = raw_input[gate.key]
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise GateInputError(f"the input's {gate.key!r} must be a string or a whole "
                                 f"number (the {gate.kind} key), not {value!r}")
        text = str(value)
    else:
        text = gate.key(typed_input())
        if not isinstance(text, str):
            raise GateInputError(f"the {gate.kind} key function of workflow {workflow!r} "
                                 f"returned {text!r}, not a string")
    if not 1 <= len(text) <= MAX_KEY_VALUE:
        raise GateInputError(f"the {gate.kind} key's value must be 1 to {MAX_KEY_VALUE} "
                             f"characters")
    return text


def digest(gate: Gate, workflow: str, value: str) -> str:
    """The id of a gate's keys: fixed length, any workflow name or key value."""
    return hashlib.sha1(f"{gate.kind}\0{workflow}\0{value}".encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Decision:
    """What happened to one enqueue of a gated workflow (an ungated one is `started`)."""

    outcome: str  # one of OUTCOMES
    # started / merged / cancelled_running: the run it made or merged into; skipped: the
    # unfinished run that made it skip; dropped: "" (no run)
    run_id: str
    cancelled: str = ""  # cancelled_running: the run it cancelled
    retry_at_ms: int = 0  # dropped: the throttle lets a run through again from then
    until_ms: int = 0  # debounce: the window closes then (unless merged again)
    max_ms: int = 0  # debounce: it closes then at the latest (0: no max)
    merged: int = 0  # debounce: the enqueues the window holds, this one included
    key: str = ""  # the gate key's value ("" for one gate per workflow)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": self.outcome, "run_id": self.run_id or None,
                               "key": self.key or None}
        if self.outcome == "cancelled_running":
            out["cancelled"] = self.cancelled
        if self.outcome == "dropped":
            out["retry_at"] = iso(self.retry_at_ms)
            out["retry_after_s"] = max(0.0, round(self.retry_at_ms / 1000 - time.time(), 3))
        if self.until_ms:
            out["until"], out["merged"] = iso(self.until_ms), self.merged
            out["max"] = iso(self.max_ms) if self.max_ms else None
        return out

    def message(self) -> str:
        """One line for a person."""
        if self.outcome == "started":
            if self.until_ms:
                return (f"started run {self.run_id}: debouncing until {iso(self.until_ms)}")
            return f"started run {self.run_id}"
        if self.outcome == "merged":
            return (f"merged into run {self.run_id} ({self.merged} enqueues; it starts at "
                    f"{iso(self.until_ms)} unless merged again)")
        if self.outcome == "dropped":
            return (f"dropped: the throttle is full; retry after {iso(self.retry_at_ms)} "
                    f"(no run was made)")
        if self.outcome == "skipped":
            return f"skipped: run {self.run_id} of this singleton is unfinished"
        return f"cancelled run {self.cancelled} and started run {self.run_id}"


STARTED = Decision("started", "")


def iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"
