"""marbles-rq: durable workflows on Redis with RQ workers."""

from .engine.authoring import step, workflow
from .engine.execute import RunContext, current
from .errors import MarblesError
from .store import RedisStore, Store, open_store
from .store.keys import Keyspace
from .store.memory import MemoryStore
from .triggers.schedules import schedule

__all__ = [
    "Keyspace",
    "MarblesError",
    "MemoryStore",
    "RedisStore",
    "RunContext",
    "Store",
    "current",
    "open_store",
    "schedule",
    "step",
    "workflow",
]
__version__ = "0.1.0"
