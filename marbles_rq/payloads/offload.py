"""Offloading (claim checks): a stored payload larger than MARBLES_OFFLOAD_BYTES (256 KiB by
default) goes to the blob store (payloads/blobs.py) and the record keeps a reference,
``{"$mr":"ref","sha":<sha256>,"n":<bytes>,"b":<backend>}``, so Redis memory per run stays
bounded whatever users return. The codec calls `offload` after sealing (the blob holds the
sealed bytes: encrypted when keys are configured) and `fetch` before opening.

A payload is offloaded only with a holder (who references it: ``run:<id>``, ``ses:<id>``):
without one the collection could not tell it is still needed."""

from __future__ import annotations

from typing import Any

import msgspec

from ..envvars import env_int
from .blobs import BlobRef, backend_named, blob_store_for

OFFLOAD_ENV = "MARBLES_OFFLOAD_BYTES"
DEFAULT_OFFLOAD_BYTES = 256 << 10
REF_PREFIX = b'{"$mr":"ref",'


class _Ref(msgspec.Struct, frozen=True):
    sha: str
    n: int
    b: str


def offload_bytes() -> int:
    return env_int(OFFLOAD_ENV, DEFAULT_OFFLOAD_BYTES, unit="bytes")


def offload(store: Any, stored: bytes, holder: str) -> bytes:
    """`stored` itself, or a reference to it in the blob store when it is over the
    threshold (the blob and its holder are written first)."""
    if not holder or len(stored) <= offload_bytes():
        return stored
    ref = blob_store_for(store).put(stored, holder=holder)
    return msgspec.json.encode({"$mr": "ref", "sha": ref.sha256, "n": ref.size,
                                "b": ref.backend})


def is_ref(stored: bytes) -> bool:
    return stored.startswith(REF_PREFIX)


def ref_of(stored: bytes) -> BlobRef:
    ref = msgspec.json.decode(stored, type=_Ref)
    return BlobRef(ref.sha, ref.n, ref.b)


def fetch(store: Any, stored: bytes) -> bytes:
    """The bytes a reference stands for (raises BlobMissing when they cannot be read)."""
    ref = ref_of(stored)
    return backend_named(store, ref.backend).get(ref)
