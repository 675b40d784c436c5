"""What a rate limit is, without the store: rate strings (``"25/s"``, ``"100/min"``,
``"5/10s"``, ``"1000/h"``), `Rate` with its burst, a limit's name and the id of its keys.

A rate of N per period lets one run through every period/N (the *interval*); a burst of B
lets B through at once after a quiet spell, then one per interval again (GCRA: a
generic cell rate algorithm, flow/rate_limits.py). Burst 1, the default, is strict
spacing: any window of one period holds at most N admissions; burst B at most N + B - 1.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from ..errors import MarblesError

_RATE = re.compile(r"\s*([1-9][0-9]{0,8})\s*/\s*([1-9][0-9]{0,5})?\s*(ms|s|sec|min|m|h)\s*")
_UNIT_US = {"ms": 1_000, "s": 1_000_000, "sec": 1_000_000, "min": 60_000_000,
            "m": 60_000_000, "h": 3_600_000_000}
MAX_BURST = 100_000
MAX_NAME = 200
_NAME = re.compile(r"[^\x00-\x1f|]{1,200}")
RATE_HELP = ("use N/s, N/min, N/h or N/<count><unit> such as 5/10s (N a whole number >= 1)")


class RateError(MarblesError):
    """A rate string, a burst or a limit's name that is not valid."""

    code = "invalid_rate"


@dataclass(frozen=True)
class Rate:
    """``mr.Rate("25/s", burst=5)``: a rate and how many may pass at once after a quiet
    spell (default 1: strict spacing, one per interval)."""

    text: str
    burst: int = 1

    def __post_init__(self) -> None:
        interval_us(self.text)
        check_burst(self.burst)

    @property
    def interval_us(self) -> int:
        return interval_us(self.text)

    def spec(self) -> str:
        """How `limits` and the catalog show it: "25/s" or "25/s burst 5"."""
        return self.text if self.burst == 1 else f"{self.text} burst {self.burst}"


def interval_us(text: Any) -> int:
    """Microseconds between two admissions at rate `text`; RateError when it is not a rate."""
    match = _RATE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise RateError(f"invalid rate {text!r}: {RATE_HELP}")
    count, periods, unit = int(match.group(1)), int(match.group(2) or 1), match.group(3)
    interval = periods * _UNIT_US[unit] // count
    if interval < 1:
        raise RateError(f"invalid rate {text!r}: faster than one per microsecond")
    return interval


def check_burst(burst: Any) -> int:
    if type(burst) is not int or not 1 <= burst <= MAX_BURST:
        raise RateError(f"invalid burst {burst!r}: a whole number from 1 to {MAX_BURST}")
    return burst


def as_rate(value: Any) -> Rate:
    """A `Rate` from a rate string or a `Rate`."""
    if isinstance(value, Rate):
        return value
    if isinstance(value, str):
        return Rate(value.strip())
    raise RateError(f"invalid rate {value!r}: a string such as '25/s', or mr.Rate('25/s', "
                    f"burst=5)")


def check_name(name: Any, what: str = "rate limit name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RateError(f"invalid {what} {name!r}: 1 to {MAX_NAME} printable characters, "
                        f"no '|'")
    return name


def rate_id(name: str) -> str:
    """The id of a limit's keys: a digest, so any name makes a valid, fixed-length hash
    tag."""
    return hashlib.sha1(f"rate\0{name}".encode()).hexdigest()[:20]


def definition_problem(rate_limit: Any, rate_key: Any) -> str | None:
    """Why these workflow options are invalid, or None."""
    if rate_limit is None:
        return "rate_key needs rate_limit= (the rate per key)" if rate_key is not None \
            else None
    try:
        as_rate(rate_limit)
    except RateError as exc:
        return str(exc)
    if rate_key is not None and not callable(rate_key) and (
            not isinstance(rate_key, str) or not rate_key):
        return (f"invalid rate_key {rate_key!r}: name a field of the workflow's input, or "
                f"pass a function of the input that returns a string")
    return None


def format_interval(interval: int) -> str:
    """A readable rate for an interval in microseconds (for listings)."""
    for unit, per in (("s", 1_000_000), ("min", 60_000_000), ("h", 3_600_000_000)):
        if per % interval == 0:
            return f"{per // interval}/{unit}"
    return f"1/{interval / 1_000_000:g}s"
