"""Start-up cost: `import marbles_rq` and a `marbles-rq` command import only what they use
(the tests start hundreds of processes, each paying its imports), while every public name
and every command stays exactly where it was."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import click

import marbles_rq as mr
from tests.procs import REPO_ROOT
from tests.redis_procs import free_port

# Heavy or narrow modules that a process must not pay for unless it uses them.
NARROW = ("httpx", "rich", "rq", "starlette", "marbles_rq.engine.execute",
          "marbles_rq.store.memory", "marbles_rq.triggers.events", "marbles_rq.triggers.monitors",
          "marbles_rq.triggers.schedules", "marbles_rq.cli.web", "marbles_rq.cli.dev",
          "opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http")


def _imported_after(code: str) -> list[str]:
    """The NARROW modules a fresh interpreter has imported after running `code`."""
    probe = (f"import json, sys\ntry:\n{textwrap.indent(code, '    ')}\nexcept SystemExit:\n"
             f"    pass\nprint(json.dumps(sorted(m for m in {NARROW!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    found: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_importing_the_package_imports_none_of_its_narrow_parts() -> None:
    assert _imported_after("import marbles_rq") == []
    assert _imported_after("import marbles_rq as mr\nmr.workflow, mr.step, mr.MarblesError") \
        == []
    # A name is imported with its module, on first use; httpx waits for an HTTP monitor.
    found = _imported_after("from marbles_rq import monitor")
    assert "marbles_rq.triggers.monitors" in found and "httpx" not in found
    found = _imported_after("import marbles_rq as mr\nmr.monitor('https://x.example', "
                            "allow_hosts=['x.example'])")
    assert "httpx" in found


def test_the_test_kits_pytest_plugin_imports_nothing_narrow() -> None:
    # pytest loads it (the pytest11 entry point) in every session of every project that
    # installs marbles-rq: the kit's engine waits for a test that asks for `mr_env`.
    assert _imported_after("import marbles_rq.testing.pytest_plugin") == []
    assert _imported_after("from marbles_rq.testing import Environment\nEnvironment()") \
        != []


def test_every_public_name_is_its_modules_object() -> None:
    homes = {
        "marbles_rq.client": ["AsyncClient", "Client", "ResultTimeoutError",
                              "RunCancelledError", "RunFailedError", "RunHandle", "RunStatus",
                              "StartRequest", "connect", "connect_async"],
        "marbles_rq.engine.api": ["ask", "gather", "now", "parallel", "publish", "report",
                                  "compensate", "signals", "sleep", "sleep_until", "start_child",
                                  "wait_for_event", "wait_for_signal"],
        "marbles_rq.engine.signals": ["SignalTimeoutError"],
        "marbles_rq.engine.undo_refs": ["CompensationError"],
        "marbles_rq.engine.authoring": ["step", "workflow"],
        "marbles_rq.engine.execute": ["RunContext", "current"],
        "marbles_rq.engine.async_run": ["AsyncRunContext"],
        "marbles_rq.engine.patches": ["deprecate_patch", "patched"],
        "marbles_rq.engine.retry_policy": ["NonRetryable", "Retry"],
        "marbles_rq.flow.rate_limits": ["rate_limit"],
        "marbles_rq.flow.rate_specs": ["Rate"],
        "marbles_rq.flow.locks": ["LockError", "lock"],
        "marbles_rq.errors": ["MarblesError", "RunSettledError"],
        "marbles_rq.store": ["RedisStore", "Store", "open_store"],
        "marbles_rq.store.keys": ["Keyspace"],
        "marbles_rq.store.memory": ["MemoryStore"],
        "marbles_rq.triggers.events": ["Event", "on_event", "send_event"],
        "marbles_rq.triggers.batches": ["Batch"],
        "marbles_rq.triggers.monitors": ["FileChange", "HttpChange", "Launch", "monitor"],
        "marbles_rq.triggers.schedules": ["schedule"],
        "marbles_rq.sessions": ["AsyncSession", "InvalidMessageError", "Session",
                                "SessionCorruptError", "SessionNotFoundError"],
        "marbles_rq.sessions.body": ["session"],
    }
    assert sorted(n for names in homes.values() for n in names) == sorted(mr.__all__)
    for module, names in homes.items():
        for name in names:
            assert getattr(mr, name) is getattr(importlib.import_module(module), name), name
    from marbles_rq import schedule, workflow

    assert (workflow, schedule) == (mr.workflow, mr.schedule)
    assert set(mr.__all__) <= set(dir(mr)) and "__version__" in dir(mr)
    try:
        mr.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert str(exc) == "module 'marbles_rq' has no attribute 'no_such_name'"
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_a_command_imports_its_own_module_only() -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    run = "from marbles_rq.cli import main\nmain([{}])"
    status = run.format(f"'status', 'r1', '--redis-url', {dead!r}")
    assert _imported_after(status) == []
    worker_help = run.format("'worker', '--help'")
    assert _imported_after(worker_help) == []
    # The full listing reads the static section table: no command module is loaded.
    assert _imported_after(run.format("'--help'")) == []


def test_the_lazy_commands_are_the_registered_ones_each_prepared_once() -> None:
    from marbles_rq.cli import _COMMANDS, _register, cli

    _register()
    _register()  # loading twice changes nothing
    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(_COMMANDS)
    for name in _COMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None and command.name == name
        flags = [opt for p in command.params for opt in getattr(p, "opts", [])]
        assert flags.count("--redis-url") == 1 and flags.count("--debug") == 1, name
