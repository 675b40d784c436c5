"""Smaller faults found by the probes of issue 16 (item 10), each against the real CLI and a
real redis-server: `watch` never shows a step ending before it started; a schedule without
input= on a workflow whose parameter has a Python default loads and runs with that default
(and a schedule whose input cannot be omitted fails naming its file:line); the shipped
examples load as one source, as the README's `dev`/`web` commands and compose.yaml load
them. (`rerun --id` of another run: tests/test_rerun_id.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import yaml

import marbles_rq as mr
from marbles_rq.engine.authoring import DefinitionError
from marbles_rq.store import open_store
from marbles_rq.triggers.schedules import ScheduleRegistry
from tests.procs import REPO_ROOT, Procs, _cli_argv, wait_for

SCHED_SOURCE = REPO_ROOT / "tests" / "sched_sources" / "default_param.py"


def _mrq(url: str, *args: str, source: str | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [*_cli_argv(), "--redis-url", url]
    if source is not None:
        argv += ["--source", source]
    return subprocess.run([*argv, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


# -- watch: a step never ends before it started ----------------------------------------------

def test_watch_never_shows_a_step_ending_before_it_started(redis_url: str) -> None:
    """A start written with its commit carries started_ms, the executor's reckoning of the
    server clock, which errs late: it can pass the time of the entries written with it."""
    done = _mrq(redis_url, "enqueue", "chain", "--input", '{"steps": 1}', "--id", "w-1",
                source=str(REPO_ROOT / "examples" / "chain.py"))
    assert done.returncode == 0, done.stderr
    client = redis.Redis.from_url(redis_url)
    out = open_store(redis_url, read_only=True).keys.output("w-1")
    base = int(client.xrevrange(out, count=1)[0][0].split(b"-")[0]) + 1000

    def add(ms: int, seq: int, type: str, data: dict[str, Any]) -> None:
        client.xadd(out, {"t": type, "a": 1, "d": json.dumps(data)}, id=f"{ms}-{seq}")

    add(base, 0, "attempt_started", {"worker": "w", "epoch": 1})
    # One commit_step call: the deferred start (started_ms 4 ms past the server's time of
    # the call) and the outcome, at the same server millisecond.
    add(base + 5, 0, "step_started", {"step": "chain.link#0", "attempt": 1,
                                      "started_ms": base + 9})
    add(base + 5, 1, "step_succeeded", {"step": "chain.link#0", "attempt": 1})
    # A start the watchdog wrote late: it carries when it really started, earlier.
    add(base + 60, 0, "step_started", {"step": "chain.link#1", "attempt": 1,
                                       "started_ms": base + 20})
    add(base + 70, 0, "step_succeeded", {"step": "chain.link#1", "attempt": 1})
    add(base + 71, 0, "final", {"status": "succeeded", "result": 1})

    text = _mrq(redis_url, "watch", "w-1", "--no-follow")
    assert text.returncode == 0, text.stderr
    times = {}
    for line in text.stdout.splitlines():
        match = re.match(r"(\d\d):(\d\d):(\d\d)\.(\d{3}) d\d+ step (\S+) (started|succeeded)",
                         line)
        if match:
            h, m, s, ms = (int(x) for x in match.groups()[:4])
            times[(match[5], match[6])] = ((h * 60 + m) * 60 + s) * 1000 + ms
    day = base % 86_400_000
    assert times == {("chain.link#0", "started"): day + 5,
                     ("chain.link#0", "succeeded"): day + 5,
                     ("chain.link#1", "started"): day + 20,
                     ("chain.link#1", "succeeded"): day + 70}, text.stdout
    # --json says the same times.
    lines = _mrq(redis_url, "watch", "w-1", "--no-follow", "--json").stdout.splitlines()
    starts = [json.loads(x) for x in lines if json.loads(x)["type"] == "step_started"]
    assert [s["at"][11:] for s in starts] == [
        _clock(base + 5) + "Z", _clock(base + 20) + "Z"]


def _clock(ms: int) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}"


# -- a schedule and the Python default of its workflow's input ---------------------------------

def test_a_schedule_without_input_takes_the_parameters_python_default() -> None:
    @mr.workflow("sf_defaulted_inline")
    def defaulted(ctx: mr.RunContext, n: int = 7) -> int:
        return n

    @mr.workflow("sf_required_inline")
    def required(ctx: mr.RunContext, n: int) -> int:
        return n

    reg = ScheduleRegistry()
    mr.schedule(every="1h", workflow=defaulted, registry=reg)
    assert [s.input for s in reg.schedules.values()] == [b"7"]
    with pytest.raises(DefinitionError) as err:
        mr.schedule(every="1h", workflow=required, registry=reg)
    message = str(err.value)
    assert re.search(r"schedule at \S*test_smaller_faults\.py:\d+: ", message), message
    assert "sf_required_inline" in message and "\n" not in message


def test_scheduled_runs_get_the_default_and_a_bad_schedule_names_its_line(
        procs: Procs, tmp_path: Path) -> None:
    bad = tmp_path / "bad_default.py"
    bad.write_text("import marbles_rq as mr\n\n\n@mr.schedule(every='1h')\n"
                   "@mr.workflow('sf_bad')\ndef sf_bad(ctx: mr.RunContext, n: int) -> int:\n"
                   "    return n\n")
    refused = _mrq(procs.url, "list", source=str(bad))
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert re.search(r"schedule at \S*bad_default\.py:4: .*sf_bad", lines[0]), lines

    procs.source = str(SCHED_SOURCE)
    procs.env["MARBLES_SOURCE"] = procs.source
    procs.start(workers=1)
    runs = procs.observer.runs

    def fired() -> Any:
        done = {v.record.id.split(":")[1]: v for v in runs.list_runs(name="sx_defaulted")
                if v.status == "succeeded"}
        return done if set(done) == {"defaulted", "by-name"} else None

    views = wait_for(fired, timeout=30, what="a run of each schedule of sx_defaulted to "
                     "succeed", context=procs.report)
    for view in views.values():  # declared on the workflow, and by name
        assert msgspec.json.decode(view.record.input) == 5
        assert view.result is not None and msgspec.json.decode(view.result) == 10


# -- the shipped examples load together -------------------------------------------------------

def _workflows(done: subprocess.CompletedProcess[str]) -> set[str]:
    assert done.returncode == 0, done.stderr
    return {w["name"] for w in json.loads(done.stdout)["workflows"]}


def test_the_examples_folder_loads_as_one_source(redis_url: str) -> None:
    # As the README's `marbles-rq --source examples/ dev` and `... web` load it.
    names = _workflows(_mrq(redis_url, "list", "--json", source="examples/"))
    assert {"chain", "etl", "release", "deploy_region"} <= names


def test_the_compose_source_loads(redis_url: str) -> None:
    """compose.yaml mounts a host folder at MARBLES_SOURCE for every marbles-rq service: that
    folder loads as one source, given as the services give it (the environment)."""
    services = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())["services"]
    checked = set()
    for name, service in services.items():
        source = service.get("environment", {}).get("MARBLES_SOURCE")
        if source is None:
            continue
        host = next(v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == source)
        env = {**os.environ, "MARBLES_SOURCE": str(REPO_ROOT / host)}
        assert "chain" in _workflows(_mrq(redis_url, "list", "--json", env=env)), name
        checked.add(name)
    assert checked == {"controller", "worker", "web"}
