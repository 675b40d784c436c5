"""The CLI on a terminal and piped, against real Redis, workers and controllers: tables
with headers, coloured statuses and local times on a pty; the plain, stable lines when
piped (unchanged: other tests and scripts parse them); `--json` identical either way; an
empty listing says so; `list` without Redis; `info` over two lanes; and a command that
waits on a run that parks on a question prints the command that answers it."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
from pathlib import Path

from marbles_rq.store.keys import Keyspace
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.redis_procs import free_port
from tests.test_cli_conventions import SOURCE, mrq

PROCS_SOURCES = (Path(SOURCE),)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LOCAL_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \((just now|\d+ (s|min|h|d) ago)\)"


def on_tty(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0,
           columns: int = 160) -> tuple[int, str, str]:
    """(exit code, stdout as the terminal got it, stderr) of `marbles-rq ARGS` whose stdout
    is a pseudo-terminal `columns` wide."""
    import fcntl
    import pty
    import struct
    import termios

    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MARBLES_", "_MARBLES")) and k not in ("NO_COLOR", "COLUMNS")}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([*_argv(), *args], stdout=slave, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                            env={**clean, "TERM": "xterm-256color", **(env or {})})
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the command closed its end
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.stderr is not None
    return code, out.decode().replace("\r\n", "\n"), proc.stderr.read().decode()


def _argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "marbles_rq"]


def plain(text: str) -> str:
    """What the terminal shows: colours off, the tables' padding at line ends dropped."""
    return "\n".join(line.rstrip() for line in ANSI.sub("", text).splitlines())


def test_runs_and_status_on_a_terminal_and_piped(redis_url: str) -> None:
    base = ("--redis-url", redis_url, "--source", SOURCE)
    for rid in ("tt-1", "tt-2"):
        assert mrq(*base, "enqueue", "greet", "--id", rid).returncode == 0
    # Piped: the stable line per run, as before.
    piped = mrq(*base, "runs")
    assert piped.returncode == 0
    assert re.fullmatch(r"(tt-[12] +greet +queued +a1 +r0 +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"
                        r"\.\d{3}Z\n){2}", piped.stdout), piped.stdout
    # A terminal: a table with headers, the status coloured, local time and how long ago.
    code, out, err = on_tty(*base, "runs")
    assert code == 0, err
    assert "\x1b[" in out  # coloured
    text = plain(out).splitlines()
    assert re.match(r"RUN +WORKFLOW +STATUS +ATTEMPT +CREATED +DURATION", text[0]), out
    row = next(line for line in text if line.startswith("tt-1"))
    assert re.search(rf"tt-1 +greet +queued +1 +{LOCAL_TIME} +-", row), row
    assert re.search(r"\x1b\[[0-9;]*34m\s*queued", out)  # queued in blue
    # --json is the same document either way.
    assert json.loads(on_tty(*base, "runs", "--json")[1]) == json.loads(
        mrq(*base, "runs", "--json").stdout)
    # An empty listing says so: on the terminal, on stderr when piped (stdout stays empty).
    code, out, _ = on_tty(*base, "runs", "--status", "failed")
    assert code == 0 and plain(out).strip() == "no runs match"
    none = mrq(*base, "runs", "--status", "failed")
    assert none.returncode == 0 and none.stdout == "" and none.stderr.strip() == "no runs match"
    # status: facts as a table on a terminal; the plain lines piped.
    code, out, err = on_tty(*base, "status", "tt-1")
    assert code == 0, err
    facts = plain(out)
    assert re.search(r"^status +queued$", facts, flags=re.MULTILINE), facts
    assert re.search(rf"^created +{LOCAL_TIME}$", facts, flags=re.MULTILINE), facts
    assert re.search(r"^duration +-$", facts, flags=re.MULTILINE), facts
    assert mrq(*base, "status", "tt-1").stdout.startswith(
        "run tt-1  greet  queued  attempt 1\n  queue default  lane 0  created ")
    # schedules: a table on a terminal, the plain line piped.
    web = ("--redis-url", redis_url, "--source", str(REPO_ROOT / "tests" / "web_workflows.py"))
    code, out, err = on_tty(*web, "schedules")
    assert code == 0, err
    assert re.search(r"SCHEDULE +STATUS +CADENCE +WORKFLOW +LAST START +LAST RUN +NEXT DUE",
                     plain(out)), out
    assert re.search(r"^web-hourly +\w+ +every 1h +web_hourly ", plain(out), flags=re.MULTILINE)
    assert mrq(*web, "schedules").stdout.startswith("web-hourly  ")


