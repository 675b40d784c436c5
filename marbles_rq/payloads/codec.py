"""The payload codec: the JSON text of a user value <-> the JSON text stored in its place.

Contract (what every caller relies on):

* ``encode_payload(store, data, holder=...)`` takes the JSON text of a user value and
  returns the JSON text to store instead (in a ``msgspec.Raw`` field, a hash field, a script
  argument). Without keys and under the offload threshold it is `data` itself, so stores
  written before the codec read the same. Otherwise it is an envelope, a JSON object whose
  first member is ``"$mr"``: ``{"$mr":"enc",...}`` (sealed: compressed and/or encrypted,
  see `crypto`), ``{"$mr":"ref",...}`` (offloaded to the blob store, see `offload`), and
  ``{"$mr":"esc","v":<value>}`` for a user value that itself begins like an envelope.
  `holder` names who references an offloaded blob (``run:<run id>``, ``ses:<session id>``).
* ``decode_payload(store, stored)`` is its inverse: the JSON text of the user value. It
  raises `PayloadKeyMissing` (one line naming the key id) when the payload was encrypted
  with a key this process does not have, and `BlobMissing` when an offloaded payload's blob
  cannot be read.
* ``seal_bytes`` / ``open_bytes``: the same sealing for binary content (artifact blobs),
  without the JSON envelope.

`store` is the store (RedisStore) the payload is written to: its deployment's keys and blob
store are reached through it."""

from __future__ import annotations

from typing import Any

from . import crypto, offload

ENVELOPE = b'{"$mr":'
ESCAPE = b'{"$mr":"esc","v":'
SEALED = b'{"$mr":"enc",'


def encode_payload(store: Any, data: bytes, *, holder: str = "") -> bytes:
    """The JSON text to store for the JSON text `data` of a user value."""
    sealed = crypto.seal_json(data)
    if sealed is not None:
        data = sealed
    elif data.startswith(ENVELOPE):
        data = ESCAPE + data + b"}"
    return offload.offload(store, data, holder)  # after sealing: the blob holds sealed bytes


def decode_payload(store: Any, stored: bytes) -> bytes:
    """The JSON text of the user value stored as `stored`."""
    if not stored.startswith(ENVELOPE):
        return stored
    if offload.is_ref(stored):  # before opening: the blob holds the sealed bytes
        stored = offload.fetch(store, stored)
        if not stored.startswith(ENVELOPE):
            return stored
    if stored.startswith(SEALED):
        return crypto.open_json(stored)
    if stored.startswith(ESCAPE):
        return stored[len(ESCAPE):-1]
    raise crypto.PayloadSealError(f"unknown payload envelope: {stored[:40]!r}")


def seal_bytes(store: Any, data: bytes) -> bytes:
    """Binary content as stored (compressed and encrypted when keys are configured)."""
    return crypto.seal_blob(data)


def open_bytes(store: Any, sealed: bytes) -> bytes:
    """The content `seal_bytes` sealed."""
    return crypto.open_blob(sealed)
