"""Start-up cost of the commands people type most: `marbles-rq --version` imports neither
redis nor any part of the store, and `marbles-rq status RUN` imports no command module but
its own, no rich when piped, no RQ and no asyncio client. (How long they take is measured
in bench/, not asserted here.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.procs import REPO_ROOT
from tests.redis_procs import free_port


def _modules_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """Every module a fresh interpreter has imported after running `code` (stdout piped)."""
    probe = (f"import json, sys\ntry:\n{textwrap.indent(code, '    ')}\nexcept SystemExit:\n"
             f"    pass\nprint(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, env=env)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _under(found: set[str], *roots: str) -> list[str]:
    return sorted(m for m in found if any(m == r or m.startswith(r + ".") for r in roots))


def test_version_imports_no_redis_and_no_store() -> None:
    found = _modules_after("from marbles_rq.cli import main\nmain(['--version'])")
    assert _under(found, "redis", "msgspec", "rich", "rq", "asyncio", "marbles_rq.store",
                  "marbles_rq.deployment", "marbles_rq.engine", "marbles_rq.client",
                  "marbles_rq.metrics") == []
    # Only the group itself of the CLI package.
    assert _under(found, "marbles_rq.cli") == ["marbles_rq.cli", "marbles_rq.cli.defaults",
                                               "marbles_rq.cli.exits"]


def test_help_imports_no_command_and_no_redis() -> None:
    found = _modules_after("from marbles_rq.cli import main\nmain(['--help'])")
    assert _under(found, "redis", "rich", "marbles_rq.store", "marbles_rq.deployment") == []
    assert _under(found, "marbles_rq.cli") == ["marbles_rq.cli", "marbles_rq.cli.defaults",
                                               "marbles_rq.cli.exits"]


def test_status_imports_only_what_it_uses() -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    found = _modules_after(f"from marbles_rq.cli import main\nmain(['status', 'r1', "
                           f"'--redis-url', {dead!r}])")
    assert "redis" in found and "marbles_rq.cli.runs" in found  # it did reach for Redis
    assert _under(found, "rich", "rq", "httpx", "starlette", "marbles_rq.client.aio",
                  "marbles_rq.transport", "marbles_rq.triggers", "marbles_rq.controller",
                  "marbles_rq.cli.completion", "marbles_rq.cli.waits",
                  "marbles_rq.cli.control", "click.shell_completion") == []


def test_the_groups_spelled_defaults_are_the_stores() -> None:
    from marbles_rq.cli import defaults as cli
    from marbles_rq.engine.authoring import SOURCE_ENV
    from marbles_rq.store.connection import DEFAULT_URL, URL_ENV
    from marbles_rq.store.keys import DEFAULT_BUCKETS, DEFAULT_PREFIX

    assert (cli.URL_ENV, cli.DEFAULT_URL, cli.DEFAULT_PREFIX, cli.DEFAULT_BUCKETS,
            cli.SOURCE_ENV) == (URL_ENV, DEFAULT_URL, DEFAULT_PREFIX, DEFAULT_BUCKETS,
                                SOURCE_ENV)
