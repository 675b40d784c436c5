"""marbles-rq: durable workflows on Redis with RQ workers."""

from .authoring import step, workflow
from .errors import MarblesError
from .execute import RunContext, current
from .keys import Keyspace
from .memory import MemoryStore
from .store import RedisStore, Store, open_store

__all__ = [
    "Keyspace",
    "MarblesError",
    "MemoryStore",
    "RedisStore",
    "RunContext",
    "Store",
    "current",
    "open_store",
    "step",
    "workflow",
]
__version__ = "0.1.0"
