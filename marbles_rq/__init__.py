"""marbles-rq: durable workflows on Redis with RQ workers."""

from .errors import MarblesError
from .keys import Keyspace
from .memory import MemoryStore
from .store import RedisStore, Store, open_store

__all__ = ["Keyspace", "MarblesError", "MemoryStore", "RedisStore", "Store", "open_store"]
__version__ = "0.1.0"
