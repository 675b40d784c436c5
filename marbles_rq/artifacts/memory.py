"""Artifacts of runs in memory (a dry run, the test kit): the same decisions as the store's
(compare-and-set, numbers never reused, a put's token answered with its version, keep=N),
kept in the process with the runs, on their clock. Nothing is written anywhere."""

from __future__ import annotations

import io
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgspec

from ..payloads.blobs import sha256_hex
from .errors import (
    ArtifactConflict,
    UnknownArtifactVersionError,
    check_name,
    check_version,
)
from .records import ArtifactInfo, ArtifactVersion, ArtifactVersionRecord
from .store import ArtifactStore, Data, Put, _unknown, _view, content_of, media_type_of, meta_of


@dataclass
class _Artifact:
    created_ms: int
    media_type: str = ""
    n: int = 0
    versions: dict[int, tuple[ArtifactVersionRecord, bytes]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    @property
    def latest(self) -> int:
        return max(self.versions, default=0)


class MemoryArtifacts(ArtifactStore):
    """Artifacts kept with runs in memory; every method of the base that touches Redis is
    replaced (the base's get, open and describe work through `record` and `content`)."""

    def __init__(self, runs: Any) -> None:  # no client, keys nor scripts: nothing in Redis
        self.store = runs
        self._now = runs.clock.now_ms
        self._lock = threading.Lock()
        self._found: dict[str, _Artifact] = {}

    def _get(self, name: str) -> _Artifact:
        found = self._found.get(check_name(name))
        if found is None:
            raise _unknown(name)
        return found

    def put(self, name: str, data: Data, *, expect_version: int | None = None,
            media_type: str | None = None, meta: Any = None, declared_type: str | None = None,
            token: str = "", run: str = "", step: str = "", keep: int = 0) -> Put:
        check_name(name)
        if expect_version is not None:
            check_version(expect_version, "expect_version")
        content = content_of(data)
        token = token or f"req:{uuid.uuid4().hex}"
        sha = sha256_hex(content)
        record = ArtifactVersionRecord(
            version=1, size=len(content), sha256=sha, blob=sha, blob_size=len(content),
            backend="memory", media_type=media_type_of(data, media_type, declared_type),
            meta=msgspec.Raw(meta_of(meta)), run=run, step=step, token=token,
            created_ms=self._now())
        with self._lock:
            art = self._found.setdefault(name, _Artifact(self._now()))
            if token in art.tokens:
                return Put("exists", art.tokens[token], record)
            if expect_version is not None and expect_version != art.latest:
                raise ArtifactConflict(name, expect_version, art.latest)
            art.n += 1
            art.versions[art.n] = (record, content)
            art.tokens[token] = art.n
            for old in sorted(art.versions)[:-keep] if keep else ():
                art.tokens.pop(art.versions.pop(old)[0].token, None)
            return Put("ok", art.n, record)

    def delete(self, name: str, version: int | None = None) -> list[int]:
        with self._lock:
            art = self._get(name)
            if version is None:
                removed = sorted(art.versions)
            elif version in art.versions:
                removed = [version]
            else:
                raise UnknownArtifactVersionError(f"artifact {name!r} has no version {version}")
            for v in removed:
                art.tokens.pop(art.versions.pop(v)[0].token, None)
            return removed

    def declare(self, name: str, media_type: str | None = None) -> None:
        with self._lock:
            art = self._found.setdefault(check_name(name), _Artifact(self._now()))
            art.media_type = media_type or art.media_type

    def latest(self, name: str) -> int:
        return self._get(name).latest

    def record(self, name: str, version: int | None = None) -> tuple[int, ArtifactVersionRecord]:
        art = self._get(name)
        number = art.latest if version is None else check_version(version)
        if number not in art.versions:
            raise UnknownArtifactVersionError(
                f"artifact {name!r} has no version yet" if version is None else
                f"artifact {name!r} has no version {version}")
        return number, art.versions[number][0]

    def content(self, record: ArtifactVersionRecord) -> bytes:
        for art in self._found.values():
            for kept, content in art.versions.values():
                if kept is record:
                    return content
        raise UnknownArtifactVersionError("that version was deleted")

    def reader(self, record: ArtifactVersionRecord) -> BinaryIO:
        return io.BytesIO(self.content(record))

    def versions(self, name: str) -> list[ArtifactVersion]:
        art = self._get(name)
        return [_view(name, n, art.versions[n][0]) for n in sorted(art.versions)]

    def info(self, name: str) -> ArtifactInfo:
        art = self._get(name)
        latest = art.versions.get(art.latest)
        return ArtifactInfo(name=name, latest=art.latest, versions=len(art.versions),
                            media_type=art.media_type, created_ms=art.created_ms,
                            updated_ms=latest[0].created_ms if latest else 0,
                            size=latest[0].size if latest else 0)

    def listing(self) -> list[ArtifactInfo]:
        return [self.info(name) for name in sorted(self._found)]


def artifacts_for(runs: Any) -> ArtifactStore:
    """The artifacts of `runs`' deployment: the store's, or for runs in memory theirs (kept
    on the runs object, so every run of a test kit environment sees the same)."""
    if getattr(runs, "scripts", None) is not None:
        return ArtifactStore(runs)
    found = runs.__dict__.get("_artifacts")
    if found is None:
        found = runs.__dict__["_artifacts"] = MemoryArtifacts(runs)
    return found  # type: ignore[no-any-return]
