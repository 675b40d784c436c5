"""Artifact commands: `artifacts [NAME] [--versions] [--json]`, `artifacts get NAME [--version
N] [-o FILE]`, `artifacts put NAME FILE [--expect-version N]`, `artifacts delete NAME
[--version N]` (marbles_rq/artifacts)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..client import Client
from ..deployment import Settings
from ..terminal import safe
from . import render

if TYPE_CHECKING:
    from ..artifacts.records import ArtifactInfo, ArtifactVersion


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


class _ArtifactsGroup(click.Group):
    """`artifacts NAME` shows one artifact: a first argument that is not a subcommand is the
    name for the hidden `show`."""

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            return "show", self.commands["show"], args
        return super().resolve_command(ctx, args)


@click.group(cls=_ArtifactsGroup, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the artifacts as JSON.")
@click.pass_context
def artifacts(ctx: click.Context, as_json: bool) -> None:
    """Artifacts (versioned outputs): each one's latest version, how many versions it keeps,
    its media type. `artifacts NAME` shows one (--versions lists them)."""
    if ctx.invoked_subcommand is not None:
        return
    found = Client(ctx.obj).artifacts()
    if as_json:
        click.echo(json.dumps([i.to_json() for i in found], indent=2))
        return
    if not found:
        click.echo("no artifacts (declare one with mr.artifact(...), or put one)")
        return
    rows = [[i.name, str(i.latest or "-"), str(i.versions), i.media_type or "-",
             _size(i.size) if i.latest else "-", render.when(i.updated_ms or None)]
            for i in found]
    if render.on_terminal():
        render.table(["ARTIFACT", "LATEST", "VERSIONS", "MEDIA TYPE", "SIZE", "UPDATED"], rows)
        return
    for row in rows:
        click.echo(safe("  ".join(row)))


def _version_line(v: ArtifactVersion) -> str:
    wrote = f"run {v.run} ({v.step})" if v.run else "outside a run"
    return (f"v{v.version}  {_size(v.size)}  {v.media_type}  sha256 {v.sha256[:16]}  "
            f"{v.created_at}  {wrote}")


@artifacts.command("show", hidden=True)
@click.argument("name")
@click.option("--versions", "all_versions", is_flag=True, help="List every version kept.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def show(settings: Settings, name: str, all_versions: bool, as_json: bool) -> None:
    """Show artifact NAME: its latest version (every version with --versions). Exit 2 when
    there is no such artifact."""
    client = Client(settings)
    info = _info(client, name)
    handle = client.artifact(name)
    versions = handle.versions() if all_versions else (
        [handle.version()] if info.latest else [])
    if as_json:
        doc: dict[str, Any] = info.to_json()
        doc["versions_kept" if all_versions else "latest_version"] = (
            [v.to_json() for v in versions] if all_versions
            else versions[0].to_json() if versions else None)
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(safe(f"artifact {info.name}: latest version {info.latest or 'none'}, "
                    f"{info.versions} kept" + (f", {info.media_type}" if info.media_type
                                               else "")))
    for v in versions:
        click.echo(safe("  " + _version_line(v)))


def _info(client: Client, name: str) -> ArtifactInfo:
    from ..artifacts.store import ArtifactStore

    return ArtifactStore(client.reader).info(name)


@artifacts.command("get")
@click.argument("name")
@click.option("--version", "version", type=click.IntRange(1), default=None,
              help="The version (default: the latest).")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the content to this file (default: stdout).")
@click.pass_obj
def get(settings: Settings, name: str, version: int | None, output: Path | None) -> None:
    """Write the content of artifact NAME (its latest version, or --version N) to stdout,
    byte for byte, or to -o FILE. Exit 2 when there is no such artifact or version."""
    handle = Client(settings).artifact(name)
    with handle.open(version) as reader:
        if output is None:
            shutil.copyfileobj(reader, sys.stdout.buffer)
            sys.stdout.buffer.flush()
            return
        partial = output.with_name(output.name + ".partial")
        with partial.open("wb") as out:
            shutil.copyfileobj(reader, out)
        partial.replace(output)  # a reader of FILE never sees half of it


@artifacts.command("put")
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path, allow_dash=True))
@click.option("--expect-version", type=click.IntRange(0), default=None,
              help="Write only if the latest version is N (0: only if none exists yet).")
@click.option("--media-type", default=None, help="The content's media type.")
@click.option("--meta", default=None, help="Metadata of the version, a JSON object.")
@click.option("--json", "as_json", is_flag=True, help="Print the new version as JSON.")
@click.pass_obj
def put(settings: Settings, name: str, file: Path, expect_version: int | None,
        media_type: str | None, meta: str | None, as_json: bool) -> None:
    """Store FILE (- for stdin) as the next version of artifact NAME and print its number.
    Exit 2 when --expect-version is not the latest version (nothing is written)."""
    from ..artifacts.errors import ArtifactNameError

    try:
        meta_value = json.loads(meta) if meta is not None else None
    except json.JSONDecodeError as exc:
        raise ArtifactNameError(f"--meta is not JSON: {exc}") from None
    data: bytes | Path = sys.stdin.buffer.read() if str(file) == "-" else file
    if isinstance(data, Path) and not data.is_file():
        raise ArtifactNameError(f"no file {str(data)!r}")
    handle = Client(settings).artifact(name)
    version = handle.put(data, expect_version=expect_version, media_type=media_type,
                         meta=meta_value)
    if as_json:
        click.echo(json.dumps(handle.version(version).to_json(), indent=2))
        return
    click.echo(safe(f"artifact {name} version {version}"))


@artifacts.command("delete")
@click.argument("name")
@click.option("--version", "version", type=click.IntRange(1), default=None,
              help="Remove only this version (default: every version).")
@click.pass_obj
def delete(settings: Settings, name: str, version: int | None) -> None:
    """Remove a version of artifact NAME, or every version; their blobs are collected by the
    controller once no version references them. Version numbers are never reused."""
    removed = Client(settings).artifact(name).delete(version)
    click.echo(safe(f"artifact {name}: removed " + (
        ", ".join(f"version {v}" for v in removed) if removed else "nothing (no version)")))
