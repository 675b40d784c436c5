"""The durable store: records, claims, compare-and-set, journals, effect receipts, leases,
on one Redis or a Redis Cluster (`redis_store`) or in memory (`memory`).

Everything that talks to Redis on the store's behalf lives here: key names (`keys`),
records (`records`), clients (`connection`), the one module that calls Lua (`scripts`),
and the durability check (`doctor`).
"""

from .redis_store import (
    ClaimResult,
    Lease,
    LeaseHolder,
    LeaseInfo,
    RedisStore,
    Store,
    journal_kind,
    new_request_id,
    open_store,
)

__all__ = ["ClaimResult", "Lease", "LeaseHolder", "LeaseInfo", "RedisStore", "Store",
           "journal_kind", "new_request_id", "open_store"]
