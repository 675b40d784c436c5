"""Artifacts in the store: versions are records in the artifact's hash (one per name, under
its name's bucket tag), contents are immutable blobs in the blob store (payloads/blobs.py),
one per distinct content.

A put writes the content's blob first (``holder art:<name>``), then the version record with
lua/put_artifact.lua, which does the compare-and-set, gives the next number and records the
put's idempotency token in one step: a resend, or a step redelivered after its put, finds
the token and gets the version it wrote, and nothing is written twice. A version never
references a missing blob; a crash between the two leaves a blob no version references,
which the controller's collection deletes (it asks `references_blob`).
"""

from __future__ import annotations

import io
import mimetypes
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from ..engine.json_values import changed_by_json
from ..errors import MarblesError
from ..payloads import BlobRef, blob_store_for, open_bytes, seal_bytes
from ..payloads.blobs import backend_named
from ..payloads.holders import register_holder_kind
from ..store.records import decode, encode
from ..store.replies import as_text
from .errors import (
    ArtifactConflict,
    ArtifactNameError,
    UnknownArtifactError,
    UnknownArtifactVersionError,
    check_name,
    check_version,
)
from .records import ArtifactInfo, ArtifactVersion, ArtifactVersionRecord

HOLDER_KIND = "art"
MAX_META = 64 << 10  # bytes of one version's meta (JSON): metadata, not content
# A streamed read hands out the content in pieces of this size.
CHUNK = 1 << 20

Data = bytes | bytearray | memoryview | str | Path


def holder(name: str) -> str:
    return f"{HOLDER_KIND}:{name}"


def content_of(data: Data) -> bytes:
    """The bytes to store: bytes as they are, text as UTF-8, a path's file."""
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, Path):
        try:
            return data.read_bytes()
        except OSError as exc:
            raise ArtifactNameError(f"cannot read {str(data)!r}: {exc.strerror}") from None
    raise ArtifactNameError(f"an artifact's content is bytes, str or a pathlib.Path, not "
                            f"{type(data).__name__}")


def media_type_of(data: Data, given: str | None, declared: str | None) -> str:
    """The given media type, else the declared one, else a guess from a path's suffix (text
    for str, octet-stream otherwise)."""
    for found in (given, declared):
        if found:
            if not isinstance(found, str) or len(found) > 255 or not found.isprintable():
                raise ArtifactNameError(f"invalid media type {found!r}")
            return found
    if isinstance(data, Path):
        guess = mimetypes.guess_type(data.name)[0]
        if guess:
            return guess
    return "text/plain; charset=utf-8" if isinstance(data, str) else "application/octet-stream"


def meta_of(meta: Any) -> bytes:
    if meta is None:
        return b"null"
    try:
        encoded = msgspec.json.encode(meta)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise ArtifactNameError(f"an artifact's meta must be JSON: {exc}") from None
    if changed_by_json(meta, encoded):
        raise ArtifactNameError("an artifact's meta must be JSON: it holds NaN or an infinity")
    if len(encoded) > MAX_META:
        raise ArtifactNameError(f"an artifact's meta is {len(encoded):,} bytes, over the "
                                f"limit of {MAX_META:,}; nothing was written")
    return encoded


@dataclass(frozen=True)
class Put:
    """A put's outcome: "ok" (written now) or "exists" (its token wrote `version` before:
    `record` is what this call would have written)."""

    status: str
    version: int
    record: ArtifactVersionRecord


