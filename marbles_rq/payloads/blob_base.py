"""The blob store's parts every backend shares (blobs.py chooses the backend): immutable,
content-addressed blobs (artifact contents, offloaded payloads). A blob's id is the sha256
of its bytes as stored, so identical contents are stored once.

Order of writes, which garbage collection relies on: a writer enters the blob in the
deployment's blob index (``{P:blobs}:index``, lua/index_blob.lua), registers its *holder*
(who will reference the blob: ``run:<run id>``, ``art:<artifact name>``, ``ses:<session
id>``) beside the blob (lua/hold_blob.lua), writes the blob, then writes the record that
references it. So there is never a reference without its blob; a crash in between leaves a
blob whose holder does not reference it, which the controller's collection
(controller/blob_gc.py) finds through the index -- it asks each holder's kind whether the
holder still references the blob (payloads/holders.py) -- and deletes after a grace period.
Holders live in Redis for every backend, under the blob's own hash tag.

Backends, chosen per deployment by ``MARBLES_BLOB_STORE``, which every process (workers,
controller, web, CLI) must be given alike: ``redis`` (the default: blobs in the deployment's
Redis, each under its own hash tag, up to ``MARBLES_BLOB_REDIS_MAX`` bytes),
``file:///shared/path`` (a directory every process mounts: blob_dir.py), ``s3://bucket/prefix``
(S3-compatible object storage through boto3, ``MARBLES_S3_ENDPOINT`` for a non-AWS server:
blob_s3.py). A reference names its backend, so blobs written to Redis before the
deployment moved to another store are still read from Redis."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from ..envvars import env_int
from ..errors import MarblesError

if TYPE_CHECKING:
    from ..store import RedisStore

BLOB_STORE_ENV = "MARBLES_BLOB_STORE"
BLOB_GRACE_ENV = "MARBLES_BLOB_GRACE_S"
DEFAULT_GRACE_S = 600
# With a directory or S3 store, a blob this small stays in Redis: a round trip to an object
# store costs more than the bytes do (an artifact of a few KB, a sealed small value).
BLOB_INLINE_ENV = "MARBLES_BLOB_INLINE_MAX"
DEFAULT_INLINE_MAX = 64 << 10
# A `$del` mark older than this is a collection that died between its two steps: a put
# takes the blob over (lua/hold_blob.lua). Far longer than deleting one object takes.
STALE_DELETE_MS = 60_000
DELETING_PAUSE_S = 0.05


class BlobMissing(MarblesError):
    """A referenced blob is not in the blob store."""


class BlobTooLarge(MarblesError):
    """A blob over the Redis backend's cap (MARBLES_BLOB_REDIS_MAX)."""


@dataclass(frozen=True)
class BlobRef:
    """Where a blob is: its sha256 (hex) and size in bytes, and the backend holding it."""

    sha256: str
    size: int
    backend: str = "redis"


class BlobStore(Protocol):
    """What every backend does. `put` is idempotent: the same bytes give the same ref and
    are stored once; each call adds (or refreshes) `holder` among the blob's holders."""

    name: str
    url: str

    def put(self, data: bytes, *, holder: str) -> BlobRef: ...
    def get(self, ref: BlobRef) -> bytes: ...
    def open(self, ref: BlobRef) -> BinaryIO: ...
    def exists(self, ref: BlobRef) -> bool: ...


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def inline_max() -> int:
    return env_int(BLOB_INLINE_ENV, DEFAULT_INLINE_MAX, unit="bytes")


def grace_ms() -> int:
    """How long a blob and each of its holders are left alone by the collection after they
    were put: longer than any writer takes from its put to writing the record that
    references the blob (a run's input is put before its run exists)."""
    return env_int(BLOB_GRACE_ENV, DEFAULT_GRACE_S, unit="seconds") * 1000


class HeldBlobs:
    """What every backend shares: the index and the holders, in the deployment's Redis.
    A backend says where the bytes go (`_write`, `_read`, `_exists`, `delete_object`);
    `inline` backends (Redis) write the bytes in the same script as the holder."""

    name = ""
    url = ""
    inline = False

    def __init__(self, store: RedisStore) -> None:
        self.store = store

    def check_size(self, size: int) -> None:
        """Refuse, before anything is written, a blob this backend does not take."""

    def put(self, data: bytes, *, holder: str) -> BlobRef:
        if not holder:
            raise ValueError("a blob needs a holder (who references it)")
        self.check_size(len(data))
        sha = sha256_hex(data)
        keys, scripts = self.store.keys, self.store.scripts
        scripts.index_blob(index=keys.blobs_index, sizes=keys.blobs_sizes,
                           stats=keys.blobs_stats, sha=sha, size=len(data), look_ms=grace_ms())
        # Small blobs stay in Redis whatever the backend (their ref says "redis"): every
        # backend reads those, and the collection deletes them with the others.
        in_redis = self.inline or len(data) <= inline_max()
        blob, inline = (keys.blob(sha), data) if in_redis else (None, b"")
        deadline = time.monotonic() + 2 * STALE_DELETE_MS / 1000
        while True:
            reply = scripts.hold_blob(holders=keys.blob_holders(sha), holder=holder,
                                      stale_ms=STALE_DELETE_MS, blob=blob, data=inline)
            if reply.status != "deleting" or time.monotonic() > deadline:
                break
            time.sleep(DELETING_PAUSE_S)  # a collection is deleting these bytes: then rewrite
        if reply.status == "deleting":
            raise BlobMissing(f"blob {sha} is being deleted by the controller and did not "
                              f"finish within {2 * STALE_DELETE_MS // 1000} s; try again")
        if not in_redis and (reply.status == "new" or not self._exists(sha)):
            self._write(sha, data)
        return BlobRef(sha, len(data), "redis" if in_redis else self.name)

    def _in_redis(self, ref: BlobRef) -> bool:
        return ref.backend == "redis" and not self.inline

    def get(self, ref: BlobRef) -> bytes:
        if self._in_redis(ref):
            got: Any = self.store.client.get(self.store.keys.blob(ref.sha256))
            data = None if got is None else bytes(got)
        else:
            data = self._read(ref.sha256)
        if data is None:
            raise BlobMissing(f"blob {ref.sha256} is missing from the {self.name} blob store "
                              f"{self.url}".rstrip())
        return data

    def exists(self, ref: BlobRef) -> bool:
        if self._in_redis(ref):
            return bool(self.store.client.exists(self.store.keys.blob(ref.sha256)))
        return self._exists(ref.sha256)

    def open(self, ref: BlobRef) -> BinaryIO:
        import io
        return io.BytesIO(self.get(ref))

    # -- per backend -------------------------------------------------------------------

    def _write(self, sha: str, data: bytes) -> None:
        raise NotImplementedError

    def _read(self, sha: str) -> bytes | None:
        raise NotImplementedError

    def _exists(self, sha: str) -> bool:
        raise NotImplementedError

    def delete_object(self, sha: str) -> None:
        """Delete the bytes (the collection, after collect_blob said so); absent is fine."""
        raise NotImplementedError

    def probe(self) -> str:
        """Write, read back and delete a small object outside the blob namespace: what
        `doctor` checks. Returns one line about the store; raises on failure."""
        return f"{self.name} blob store {self.url}".rstrip()
