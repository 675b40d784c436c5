"""`mr.artifact(name)`: a handle on a named, versioned output.

Declared at module level (``report = mr.artifact("weekly-report", media_type="text/html")``)
the worker makes it known as it starts, so `marbles-rq artifacts` and the dashboard list it
before any version exists; made inside a body (``mr.artifact(f"export-{day}")``) it is ad
hoc. In a run's body or step, `put` is recorded (artifacts/in_run.py); the reads read the
deployment's store. Outside a run use `client.artifact(name)` (the same methods, plus
`delete`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO, Protocol, TypeVar

from ..engine.context import awaitable_here, current, current_run
from ..errors import MarblesError
from .errors import UnknownArtifactError, check_name, check_version
from .records import ArtifactVersion
from .store import CHUNK, ArtifactStore, Data, _view

T = TypeVar("T")


class Caller(Protocol):
    """What AsyncArtifact needs of the AsyncClient: a sync call run in a worker thread."""

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

# Artifacts declared at module level by the source this process loaded: name -> handle.
DECLARED: dict[str, Artifact] = {}


class Artifact:
    """A named artifact in a run: `put` a new version, read versions."""

    def __init__(self, name: str, media_type: str | None = None, *, keep: int = 0) -> None:
        self.name = check_name(name)
        self.media_type = media_type
        self.keep = check_version(keep, "keep")

    def __repr__(self) -> str:
        return f"<artifact {self.name}>"

    def put(self, data: Data, *, expect_version: int | None = None,
            media_type: str | None = None, meta: Any = None) -> Any:
        """Store `data` (bytes, str as UTF-8, or a pathlib.Path's file) as the next version;
        its number. `expect_version`: write only if the latest version is this one (0: only
        if none exists yet), else ArtifactConflict naming both. Recorded: a replay, or a
        redelivered step, returns the version written the first time. In an async body,
        await it."""
        from . import in_run

        run = current("artifact.put")
        return awaitable_here(in_run.put(run, self.name, data, expect_version=expect_version,
                                         media_type=media_type, meta=meta,
                                         declared_type=self.media_type, keep=self.keep))

    def _store(self) -> ArtifactStore:
        run = current_run()
        if run is None:
            raise MarblesError(f"artifact {self.name!r}: outside a run, read it with "
                               f"client.artifact({self.name!r})")
        from .memory import artifacts_for

        return artifacts_for(run.runs)

    def get(self, version: int | None = None) -> bytes:
        """The content of `version` (the latest when None)."""
        return self._store().get(self.name, version)

    def open(self, version: int | None = None) -> BinaryIO:
        """A reader of the content of `version` (the latest when None)."""
        return self._store().open(self.name, version)

    def versions(self) -> list[ArtifactVersion]:
        return self._store().versions(self.name)

    def latest(self) -> int:
        """The latest version's number (0: none yet, also for an artifact nothing declared
        or wrote: a compare-and-set loop starts from it with ``expect_version=0``)."""
        return _latest_or_zero(self._store(), self.name)


def artifact(name: str, media_type: str | None = None, *, keep: int = 0) -> Artifact:
    """A handle on artifact `name`. At module level (outside any run) it is a declaration:
    listed before any version exists. `keep`: keep only the newest N versions (0: all)."""
    handle = Artifact(name, media_type, keep=keep)
    if current_run() is None:
        DECLARED[name] = handle
    return handle


def declare_all(store: Any) -> None:
    """Make the declared artifacts known to the deployment (a worker, as it starts)."""
    if not DECLARED:
        return
    artifacts = ArtifactStore(store)
    for handle in DECLARED.values():
        artifacts.declare(handle.name, handle.media_type)


class ClientArtifact:
    """`client.artifact(name)`: an artifact from outside a run."""

    def __init__(self, store: ArtifactStore, name: str, media_type: str | None = None) -> None:
        self._store = store
        self.name = check_name(name)
        self.media_type = media_type

    def __repr__(self) -> str:
        return f"<artifact {self.name}>"

    def put(self, data: Data, *, expect_version: int | None = None,
            media_type: str | None = None, meta: Any = None, keep: int = 0) -> int:
        """Store `data` as the next version; its number. ArtifactConflict when
        `expect_version` is given and is not the latest (0: none yet)."""
        declared = DECLARED.get(self.name)
        return self._store.put(self.name, data, expect_version=expect_version,
                               media_type=media_type or self.media_type,
                               declared_type=declared.media_type if declared else None,
                               meta=meta, keep=keep).version

    def get(self, version: int | None = None) -> bytes:
        return self._store.get(self.name, version)

    def open(self, version: int | None = None) -> BinaryIO:
        return self._store.open(self.name, version)

    def versions(self) -> list[ArtifactVersion]:
        return self._store.versions(self.name)

    def version(self, version: int | None = None) -> ArtifactVersion:
        """One version's description (the latest when None)."""
        return self._store.describe(self.name, version)

    def latest(self) -> int:
        """The latest version's number (0: none yet, or no such artifact)."""
        return _latest_or_zero(self._store, self.name)

    def delete(self, version: int | None = None) -> list[int]:
        """Remove `version`, or every version when None (numbers are never reused); the
        versions removed. Their blobs are collected by the controller."""
        return self._store.delete(self.name, version)


class AsyncArtifact:
    """`AsyncClient.artifact(name)`: ClientArtifact's methods as coroutines."""

    def __init__(self, client: Caller, handle: ClientArtifact) -> None:
        self._client, self._handle = client, handle
        self.name = handle.name

    def __repr__(self) -> str:
        return f"<artifact {self.name}>"

    async def put(self, data: Data, *, expect_version: int | None = None,
                  media_type: str | None = None, meta: Any = None, keep: int = 0) -> int:
        return await self._client._call(self._handle.put, data, expect_version=expect_version,
                                        media_type=media_type, meta=meta, keep=keep)

    async def get(self, version: int | None = None) -> bytes:
        return await self._client._call(self._handle.get, version)

    async def read(self, version: int | None = None) -> bytes:
        return await self.get(version)

    async def versions(self) -> list[ArtifactVersion]:
        return await self._client._call(self._handle.versions)

    async def version(self, version: int | None = None) -> ArtifactVersion:
        return await self._client._call(self._handle.version, version)

    async def latest(self) -> int:
        return await self._client._call(self._handle.latest)

    async def delete(self, version: int | None = None) -> list[int]:
        return await self._client._call(self._handle.delete, version)

    async def download(self, version: int | None = None
                       ) -> tuple[ArtifactVersion, AsyncIterator[bytes]]:
        """(the version, its content in pieces): the version is read first, so an unknown
        artifact or version raises here, before anything is sent."""
        store = self._handle._store
        number, record = await self._client._call(store.record, self.name, version)
        reader = await self._client._call(store.reader, record)

        async def pieces() -> AsyncIterator[bytes]:
            try:
                while piece := await self._client._call(reader.read, CHUNK):
                    yield piece
            finally:
                reader.close()

        return _view(self.name, number, record), pieces()

    async def chunks(self, version: int | None = None) -> AsyncIterator[bytes]:
        """The content in pieces (an async iterator of bytes)."""
        _, pieces = await self.download(version)
        async for piece in pieces:
            yield piece


def _latest_or_zero(store: Any, name: str) -> int:
    try:
        return int(store.latest(name))
    except UnknownArtifactError:
        return 0
