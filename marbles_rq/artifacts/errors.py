"""The refusals of artifacts, each a MarblesError with a stable code (the HTTP API's status
comes from it, web/api_errors.py; the CLI exits 2 on each)."""

from __future__ import annotations

import re

from ..engine.authoring import InputError
from ..errors import MarblesError

MAX_NAME = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")


class ArtifactNameError(InputError):
    """A name outside the pattern, data that is not bytes/str/Path, bad meta."""

    code = "invalid_artifact"


class ArtifactConflict(MarblesError):
    """A put's `expect_version` is not the artifact's latest version: nothing was written."""

    code = "artifact_conflict"

    def __init__(self, name: str, expected: int, latest: int) -> None:
        super().__init__(f"artifact {name!r} is at version {latest}, not {expected} as "
                         f"expected; nothing was written (read it again and retry)")
        self.name, self.expected, self.latest = name, expected, latest


class UnknownArtifactError(MarblesError):
    """No artifact of that name was declared or written."""

    code = "unknown_artifact"


class UnknownArtifactVersionError(MarblesError):
    """The artifact exists but has no such version (never written, or deleted)."""

    code = "unknown_artifact_version"


def check_name(name: object) -> str:
    """1 to 128 characters: letters, digits and . _ : @ + - (no '/', so a name is one path
    segment of the HTTP API), starting with a letter or digit."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ArtifactNameError(
            f"invalid artifact name {name!r}: 1 to {MAX_NAME} characters, letters, digits "
            f"and . _ : @ + -, starting with a letter or digit")
    return name


def check_version(version: object, what: str = "version") -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ArtifactNameError(f"{what} must be a whole number >= 0, not {version!r}")
    return version
