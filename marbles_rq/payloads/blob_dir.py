"""The directory blob backend, MARBLES_BLOB_STORE=file:///shared/path: one immutable file
per blob, ``<root>/<sha[:2]>/<sha[2:4]>/<sha>`` (sharded so no directory grows past a few
thousand entries). A write is atomic: a temporary file in the same directory, fsync, rename
over the final name, fsync of the directory; a reader never sees half a blob, and two
writers of the same bytes write the same file. Holders and the index are in Redis."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .blob_base import BlobMissing, BlobRef, HeldBlobs

if TYPE_CHECKING:
    from ..store import RedisStore


class DirBlobs(HeldBlobs):
    name = "file"

    def __init__(self, store: RedisStore, root: str, url: str) -> None:
        super().__init__(store)
        self.root = Path(root)
        self.url = url

    def path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha[2:4] / sha

    def _write(self, sha: str, data: bytes) -> None:
        final = self.path(sha)
        final.parent.mkdir(parents=True, exist_ok=True)
        temp = final.parent / f".{sha}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        _fsync_dir(final.parent)  # the rename itself survives a crash

    def _read(self, sha: str) -> bytes | None:
        try:
            return self.path(sha).read_bytes()
        except FileNotFoundError:
            return None

    def _exists(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def open(self, ref: BlobRef) -> BinaryIO:
        if self._in_redis(ref):
            return super().open(ref)  # a small blob, kept in Redis
        try:
            return open(self.path(ref.sha256), "rb")
        except FileNotFoundError:
            raise BlobMissing(f"blob {ref.sha256} is missing from the file blob store "
                              f"{self.url}") from None

    def delete_object(self, sha: str) -> None:
        self.path(sha).unlink(missing_ok=True)

    def probe(self) -> str:
        probe = self.root / f".probe.{uuid.uuid4().hex[:8]}"
        self.root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"marbles-rq")
        try:
            if probe.read_bytes() != b"marbles-rq":
                raise OSError(f"{probe} did not read back what was written")
        finally:
            probe.unlink(missing_ok=True)
        return f"file blob store {self.url} (writable)"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
