"""What an artifact's version is: the record stored in its hash, and the view readers get."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..store.records import Record


class ArtifactVersionRecord(Record, tag="artifact_version", kw_only=True, frozen=True):
    """One version of an artifact, stored as field ``v:<n>`` of its hash (the number is the
    field's name). `sha256`/`size` are the content's; `blob`/`blob_size` the blob's as stored
    (sealed: they differ when the codec compresses or encrypts)."""

    size: int
    sha256: str
    blob: str
    blob_size: int = 0
    backend: str = "redis"
    media_type: str = ""
    meta: msgspec.Raw = msgspec.Raw(b"null")
    run: str = ""  # the run that wrote it ("" from outside a run)
    step: str = ""  # the frame (step path) the put was made in
    token: str = ""  # the put's idempotency token (removed with the version)
    created_ms: int = 0


class ArtifactVersion(msgspec.Struct, frozen=True):
    """One version as `versions()` lists it."""

    name: str
    version: int
    size: int
    sha256: str
    media_type: str = ""
    meta: Any = None
    run: str | None = None
    step: str | None = None
    created_ms: int = 0

    @property
    def created_at(self) -> str:
        ms = self.created_ms
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "size": self.size,
                "sha256": self.sha256, "media_type": self.media_type, "meta": self.meta,
                "run": self.run, "step": self.step, "created_at": self.created_at}


class ArtifactInfo(msgspec.Struct, frozen=True):
    """One artifact as the listing shows it."""

    name: str
    latest: int  # 0: no version (declared only, or every version deleted)
    versions: int
    media_type: str = ""
    created_ms: int = 0
    updated_ms: int = 0  # the latest version's creation (0: none)
    size: int = 0  # the latest version's

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "latest": self.latest, "versions": self.versions,
                "media_type": self.media_type, "created_ms": self.created_ms,
                "updated_ms": self.updated_ms or None, "size": self.size}