def test_a_long_run_id_on_a_narrow_terminal_is_shown_whole(redis_url: str) -> None:
    """rich cut a cell that did not fit to "customer-acme…": the id a user copies into the
    next command. It is folded over lines instead, every character kept."""
    base = ("--redis-url", redis_url, "--source", SOURCE)
    rid = "customer-acme-order-2026-12-02-a-rather-long-identifier-0001"
    assert mrq(*base, "enqueue", "greet", "--id", rid).returncode == 0
    code, out, err = on_tty(*base, "runs", columns=80)
    assert code == 0, err
    text = plain(out).splitlines()
    assert "\u2026" not in plain(out), out
    start = next(i for i, line in enumerate(text) if line.startswith("customer-"))
    pieces = [text[start].split()[0]]
    for line in text[start + 1:]:
        if not line or line[0] == " ":
            break
        pieces.append(line.split()[0])
    assert "".join(pieces) == rid, plain(out)


def test_list_without_redis_reads_like_prose() -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    done = mrq("--redis-url", dead, "--source", SOURCE, "list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "  greet: queue default, no timeout, kept 7 d, input: greeting: str = 'hello', " \
           "times: int = 1" in lines
    assert "  order: queue default, no timeout, kept 7 d, input: sku: str, qty: int = 1" in lines
    assert "  basket: queue default, no timeout, kept 7 d, input: lines: list[Order], " \
           "owner: Options | None = None" in lines
    # The schema is under --json, also without Redis.
    data = json.loads(mrq("--redis-url", dead, "--source", SOURCE, "list", "--json").stdout)
    order = next(w for w in data["workflows"] if w["name"] == "order")
    assert order["input_schema"]["$defs"]["Order"]["required"] == ["sku"]
    # Declared schedules show as declared, and say their state could not be read.
    web = str(REPO_ROOT / "tests" / "web_workflows.py")
    sched = mrq("--redis-url", dead, "--source", web, "list")
    assert sched.returncode == 0
    assert "  web-hourly: every 1h -> web_hourly" in sched.stdout.splitlines()
    assert "Redis not reachable" in sched.stderr
    assert json.loads(mrq("--redis-url", dead, "--source", web, "list", "--json").stdout)[
        "schedules"][0]["status"] is None


def test_a_waiting_command_prints_how_to_answer_a_question(procs: Procs) -> None:
    procs.start()
    waiting = subprocess.Popen([*procs.cli_argv("enqueue", "asker", "--id", "ask-1", "--input",
                                                '{"n": 2}', "--wait")],
                               cwd=REPO_ROOT, env=procs.env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert waiting.stderr is not None
        hint = _next_hint(waiting.stderr)
        assert hint == ("answer it: marbles-rq approve ask-1 ship   "
                        "(or: marbles-rq reject ask-1 ship)")
        # The printed command works as printed.
        approve = procs.cli(*hint.removeprefix("answer it: marbles-rq ").split("   ")[0]
                            .split())
        assert approve.returncode == 0, approve.stderr
        hint = _next_hint(waiting.stderr)
        assert hint == "answer it: marbles-rq answer ask-1 colour VALUE  (choices: 1=red, 2=blue)"
        assert procs.cli("answer", "ask-1", "colour", "2").returncode == 0
        procs.observer.wait_event("ask-1", lambda e: e.type == "answered" and
                                  e.data.get("key") == "colour", what="colour answered")
    finally:
        waiting.kill()
        waiting.wait()
    # Replayed later, an answered question gets no hint; a still open one does.
    replay = procs.cli("watch", "ask-1", "--no-follow")
    assert "answer it:" not in replay.stderr and "parked: waiting for an answer to ship" \
        in replay.stdout
    assert procs.cli("enqueue", "asker", "--id", "ask-2", "--input", '{"n": 3}').returncode == 0
    procs.observer.wait_status("ask-2", "waiting")
    shown = procs.cli("watch", "ask-2", "--no-follow")
    assert "answer it: marbles-rq approve ask-2 ship" in shown.stderr
    # feed and status on a terminal show the same command.
    env = {"MARBLES_REDIS_URL": procs.url}
    code, out, _ = on_tty("feed", env=env)
    assert code == 0 and re.search(r"ask-2 +ship .*marbles-rq approve ask-2 ship", plain(out))
    code, out, _ = on_tty("status", "ask-2", env=env)
    assert "answer it: marbles-rq approve ask-2 ship" in plain(out)


def _next_hint(stream: object, timeout: float = 60.0) -> str:
    """The next `answer it:` line a waiting command writes to stderr."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()  # type: ignore[attr-defined]
        if not line:
            raise AssertionError("the waiting command ended without a hint")
        if line.startswith("answer it:"):
            return str(line.rstrip("\n"))
    raise AssertionError("no hint in time")


def test_info_over_two_lanes(redis_server: object, tmp_path: Path) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    procs = Procs(url, tmp_path / "procs", sources=PROCS_SOURCES)
    procs.env.update(MARBLES_LANE_COUNT="2")
    keys = Keyspace("mrq", lanes=2)
    try:
        procs.worker()
        procs.controller()

        def both_led() -> dict[str, object] | None:
            data = json.loads(procs.cli("info", "--json").stdout)
            return data if all(lane["leader"] for lane in data["lanes"]) else None

        wait_for(both_led, timeout=60, what="a leader on both lanes")
        # A run parked on a queue no worker serves, in each lane; one that fails.
        ids = {}
        i = 0
        while len(ids) < 2:
            ids.setdefault(keys.lane_of(f"idle-{i}"), f"idle-{i}")
            i += 1
        for rid in ids.values():
            assert procs.cli("enqueue", "greet", "--id", rid, "--queue", "idle").returncode == 0
        assert procs.cli("enqueue", "crash", "--id", "boom-1", "--input",
                         '{"n": 1}').returncode == 0
        procs.observer.wait_final("boom-1")
        procs.cli("enqueue", "asker", "--id", "ask-9", "--input", '{"n": 1}')
        procs.observer.wait_status("ask-9", "waiting")
        data = json.loads(procs.cli("info", "--json").stdout)
        assert [lane["lane"] for lane in data["lanes"]] == [0, 1]
        for lane in data["lanes"]:
            assert {"queue": "idle", "queued": 1, "in_flight": 0} in lane["queues"], lane
            assert lane["leader"]["holder"].count(":") == 1
        assert data["workers"]["alive"] == 1
        assert data["runs"]["open_questions"] == 1 and data["runs"]["waiting_due"] == 0
        assert data["runs"]["failed_last_hour"] == 1
        piped = procs.cli("info")
        assert piped.stdout.splitlines()[-1] == ("runs: 0 running, 0 waiting for a due time, "
                                                 "1 open questions, 1 failed in the last hour")
        # Answered, it sleeps an hour: a wait with a due time, and no open question.
        assert procs.cli("approve", "ask-9", "ship").returncode == 0
        assert procs.cli("answer", "ask-9", "colour", "red").returncode == 0
        procs.observer.wait_event("ask-9", lambda e: e.type == "parked" and
                                  e.data.get("reason") == "timer", what="ask-9 asleep")
        runs = json.loads(procs.cli("info", "--json").stdout)["runs"]
        assert (runs["open_questions"], runs["waiting_due"]) == (0, 1)
        piped = procs.cli("info")
        assert piped.returncode == 0
        lines = piped.stdout.splitlines()
        assert lines[0] == "deployment mrq: 1024 buckets, 2 lanes"
        assert re.match(r"lane 0 \(buckets 0-511\): leader \S+:\d+ \(epoch \d+", lines[1])
        assert "  queue idle: 1 queued, 0 in flight" in lines
        assert lines[-1] == ("runs: 0 running, 1 waiting for a due time, 0 open questions, "
                             "1 failed in the last hour")
        code, out, _ = on_tty("info", env={"MARBLES_REDIS_URL": url, "MARBLES_LANE_COUNT": "2"})
        table = plain(out)
        assert code == 0 and re.search(r"LANE +LEADER +QUEUE +QUEUED +IN FLIGHT", table)
        assert re.search(r"RUNNING +WAITING \(DUE TIME\) +OPEN QUESTIONS +FAILED \(LAST HOUR\)",
                         table)
    finally:
        procs.stop_all()
        print(procs.report())
    # Redis down: one line and exit 3, as every command.
    down = mrq("info", "--redis-url", f"redis://127.0.0.1:{free_port()}")
    assert down.returncode == 3 and down.stderr.startswith("error: cannot reach Redis")


def test_list_says_each_workflows_flow_control_and_failure_policy() -> None:
    """A rate limit, an enqueue gate, a retry policy and a pausing failure policy show in
    `list` and `list --json` (examples/ declares one of each), without Redis."""
    dead = f"redis://127.0.0.1:{free_port()}"
    examples = str(REPO_ROOT / "examples")
    done = mrq("--redis-url", dead, "--source", examples, "list")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "notify_customer: queue default, no timeout, kept 7 d, rate limit 10/s per " \
           "customer," in text
    assert "sync_customer: queue default, no timeout, kept 7 d, debounce 2s (at most 30s) " \
           "per customer," in text
    assert "a step out of tries pauses the run" in text
    data = json.loads(mrq("--redis-url", dead, "--source", examples, "list", "--json").stdout)
    by_name = {w["name"]: w for w in data["workflows"]}
    assert by_name["notify_customer"]["rate_limit"] == {"rate": "10/s", "key": "customer"}
    assert by_name["send_digest"]["gate"]["kind"] == "throttle"
    assert by_name["rebuild_index"]["gate"]["mode"] == "skip"
    assert by_name["charge_order"]["on_exhausted"] == "pause"
    assert by_name["chain"]["rate_limit"] is None and by_name["chain"]["gate"] is None
