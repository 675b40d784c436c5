"""The blob store: immutable, content-addressed blobs (artifact contents, offloaded
payloads). A blob's id is the sha256 of its bytes as stored, so identical contents are
stored once.

Order of writes, which garbage collection relies on: a writer registers its *holder* (who
will reference the blob: ``run:<run id>``, ``art:<artifact name>``, ``ses:<session id>``)
with the blob, then writes the blob, then writes the record that references it. So there is
never a reference without its blob; a crash in between leaves a blob whose holder does not
reference it, which the controller's collection finds (it asks each holder's kind whether
the holder still references the blob) and deletes after a grace period.

Backends, chosen by ``MARBLES_BLOB_STORE``: ``redis`` (the default: blobs in the
deployment's Redis, each under its own hash tag, up to ``MARBLES_BLOB_REDIS_MAX`` bytes),
``file:///shared/path`` (a directory every process mounts), ``s3://bucket/prefix``
(S3-compatible object storage through boto3; ``MARBLES_S3_ENDPOINT`` for a non-AWS
server)."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from ..errors import MarblesError


class BlobMissing(MarblesError):
    """A referenced blob is not in the blob store."""


@dataclass(frozen=True)
class BlobRef:
    """Where a blob is: its sha256 (hex) and size in bytes, and the backend holding it."""

    sha256: str
    size: int
    backend: str = "redis"


class BlobStore(Protocol):
    """What every backend does. `put` is idempotent: the same bytes give the same ref and
    are stored once; each call adds `holder` to the blob's holders."""

    name: str

    def put(self, data: bytes, *, holder: str) -> BlobRef: ...
    def get(self, ref: BlobRef) -> bytes: ...
    def open(self, ref: BlobRef) -> BinaryIO: ...
    def exists(self, ref: BlobRef) -> bool: ...


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class RedisBlobs:
    """Blobs in the deployment's Redis: ``{P:blob:<sha[:4]>}:<sha>`` holds the bytes,
    ``{P:blob:<sha[:4]>}:holders:<sha>`` the holders (one tag: one slot for both)."""

    name = "redis"

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def _tag(self, sha: str) -> str:
        return f"{{{self.prefix}:blob:{sha[:4]}}}"

    def put(self, data: bytes, *, holder: str) -> BlobRef:
        sha = sha256_hex(data)
        tag = self._tag(sha)
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(f"{tag}:holders:{sha}", holder)
        pipe.set(f"{tag}:{sha}", data, nx=True)
        pipe.execute()
        return BlobRef(sha, len(data), self.name)

    def get(self, ref: BlobRef) -> bytes:
        data = self.client.get(f"{self._tag(ref.sha256)}:{ref.sha256}")
        if data is None:
            raise BlobMissing(f"blob {ref.sha256} is missing from the Redis blob store")
        return bytes(data)

    def open(self, ref: BlobRef) -> BinaryIO:
        return io.BytesIO(self.get(ref))

    def exists(self, ref: BlobRef) -> bool:
        return bool(self.client.exists(f"{self._tag(ref.sha256)}:{ref.sha256}"))


def blob_store_for(store: Any) -> BlobStore:
    """The blob store of the deployment `store` belongs to (cached on the store)."""
    found = store.__dict__.get("_blob_store")
    if found is None:
        found = RedisBlobs(store.client, store.keys.prefix)
        store.__dict__["_blob_store"] = found
    return found  # type: ignore[no-any-return]
