"""The blob store: immutable, content-addressed blobs (artifact contents, offloaded
payloads); the parts every backend shares are in blob_base.py (the order of writes the
collection relies on is described there), the backends in blob_redis.py, blob_dir.py and
blob_s3.py. This module chooses the backend of a deployment.

Backends, chosen per deployment by ``MARBLES_BLOB_STORE``, which every process (workers,
controller, web, CLI) must be given alike: ``redis`` (the default), ``file:///shared/path``,
``s3://bucket/prefix``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError
from .blob_base import (
    BLOB_GRACE_ENV,
    BLOB_STORE_ENV,
    BlobMissing,
    BlobRef,
    BlobStore,
    BlobTooLarge,
    HeldBlobs,
    grace_ms,
    sha256_hex,
)
from .blob_dir import DirBlobs
from .blob_redis import RedisBlobs
from .blob_s3 import S3Blobs

if TYPE_CHECKING:
    from ..store import RedisStore

__all__ = ["BLOB_GRACE_ENV", "BLOB_STORE_ENV", "BlobMissing", "BlobRef", "BlobStore",
           "BlobTooLarge", "HeldBlobs", "backend_named", "blob_store_for", "grace_ms",
           "open_blob_store", "sha256_hex"]


def open_blob_store(store: RedisStore, url: str) -> HeldBlobs:
    """The backend MARBLES_BLOB_STORE=`url` names, for the deployment of `store`."""
    url = url.strip()
    if url in ("", "redis"):
        return RedisBlobs(store)
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"{BLOB_STORE_ENV}={url!r}: a directory is spelled "
                              "file:///absolute/path")
        return DirBlobs(store, unquote(parts.path), url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ConfigError(f"{BLOB_STORE_ENV}={url!r}: expected s3://bucket/prefix")
        return S3Blobs(store, parts.netloc, parts.path.strip("/"), url)
    raise ConfigError(f"{BLOB_STORE_ENV}={url!r}: expected redis, file:///path or "
                      "s3://bucket/prefix")


def blob_store_for(store: Any) -> HeldBlobs:
    """The blob store of the deployment `store` belongs to (MARBLES_BLOB_STORE, read once
    per store and cached on it)."""
    found = store.__dict__.get("_blob_store")
    if found is None:
        found = open_blob_store(store, os.environ.get(BLOB_STORE_ENV, ""))
        store.__dict__["_blob_store"] = found
    return found  # type: ignore[no-any-return]


def backend_named(store: Any, name: str) -> HeldBlobs:
    """The backend a reference names: the configured one, or Redis for blobs written there
    before the deployment moved to another store."""
    configured = blob_store_for(store)
    if configured.name == name:
        return configured
    if name == "redis":
        return RedisBlobs(store)
    raise BlobMissing(f"a payload is in the {name} blob store, but this process's "
                      f"{BLOB_STORE_ENV} is {configured.url or configured.name!r}: give every "
                      "process the same blob store")
