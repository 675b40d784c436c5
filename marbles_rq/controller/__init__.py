"""The elected controller: one process at a time holds a fenced lease and keeps every
accepted run moving (redelivery of vanished executions, dispatch of recorded deliveries,
deliveries lost inside RQ, retention)."""

from .context import Stats
from .loop import Controller

__all__ = ["Controller", "Stats"]