class ArtifactStore:
    """The deployment's artifacts, through `store` (anything with client, keys, scripts: a
    RunStore, the client's reader)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.client, self.keys, self.scripts = store.client, store.keys, store.scripts

    # -- writing -----------------------------------------------------------------------------

    def put(self, name: str, data: Data, *, expect_version: int | None = None,
            media_type: str | None = None, meta: Any = None, declared_type: str | None = None,
            token: str = "", run: str = "", step: str = "", keep: int = 0) -> Put:
        """The version written ("ok"), or the one this token wrote before ("exists").
        `token`: the put's idempotency token (a random one when none is given: a resend of
        this call writes nothing twice). Raises
        ArtifactConflict when `expect_version` is given and is not the latest version."""
        check_name(name)
        if expect_version is not None:
            check_version(expect_version, "expect_version")
        check_version(keep, "keep")
        content = content_of(data)
        kind = media_type_of(data, media_type, declared_type)
        encoded_meta = meta_of(meta)
        sealed = seal_bytes(self.store, content)
        # The blob before the record that references it (payloads/blobs.py).
        ref = blob_store_for(self.store).put(sealed, holder=holder(name))
        token = token or f"req:{uuid.uuid4().hex}"
        record = ArtifactVersionRecord(
            version=1, size=len(content), sha256=_sha256(content, sealed, ref),
            blob=ref.sha256, blob_size=ref.size, backend=ref.backend, media_type=kind,
            meta=msgspec.Raw(encoded_meta), run=run, step=step, token=token,
            created_ms=int(time.time() * 1000))
        bucket = self.keys.bucket_of(name)
        reply = self.scripts.put_artifact(
            artifact=self.keys.artifact(name), listing=self.keys.artifact_listing(bucket),
            name=name, token=token, expect=expect_version, doc=encode(record), blob=ref.sha256,
            keep=keep)
        if reply.status == "conflict":
            assert expect_version is not None
            raise ArtifactConflict(name, expect_version, int(reply.values[0]))
        return Put(reply.status, int(reply.values[0]), record)

    def delete(self, name: str, version: int | None = None) -> list[int]:
        """Remove one version, or every version (the numbers are not reused); the versions
        removed. Their blobs are collected by the controller once nothing references them."""
        check_name(name)
        if version is not None:
            check_version(version)
        reply = self.scripts.delete_artifact(artifact=self.keys.artifact(name),
                                             version=version)
        if reply.status == "unknown":
            raise _unknown(name)
        if reply.status == "no_version":
            raise UnknownArtifactVersionError(
                f"artifact {name!r} has no version {version} (latest: "
                f"{int(reply.values[0]) or 'none'})")
        return [int(v) for v in reply.values]

    def declare(self, name: str, media_type: str | None = None) -> None:
        """Make `name` known before any version exists (idempotent)."""
        check_name(name)
        self.scripts.declare_artifact(
            artifact=self.keys.artifact(name),
            listing=self.keys.artifact_listing(self.keys.bucket_of(name)), name=name,
            media_type=media_type or "")

    # -- reading -----------------------------------------------------------------------------

    def _fields(self, name: str) -> dict[str, bytes]:
        check_name(name)
        raw = self.client.hgetall(self.keys.artifact(name))
        if not raw:
            raise _unknown(name)
        return {as_text(k): v for k, v in raw.items()}

    def _version(self, name: str, number: int, doc: bytes) -> ArtifactVersion:
        record = decode(ArtifactVersionRecord, doc, f"{self.keys.artifact(name)}#v:{number}")
        return _view(name, number, record)

    def versions(self, name: str) -> list[ArtifactVersion]:
        """Every version kept, oldest first. UnknownArtifactError."""
        fields = self._fields(name)
        found = sorted((int(f[2:]), doc) for f, doc in fields.items() if f.startswith("v:"))
        return [self._version(name, n, doc) for n, doc in found]

    def latest(self, name: str) -> int:
        """The latest version's number (0: none yet). UnknownArtifactError."""
        check_name(name)
        raw = self.client.hget(self.keys.artifact(name), "latest")
        if raw is None:
            raise _unknown(name)
        return int(raw)

    def record(self, name: str, version: int | None = None) -> tuple[int, ArtifactVersionRecord]:
        """(number, record) of `version`, the latest when None. UnknownArtifactError,
        UnknownArtifactVersionError."""
        number = self.latest(name) if version is None else check_version(version)
        doc = self.client.hget(self.keys.artifact(name), f"v:{number}") if number else None
        if doc is None:
            if version is not None and not self.client.exists(self.keys.artifact(name)):
                raise _unknown(name)
            raise UnknownArtifactVersionError(
                f"artifact {name!r} has no version yet" if version is None else
                f"artifact {name!r} has no version {version}")
        return number, decode(ArtifactVersionRecord, doc, f"{self.keys.artifact(name)}#v:{number}")

    def describe(self, name: str, version: int | None = None) -> ArtifactVersion:
        number, record = self.record(name, version)
        return _view(name, number, record)

    def get(self, name: str, version: int | None = None) -> bytes:
        """The content of `version` (the latest when None)."""
        _, record = self.record(name, version)
        return self.content(record)

    def content(self, record: ArtifactVersionRecord) -> bytes:
        ref = _ref(record)
        blob = backend_named(self.store, ref.backend).get(ref)
        return open_bytes(self.store, blob)

    def open(self, name: str, version: int | None = None) -> BinaryIO:
        """A reader of the content of `version` (the latest when None)."""
        _, record = self.record(name, version)
        return self.reader(record)

    def reader(self, record: ArtifactVersionRecord) -> BinaryIO:
        if record.blob == record.sha256:  # stored as it is: the backend's own reader
            ref = _ref(record)
            return backend_named(self.store, ref.backend).open(ref)
        return io.BytesIO(self.content(record))

    def chunks(self, record: ArtifactVersionRecord) -> Any:
        """The content in pieces of CHUNK bytes (the HTTP download)."""
        with self.reader(record) as reader:
            while piece := reader.read(CHUNK):
                yield piece

    def info(self, name: str) -> ArtifactInfo:
        return _info(name, self._fields(name))

    def listing(self) -> list[ArtifactInfo]:
        """Every artifact declared or written, by name."""
        pipe = self.client.pipeline(transaction=False)
        for bucket in range(self.keys.buckets):
            pipe.zrange(self.keys.artifact_listing(bucket), 0, -1)
        names = sorted({as_text(n) for part in pipe.execute() for n in part})
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.artifact(name))
        out = []
        for name, raw in zip(names, pipe.execute(), strict=True):
            if raw:
                try:
                    out.append(_info(name, {as_text(k): v for k, v in raw.items()}))
                except MarblesError:  # a record this version cannot read: not listed
                    continue
        return out


