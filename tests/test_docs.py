"""The documentation cannot drift: every fenced code block of the README, the CHANGELOG and
docs/ carries a marker saying how it is checked, and is checked that way. `run` blocks
execute in order, per page, in a fresh interpreter against a real redis-server, worker and
controller (the workers load examples/); `cli` blocks run each line as a `marbles-rq`
command against that stack, and it must exit 0; `typecheck` blocks pass mypy; `json` and
`yaml` blocks parse; a `skip` block says why, and the reason shows in pytest's summary. The
site itself builds with `mkdocs build --strict` (broken links, missing pages and bad API
references fail it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs_blocks import Block, blocks, run_blocks
from tests.procs import REPO_ROOT, Procs

DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
ALL = [b for page in PAGES for b in blocks(page)]
MARKS = {"run", "typecheck", "cli", "json", "yaml", "skip",
         "quickstart"}  # quickstart: the README's three client lines (tests/test_docs_client.py)
# docs/client.md's run blocks are executed by tests/test_docs_client.py, which also checks
# what each one prints.
RUN_ELSEWHERE = {DOCS / "client.md"}
PROCS_SOURCES = (REPO_ROOT / "examples",)
WELCOME = REPO_ROOT / "examples" / "welcome.py"


def test_every_block_carries_a_marker() -> None:
    assert len(ALL) > 40
    unmarked = [b.where for b in ALL if b.mark is None]
    assert not unmarked, ("code blocks without a `<!-- test: run|typecheck|cli|json|yaml|skip "
                          f"REASON -->` line above them: {unmarked}")
    unknown = [f"{b.where} ({b.mark})" for b in ALL if b.mark not in MARKS]
    assert not unknown, f"unknown markers: {unknown}"
    silent = [b.where for b in ALL if b.mark == "skip" and not b.reason]
    assert not silent, f"skipped blocks without a reason: {silent}"
    not_python = [b.where for b in ALL if b.mark in ("run", "typecheck") and b.lang != "python"]
    assert not not_python, f"run/typecheck blocks not fenced as python: {not_python}"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark in ("json", "yaml", "skip")],
                         ids=lambda b: b.where)
def test_data_blocks_parse_and_skips_say_why(block: Block) -> None:
    if block.mark == "skip":
        pytest.skip(f"{block.where}: {block.reason}")
    if block.mark == "json":
        json.loads(block.code)
    else:
        yaml.safe_load(block.code)


def test_typecheck_blocks_pass_mypy(tmp_path: Path) -> None:
    chosen = [b for b in ALL if b.mark == "typecheck"]
    assert chosen
    files = []
    for i, b in enumerate(chosen):
        # Each block is its own module; its name says where it came from.
        name = f"doc_{i}_{b.path.stem.replace('-', '_')}_{b.line}.py"
        (tmp_path / name).write_text(f"# {b.where}\n{b.code}")
        files.append(name)
    # The project's settings less `strict`: a reader's module, not marbles-rq's own code.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\npython_version = 3.11\nwarn_unused_ignores = True\n"
                      "[mypy-rq.*]\nignore_missing_imports = True\n"
                      # The otel extra is not in .venv (see ops/test): typed as Any here.
                      "[mypy-opentelemetry.*]\nignore_missing_imports = True\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config),
                           "--cache-dir", str(tmp_path / ".mypy_cache"), *files],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MYPYPATH": str(REPO_ROOT)})
    where = [f"{f}: {b.where}" for f, b in zip(files, chosen, strict=True)]
    assert done.returncode == 0, "\n".join([done.stdout, done.stderr, *where])


def test_the_first_workflow_shown_is_the_example_the_workers_load() -> None:
    shown = [b for b in ALL if b.mark == "typecheck" and "def welcome(" in b.code]
    assert {b.path.name for b in shown} == {"README.md", "get-started.md"}
    for b in shown:
        assert b.code == WELCOME.read_text(), f"{b.where} differs from examples/welcome.py"


def test_the_lua_page_lists_every_script() -> None:
    page = (DOCS / "internals" / "lua-scripts.md").read_text()
    missing = [f.stem for f in sorted((REPO_ROOT / "lua").glob("*.lua"))
               if f"| `{f.stem}` |" not in page]
    assert not missing, f"docs/internals/lua-scripts.md lacks a row for: {missing}"


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    page = (DOCS / "reference" / "configuration.md").read_text()
    read = set()
    for source in (REPO_ROOT / "marbles_rq").rglob("*.py"):
        read |= set(re.findall(r"[\"'](MARBLES_[A-Z0-9_]+|RQ_[A-Z0-9_]+)", source.read_text()))
    # RQ_WORKER_ID is set by RQ's worker for its own job, not by anyone configuring it.
    undocumented = sorted(name for name in read - {"RQ_WORKER_ID"}
                          if name not in page and not name.endswith("_"))
    assert not undocumented, f"docs/reference/configuration.md lacks: {undocumented}"


def _runnable_pages() -> list[Path]:
    return [page for page in PAGES if page not in RUN_ELSEWHERE
            and any(b.mark in ("run", "cli") for b in blocks(page))]


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_a_page_runs_as_written(page: Path, procs: Procs, tmp_path: Path) -> None:
    """The page's run and cli blocks, in order, as a reader at the repository root would run
    them next to `marbles-rq --source examples/ dev` (MARBLES_REDIS_URL set, no source)."""
    procs.controller()
    procs.worker(pool=2)
    chosen = [b for b in blocks(page) if b.mark in ("run", "cli")]
    run_blocks(procs, chosen, tmp_path)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a link to a missing page or anchor, a page missing from the
    nav, an API reference that does not resolve, or a CLI reference that fails to generate
    fails the build."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "marbles-rq enqueue" in cli_page and "marbles-rq web" in cli_page
