"""Artifacts: named, versioned outputs ("reports and versioned outputs"). Each put adds a
version; contents are immutable blobs stored once per sha256 (payloads/blobs.py), versions
are records in the artifact's hash (artifacts/store.py); a put in a run is recorded
(artifacts/in_run.py)."""

from .errors import (
    ArtifactConflict,
    ArtifactNameError,
    UnknownArtifactError,
    UnknownArtifactVersionError,
)
from .handle import Artifact, artifact
from .records import ArtifactInfo, ArtifactVersion

__all__ = ["Artifact", "ArtifactConflict", "ArtifactInfo", "ArtifactNameError",
           "ArtifactVersion", "UnknownArtifactError", "UnknownArtifactVersionError", "artifact"]
