"""The fenced code blocks of the README and the docs, and running them the way a reader
would: tests/test_docs.py (every block of every page) and tests/test_docs_client.py (the
client page's blocks and what they print)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.procs import REPO_ROOT, Procs

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARK = re.compile(r"^\s*<!-- test: (\w+)\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the block's first code line
    lang: str
    mark: str | None  # the `<!-- test: WORD ... -->` right above the fence
    reason: str  # what follows the word in the marker (a skip's reason)
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, indented ones (inside a list) too."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent = len(opened.group(1))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(above)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        found.append(Block(path, i + 2, opened.group(2), mark.group(1) if mark else None,
                           mark.group(2) if mark else "", code))
        i = end + 1
    return found


def marbles_rq_argv() -> list[str]:
    script = Path(sys.executable).parent / "marbles-rq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "marbles_rq"]


def run_blocks(procs: Procs, chosen: list[Block], tmp: Path,
               env_extra: dict[str, str] | None = None) -> str:
    """Execute the blocks in order in a fresh interpreter: python blocks in one namespace,
    each line of a cli block as a `marbles-rq` command that must exit 0. Tracebacks and
    failures name the document and line."""
    runner = tmp / "run_blocks.py"
    steps = [(str(b.path.relative_to(REPO_ROOT)), b.line, b.mark, b.code) for b in chosen]
    runner.write_text(
        "import shlex, subprocess, sys\n"
        f"MARBLES_RQ = {marbles_rq_argv()!r}\n"
        "namespace = {'__name__': '__main__'}\n"
        f"for path, line, mark, code in {steps!r}:\n"
        "    print(f'=== {path}:{line}', flush=True)\n"
        "    if mark != 'cli':\n"
        "        exec(compile('\\n' * (line - 1) + code, path, 'exec'), namespace)\n"
        "        continue\n"
        "    for n, text in enumerate(code.splitlines()):\n"
        "        words = shlex.split(text, comments=True)\n"
        "        if not words:\n"
        "            continue\n"
        "        assert words[0] == 'marbles-rq', f'{path}:{line + n}: not a marbles-rq command'\n"
        "        done = subprocess.run(MARBLES_RQ + words[1:], capture_output=True, text=True,\n"
        "                              timeout=120)\n"
        "        print(done.stdout, end='', flush=True)\n"
        "        if done.returncode != 0:\n"
        "            sys.exit(f'{path}:{line + n}: {text!r} exited {done.returncode}: '\n"
        "                     f'{done.stderr.strip()}')\n")
    env = {k: v for k, v in procs.env.items() if k != "MARBLES_SOURCE"}
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, str(runner)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


def printed(out: str, block: Block) -> list[str]:
    """What one block printed."""
    header = f"=== {block.where}\n"
    tail = out.split(header, 1)[1]
    return tail.split("\n=== ", 1)[0].strip("\n").splitlines()
