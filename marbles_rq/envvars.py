"""Settings read from the environment: one parser, one clear error for a bad value."""

from __future__ import annotations

import os

from .errors import ConfigError


def env_int(name: str, default: int, *, unit: str) -> int:
    """A whole number > 0 from environment variable `name` (`default` when unset or empty);
    anything else is a ConfigError naming the variable (exit 2 from the CLI)."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name} must be a whole number of {unit} > 0, not {raw!r}")
    return value


# Turns OpenTelemetry tracing on (marbles_rq/tracing.py; docs/operate/tracing.md).
TRACING_ENV = "MARBLES_TRACING"

# Where a step that paused its run (on_exhausted="pause") is announced: a URL the controller
# POSTs each pause to, signed with HMAC-SHA256 of MARBLES_NOTIFY_SECRET (controller/notices.py;
# docs/how-to/failed-steps.md).
NOTIFY_URL_ENV = "MARBLES_NOTIFY_URL"
NOTIFY_SECRET_ENV = "MARBLES_NOTIFY_SECRET"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """An on/off switch from environment variable `name` (off when unset or empty); a value
    that is neither 1/true/yes/on nor 0/false/no/off is a ConfigError naming the variable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _FALSE:
        return False
    if raw in _TRUE:
        return True
    raise ConfigError(f"{name} must be 1 or 0, not {raw!r}")