def _unknown(name: str) -> UnknownArtifactError:
    return UnknownArtifactError(f"unknown artifact {name!r}: nothing declared or wrote it")


def _sha256(content: bytes, sealed: bytes, ref: BlobRef) -> str:
    if sealed is content or sealed == content:
        return ref.sha256
    import hashlib

    return hashlib.sha256(content).hexdigest()


def _ref(record: ArtifactVersionRecord) -> BlobRef:
    return BlobRef(record.blob, record.blob_size, record.backend)


def _view(name: str, number: int, record: ArtifactVersionRecord) -> ArtifactVersion:
    return ArtifactVersion(name=name, version=number, size=record.size, sha256=record.sha256,
                           media_type=record.media_type,
                           meta=msgspec.json.decode(record.meta), run=record.run or None,
                           step=record.step or None, created_ms=record.created_ms)


def _info(name: str, fields: dict[str, bytes]) -> ArtifactInfo:
    versions = [int(f[2:]) for f in fields if f.startswith("v:")]
    latest = int(fields.get("latest", b"0"))
    updated = size = 0
    if latest and f"v:{latest}" in fields:
        record = decode(ArtifactVersionRecord, fields[f"v:{latest}"], f"art:{name}#v:{latest}")
        updated, size = record.created_ms, record.size
    return ArtifactInfo(name=name, latest=latest, versions=len(versions),
                        media_type=as_text(fields.get("media_type", b"")),
                        created_ms=int(fields.get("created_ms", b"0")), updated_ms=updated,
                        size=size)


def references_blob(store: Any, name: str, sha: str) -> bool:
    """The blob collection's question for holder ``art:<name>``: does a version of artifact
    `name` reference blob `sha`? (A count per blob kept by put/delete: one HEXISTS.)"""
    return bool(store.client.hexists(store.keys.artifact(name), f"s:{sha}"))


register_holder_kind(HOLDER_KIND, references_blob)
