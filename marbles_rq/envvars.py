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
