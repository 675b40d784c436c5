"""User payloads at rest: the codec every stored payload passes through (encryption with
rotating keys, compression, and offloading large values to the blob store as a claim check),
and the blob store itself (content-addressed, immutable blobs: Redis up to a cap, a
directory, or S3-compatible object storage).

Every writer of a user payload (an input, a result, a step result, an answer, a signal, a
published value, a session message, an artifact's content) calls `codec.encode_payload`
before the bytes reach a record, and every reader calls `codec.decode_payload` on what it
read; nothing else in the package knows whether a payload is encrypted or offloaded."""

from .blobs import BlobRef, BlobStore, blob_store_for
from .codec import decode_payload, encode_payload, open_bytes, seal_bytes
from .crypto import PayloadKeyMissing

__all__ = ["BlobRef", "BlobStore", "PayloadKeyMissing", "blob_store_for", "decode_payload",
           "encode_payload", "open_bytes", "seal_bytes"]
