"""The Redis blob backend (the default): each blob's bytes in a string under its own hash
tag, ``{P:blob:<sha[:4]>}:<sha>``, beside its holders, written by the same script call.
Capped by MARBLES_BLOB_REDIS_MAX (64 MiB by default): Redis holds every byte in memory, so
larger values belong in a file:// or s3:// store."""

from __future__ import annotations

from typing import Any

from ..envvars import env_int
from .blob_base import BLOB_STORE_ENV, BlobTooLarge, HeldBlobs

REDIS_MAX_ENV = "MARBLES_BLOB_REDIS_MAX"
DEFAULT_REDIS_MAX = 64 << 20


def redis_max() -> int:
    return env_int(REDIS_MAX_ENV, DEFAULT_REDIS_MAX, unit="bytes")


class RedisBlobs(HeldBlobs):
    name = "redis"
    url = "redis"
    inline = True

    def check_size(self, size: int) -> None:
        cap = redis_max()
        if size > cap:
            raise BlobTooLarge(
                f"a blob of {size:,} bytes is over the Redis blob store's cap of {cap:,} "
                f"({REDIS_MAX_ENV}); set {BLOB_STORE_ENV}=file:///shared/path or "
                f"s3://bucket/prefix for values this large")

    def _read(self, sha: str) -> bytes | None:
        data: Any = self.store.client.get(self.store.keys.blob(sha))
        return None if data is None else bytes(data)

    def _exists(self, sha: str) -> bool:
        return bool(self.store.client.exists(self.store.keys.blob(sha)))

    def delete_object(self, sha: str) -> None:
        self.store.client.delete(self.store.keys.blob(sha))

    def probe(self) -> str:
        return f"redis blob store (in the deployment's Redis, up to {redis_max():,} bytes a blob)"
