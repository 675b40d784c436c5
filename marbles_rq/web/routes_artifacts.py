"""The dashboard's artifacts: the list (/artifacts), one artifact's versions
(/artifacts/<name>), and a version's download (/artifacts/<name>/versions/<n>/download,
streamed as it is read). Read-only: reads need what any page needs."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ..artifacts.errors import ArtifactNameError, UnknownArtifactError, UnknownArtifactVersionError
from ..artifacts.store import ArtifactStore
from .endpoint import Web, readable

REFUSED = (ArtifactNameError, UnknownArtifactError, UnknownArtifactVersionError)


def routes(web: Web) -> list[BaseRoute]:
    def store() -> ArtifactStore:
        return ArtifactStore(web.settings.runs(read_only=True))

    @readable(web)
    def artifacts_page(request: Request) -> Response:
        return web.render(request, "artifacts.html", title="Artifacts",
                          artifacts=store().listing())

    @readable(web)
    def artifact_page(request: Request) -> Response:
        name = request.path_params["artifact"]
        try:
            found = store()
            info = found.info(name)
            versions = list(reversed(found.versions(name)))  # newest first
        except REFUSED as exc:
            return web.render(request, "error.html", 404, message=str(exc), next="/artifacts")
        return web.render(request, "artifact.html", title=f"Artifact {name}", info=info,
                          versions=versions)

    @readable(web)
    def download(request: Request) -> Response:
        name, raw = request.path_params["artifact"], request.path_params["version"]
        try:
            if not raw.isdigit() or len(raw) > 15:
                raise UnknownArtifactVersionError(f"artifact {name!r} has no version {raw!r}")
            found = store()
            number, record = found.record(name, int(raw))
        except REFUSED as exc:
            return web.render(request, "error.html", 404, message=str(exc), next="/artifacts")
        return StreamingResponse(
            found.chunks(record), media_type=record.media_type or "application/octet-stream",
            headers={"Content-Length": str(record.size), "ETag": f'"{record.sha256}"',
                     "Content-Disposition": f'attachment; filename="{name}-v{number}"'})

    return [
        Route("/artifacts", artifacts_page),
        Route("/artifacts/{artifact}", artifact_page),
        Route("/artifacts/{artifact}/versions/{version}/download", download),
    ]
