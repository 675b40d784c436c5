"""Runs that wait, from the user's side: questions and approvals, reports, the feed, pause
and resume, and the CLI's contract for bad input. Real redis-server, real `marbles-rq
worker` / `controller` processes (tests/procs.py), real CLI processes; the workflows are in
tests/wait_workflows.py.

Each step of those workflows counts its executions in Redis (``wq:exec:<run id>``), so "no
earlier step re-ran" is a count of 1, whatever was killed or replayed in between. Tests wait
on events (status, output journal, the feed); where one checks that something does not
happen, it waits for a later event that could only come after it (noted there).

Only the tests that need a controller start one (question timeouts, a cancelled run's
timeout, recovery after kill -9): elsewhere every wake is enqueued by the command that
caused it, and no controller's safety net hides it if that enqueue is missing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from collections import Counter
from typing import Any

from marbles_rq.engine import ops
from marbles_rq.engine.waits import AlreadyAnsweredError, Answered, WaitStore
from marbles_rq.transport import dispatch
from marbles_rq.transport.dispatch import rq_connection
from tests.procs import (
    REPO_ROOT,
    Observer,
    Proc,
    Procs,
    _cli_argv,
    db_contents,
    descendants,
    pid_alive,
    stop_procs,
    wait_for,
)
from tests.wait_workflows import EXEC_PREFIX, GATE_PREFIX

WAIT_SOURCE = REPO_ROOT / "tests" / "wait_workflows.py"
PROCS_SOURCES = (WAIT_SOURCE,)
PREFIX = "mrq"
RQ_QUEUE = "rq:queue:mrq.default"

Done = subprocess.CompletedProcess


# --------------------------------------------------------------------------------------------
# helpers


def show(done: Done[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout!r}\nstderr: {done.stderr!r}"


def ok(done: Done[str]) -> str:
    assert done.returncode == 0, show(done)
    return done.stdout


def one_line_error(done: Done[str], code: int, *words: str) -> str:
    """The CLI's failure contract: exit `code`, exactly one line on stderr (naming `words`),
    nothing on stdout."""
    assert done.returncode == code, show(done)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), show(done)
    assert done.stdout == "", show(done)
    for word in words:
        assert word in lines[0], show(done)
    return lines[0]


def enqueue(procs: Procs, name: str, input: Any, run_id: str) -> None:
    """Record and enqueue a run, as `marbles-rq enqueue` does, from this process (the
    workflows are imported here too): the CLI's start-up costs a second a run."""
    done = ops.enqueue(procs.observer.runs, rq_connection(procs.url),
                       ops.RunRequest(name, json.dumps(input).encode(), run_id))
    assert done.created and done.dispatched, done


def status_json(procs: Procs, run_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ok(procs.cli("status", run_id, "--json")))
    return data


def feed_json(procs: Procs, *args: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ok(procs.cli("feed", "--json", *args)))
    return data


def feed_keys(procs: Procs) -> list[tuple[str, str]]:
    return [(q["run"], q["key"]) for q in feed_json(procs)["questions"]]


def questions(obs: Observer, run_id: str) -> list[dict[str, Any]]:
    """The run's questions as `status --json` lists them (read here, not through the CLI,
    where the CLI is not what a test is about)."""
    return [q.to_json() for q in WaitStore(obs.runs).questions(run_id)]


def executions(obs: Observer, run_id: str) -> dict[str, int]:
    """How often each counted step body ran for the run."""
    raw = obs.client.hgetall(EXEC_PREFIX + run_id)
    return {str(k): int(v) for k, v in raw.items()}


def open_gate(obs: Observer, run_id: str, *steps: int) -> None:
    for i in steps:
        obs.client.rpush(f"{GATE_PREFIX}{run_id}:{i}", "go")


def wait_parked(obs: Observer, run_id: str, reason: str, *, timeout: float = 30.0) -> Any:
    """Wait until the run is waiting for `reason`; its view."""
    def check() -> Any:
        view = obs.view(run_id)
        return view if view is not None and view.status == "waiting" and (
            view.wait_reason == reason) else None

    return wait_for(check, timeout=timeout, what=f"run {run_id} to wait ({reason})",
                    context=lambda: obs.dump(run_id))


def final(obs: Observer, run_id: str, status: str = "succeeded") -> dict[str, Any]:
    """Wait for the run's final event; assert its status; the run as `status --json` has
    it (read from the store)."""
    obs.wait_final(run_id)
    view = obs.view(run_id)
    assert view is not None and view.status == status, obs.dump(run_id)
    return view.to_json()


def event_types(obs: Observer, run_id: str) -> list[str]:
    return [e.type for e in obs.events(run_id)]


def kill9_groups(procs: list[Proc]) -> None:
    """SIGKILL the process group of each process and of each of its descendants (a horse
    has a group of its own), as an OOM killer or `kill -9 -<pgid>` would; reap them."""
    victims = [pid for p in procs for pid in (p.pid, *descendants(p.pid))]
    groups = set()
    for pid in victims:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    groups.discard(os.getpgrp())  # never our own
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            continue
    for p in procs:
        p.wait_exit(10)
    wait_for(lambda: not any(pid_alive(pid) for pid in victims), timeout=10,
             what=f"processes {victims} to die")


def server_ms(obs: Observer) -> int:
    sec, usec = obs.client.time()
    return int(sec) * 1000 + int(usec) // 1000


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def cli_at_once(procs: Procs, *commands: list[str], timeout: float = 60.0) -> list[Done[str]]:
    """Start every command at once (each a `marbles-rq` process); wait for all of them."""
    started = [(argv, subprocess.Popen(argv, cwd=REPO_ROOT, env=procs.env, text=True,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE))
               for argv in (procs.cli_argv(*c) for c in commands)]
    done = []
    try:
        for argv, proc in started:
            out, err = proc.communicate(timeout=timeout)
            procs.log_cli(argv, proc.returncode, out, err)
            done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    finally:
        for _, proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def snapshot(obs: Observer) -> dict[str, object]:
    """Every key of the database and its value (tests/procs.py db_contents)."""
    return db_contents(obs.runs.client)


# --------------------------------------------------------------------------------------------
# 1. a parked run survives kill -9 of everything, holds no worker, and never re-runs a step


def test_parked_question_survives_kill9_of_every_process_and_reruns_nothing(
        procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    enqueue(procs, "wq_approval", None, "survivor")
    view = wait_parked(obs, "survivor", "question")
    assert view.worker is None, obs.dump("survivor")
    lease_key = obs.runs.keys.run_leases(obs.runs.keys.bucket_of("survivor"))
    assert obs.client.zscore(lease_key, "survivor") is None, "a parked run holds a lease"
    assert executions(obs, "survivor") == {"prepare": 1}

    # It holds no worker: the only worker runs another run to the end meanwhile.
    enqueue(procs, "wq_steps", {"steps": 2}, "bystander")
    assert final(obs, "bystander")["result"] == [0, 1]
    assert obs.status("survivor") == "waiting"

    kill9_groups(procs.procs)
    assert obs.status("survivor") == "waiting", obs.dump("survivor")
    procs.start(workers=1)  # as a supervisor would

    out = ok(procs.cli("approve", "survivor", "ship", "--note", "after the crash"))
    assert "ship approved" in out and "run woken" in out, out
    data = final(obs, "survivor")
    assert data["result"] == {"prepared": "prepared",
                              "decision": {"approved": True, "note": "after the crash"}}
    assert executions(obs, "survivor") == {"prepare": 1, "finish": 1}, obs.dump("survivor")
    assert {s["name"]: s["attempts"] for s in data["steps"]} == {"wq_prepare": 1,
                                                                "wq_finish": 1}
    types = event_types(obs, "survivor")
    assert "redelivered" not in types, obs.dump("survivor")  # parking is not vanishing
    # One resumption after the answer; no redelivery (parking is not vanishing).
    assert (data["attempt"], data["resumptions"]) == (1, 1), obs.dump("survivor")
    assert types.count("attempt_started") == 2, obs.dump("survivor")
    assert types.count("final") == 1


# --------------------------------------------------------------------------------------------
# 2. concurrent answers: exactly one wins


def test_two_concurrent_answers_one_wins_the_other_is_told(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "wq_question", {"key": "colour"}, "race")
    wait_parked(obs, "race", "question")

    first, second = cli_at_once(procs, ["answer", "race", "colour", "amber"],
                                ["answer", "race", "colour", "teal"])
    outcomes = sorted([(first.returncode, "amber", first), (second.returncode, "teal", second)],
                      key=lambda o: o[0])
    (win_code, winner, win), (lose_code, _, lose) = outcomes
    assert (win_code, lose_code) == (0, 1), f"{show(first)}\n{show(second)}"
    assert "answered" in win.stdout, show(win)
    one_line_error(lose, 1, "already answered")

    data = final(obs, "race")
    assert data["result"]["answer"] == winner
    (question,) = status_json(procs, "race")["questions"]
    assert question["state"] == "answered" and question["answer"] == winner
    answered = [e for e in obs.events("race") if e.type == "answered"]
    assert [e.data["answer"] for e in answered] == [winner], obs.dump("race")
    assert executions(obs, "race") == {"prepare": 1, "finish": 1}


def test_many_threads_answering_at_once_record_one_answer(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "wq_question", {"key": "colour"}, "stampede")
    wait_parked(obs, "stampede", "question")

    waits = WaitStore(obs.runs)
    n = 8
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def answer(i: int) -> None:
        barrier.wait()
        try:
            results[i] = waits.answer("stampede", "colour", f"value-{i}", kind="question")
        except Exception as exc:  # anything but a refusal fails the asserts below
            results[i] = exc

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [i for i, r in enumerate(results) if isinstance(r, Answered)]
    assert len(winners) == 1, results
    assert all(isinstance(r, AlreadyAnsweredError) for i, r in enumerate(results)
               if i != winners[0]), results
    won = results[winners[0]]
    assert won.woken_attempt == 2, won
    # What the CLI does after a won answer: enqueue the woken delivery.
    dispatch.enqueue_delivery(rq_connection(obs.url), PREFIX, won.queue, "stampede", 2)

    data = final(obs, "stampede")
    assert data["result"]["answer"] == f"value-{winners[0]}"
    assert event_types(obs, "stampede").count("answered") == 1
    assert event_types(obs, "stampede").count("woken") == 1


# --------------------------------------------------------------------------------------------
# 3. approvals


def test_approve_with_a_note_and_reject(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    for run_id in ("ok-note", "no-note", "no-bare"):
        enqueue(procs, "wq_approval", None, run_id)
    for run_id in ("ok-note", "no-note", "no-bare"):
        wait_parked(obs, run_id, "question")

    assert "ship approved" in ok(procs.cli("approve", "ok-note", "ship", "--note", "LGTM"))
    assert "ship rejected" in ok(procs.cli("reject", "no-note", "ship", "--note",
                                           "tests fail"))
    assert "ship rejected" in ok(procs.cli("reject", "no-bare", "ship"))

    got = {run_id: final(obs, run_id)["result"]["decision"]
           for run_id in ("ok-note", "no-note", "no-bare")}
    assert got == {"ok-note": {"approved": True, "note": "LGTM"},
                   "no-note": {"approved": False, "note": "tests fail"},
                   "no-bare": {"approved": False, "note": None}}
    # A second decision on a decided approval is refused and changes nothing.
    one_line_error(procs.cli("approve", "no-bare", "ship"), 1, "already")
    (question,) = questions(obs, "no-bare")
    assert question["answer"] == {"approved": False, "note": None}


# --------------------------------------------------------------------------------------------
# 4. choices


def test_a_choice_is_answered_by_value_or_number_and_nothing_else(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    choices = ["red", "green", "blue"]
    for run_id in ("by-value", "by-number"):
        enqueue(procs, "wq_question", {"choices": choices}, run_id)
        wait_parked(obs, run_id, "question")

    for value in ("purple", "0", "4", "", "Blue", "3.0"):
        line = one_line_error(procs.cli("answer", "by-value", "ask:0", value), 2)
        assert "choices" in line, line
    # Nothing recorded: still open, in the feed, not woken.
    (question,) = [q for q in feed_json(procs)["questions"] if q["run"] == "by-value"]
    assert question["state"] == "open" and question["choices"] == choices
    assert obs.status("by-value") == "waiting"
    assert "answered" not in event_types(obs, "by-value")

    ok(procs.cli("answer", "by-value", "ask:0", "green"))
    ok(procs.cli("answer", "by-number", "ask:0", "3"))
    assert final(obs, "by-value")["result"]["answer"] == "green"
    assert final(obs, "by-number")["result"]["answer"] == "blue"  # the choice, not "3"
    assert [q["answer"] for q in questions(obs, "by-number")] == ["blue"]


# --------------------------------------------------------------------------------------------
# 5. bad input to answer/approve/reject/pause/resume; Redis down


def test_bad_input_is_one_line_exit_2_and_records_nothing(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "wq_question", {"choices": ["a", "b"], "key": "pick"}, "asks-q")
    enqueue(procs, "wq_approval", None, "asks-ok")
    wait_parked(obs, "asks-q", "question")
    wait_parked(obs, "asks-ok", "question")
    # With no worker or controller left, anything a command recorded or enqueued stays put.
    stop_procs(procs.procs)
    before = snapshot(obs)

    bad = {
        "unknown run": [["answer", "nosuchrun", "pick", "a"], ["approve", "nosuchrun", "ship"],
                        ["reject", "nosuchrun", "ship"], ["pause", "nosuchrun"],
                        ["resume", "nosuchrun"]],
        "invalid run id": [["answer", "x" * 129, "pick", "a"], ["reject", "../etc", "ship"],
                           ["pause", "bad id!"], ["resume", "a/b"]],
        "unknown key": [["answer", "asks-q", "nope", "a"], ["approve", "asks-ok", "nope"]],
        "wrong kind": [["approve", "asks-q", "pick"], ["reject", "asks-q", "pick"],
                       ["answer", "asks-ok", "ship", "yes"]],
    }
    says = {"unknown run": "no run with id", "invalid run id": "invalid run id",
            "unknown key": "has no question"}
    named = [(what, command) for what, group in bad.items() for command in group]
    for (what, command), done in zip(named, cli_at_once(procs, *(c for _, c in named)),
                                     strict=True):
        # The wrong kind names the right command: an approval is approved or rejected.
        word = says.get(what) or ("is an approval; approve or reject it"
                                  if command[0] == "answer" else "is a question; answer it")
        try:
            one_line_error(done, 2, word)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {command}: {exc}") from None
    assert snapshot(obs) == before, "a refused command wrote to Redis"
    assert obs.client.llen(RQ_QUEUE) == 0

    # Redis down (nothing listens on the port): one line, exit 3, for each command.
    down = f"redis://127.0.0.1:{closed_port()}/0"
    commands = [["answer", "asks-q", "pick", "a"], ["approve", "asks-ok", "ship"],
                ["reject", "asks-ok", "ship"], ["pause", "asks-q"], ["resume", "asks-q"],
                ["feed", "--json"]]
    started = [subprocess.Popen([*_cli_argv(), "--redis-url", down, *command], cwd=REPO_ROOT,
                                env=procs.env, text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for command in commands]
    for command, proc in zip(commands, started, strict=True):
        out, err = proc.communicate(timeout=60)
        try:
            one_line_error(subprocess.CompletedProcess(command, proc.returncode, out, err), 3,
                           "cannot reach Redis")
        except AssertionError as exc:
            raise AssertionError(f"{command} with Redis down: {exc}") from None
    assert snapshot(obs) == before


# --------------------------------------------------------------------------------------------
# 6. the feed and reports


def test_feed_lists_open_questions_oldest_first_and_reports(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    # One after the other, each parked before the next starts: asked in this order.
    enqueue(procs, "wq_approval", None, "feed-a")
    wait_parked(obs, "feed-a", "question")
    enqueue(procs, "wq_step_question", None, "feed-b")
    wait_parked(obs, "feed-b", "question")
    enqueue(procs, "wq_question", {"choices": ["x", "y"]}, "feed-c")
    wait_parked(obs, "feed-c", "question")
    enqueue(procs, "wq_reports", None, "feed-d")
    wait_parked(obs, "feed-d", "question")

    feed = feed_json(procs)
    questions = feed["questions"]
    assert [(q["run"], q["key"]) for q in questions] == [
        ("feed-a", "ship"), ("feed-b", "wq_review#0/ask:0"), ("feed-c", "ask:0"),
        ("feed-d", "publish")], feed
    asked = [q["asked_ms"] for q in questions]
    assert asked == sorted(asked), asked
    a, b, c, _ = questions
    assert (a["kind"], a["title"], a["body"], a["choices"], a["step"]) == (
        "approval", "Ship it?", "build 42", None, "wq_approval")
    assert (b["kind"], b["title"], b["choices"], b["step"]) == (
        "question", "Looks good?", ["yes", "no"], "wq_step_question.wq_review#0")
    assert (c["title"], c["body"], c["choices"], c["step"]) == (
        "Which colour?", "for the logo", ["x", "y"], "wq_question")
    for q in questions:
        assert q["state"] == "open" and isinstance(q["age_s"], int | float), q
        assert q["age_s"] >= 0, q
    assert [q["run"] for q in feed_json(procs, "--limit", "2")["questions"]] == [
        "feed-a", "feed-b"]

    reports = {(r["run"], r["key"]): (r["kind"], r["entry"]) for r in feed["reports"]}
    assert reports == {("feed-d", "milestone:0"): ("milestone", {"stage": "built"}),
                       ("feed-d", "result:0"): ("result", {"artifact": "app.tgz"})}, feed
    text = ok(procs.cli("feed"))
    assert "feed-b  wq_review#0/ask:0  answer" in text and "1=yes, 2=no" in text, text

    # An answered question leaves the feed; the others stay, in order.
    ok(procs.cli("answer", "feed-b", "wq_review#0/ask:0", "yes"))
    assert final(obs, "feed-b")["result"] == "yes"
    assert feed_keys(procs) == [("feed-a", "ship"), ("feed-c", "ask:0"),
                                ("feed-d", "publish")]

    # Reports are replay-safe: the woken body reports again, and nothing is added.
    ok(procs.cli("answer", "feed-d", "publish", "now"))
    data = final(obs, "feed-d")
    assert data["result"] == "now"
    assert executions(obs, "feed-d") == {"body": 2}, "the body did not replay"
    assert sorted(r["key"] for r in status_json(procs, "feed-d")["reports"]) == [
        "milestone:0", "result:0"]
    assert sorted(r["key"] for r in feed_json(procs)["reports"]) == ["milestone:0", "result:0"]
    assert event_types(obs, "feed-d").count("report") == 2, obs.dump("feed-d")


# --------------------------------------------------------------------------------------------
# 7. question timeouts


def test_a_timed_out_question_returns_its_default_or_fails_the_run(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    enqueue(procs, "wq_question", {"key": "k", "timeout_s": 1.0, "default": "grey",
                                  "has_default": True}, "to-default")
    enqueue(procs, "wq_question", {"key": "k", "timeout_s": 1.0}, "to-fail")

    data = final(obs, "to-default")
    assert data["result"] == {"prepared": "prepared", "answer": "grey"}
    assert executions(obs, "to-default") == {"prepare": 1, "finish": 1}
    data = final(obs, "to-fail", "failed")
    assert data["error"]["type"] == "AskTimeoutError", data["error"]
    assert "'k'" in data["error"]["message"], data["error"]

    for run_id, status in (("to-default", "succeeded"), ("to-fail", "failed")):
        (question,) = questions(obs, run_id)
        assert question["state"] == "timed_out", question
        one_line_error(procs.cli("answer", run_id, "k", "late"), 1)
        assert obs.status(run_id) == status
        (question,) = questions(obs, run_id)
        assert question["state"] == "timed_out" and question["answer"] is None
    assert feed_keys(procs) == []


def test_an_answer_after_the_timeout_is_refused_even_before_the_controller_acts(
        procs: Procs) -> None:
    procs.worker()  # no controller yet: nobody closes the question at its timeout
    obs = procs.observer
    enqueue(procs, "wq_question", {"key": "k", "timeout_s": 1.0, "default": "grey",
                                  "has_default": True}, "late")
    wait_parked(obs, "late", "question")
    (question,) = questions(obs, "late")
    deadline = question["timeout_at_ms"]
    assert deadline, question
    wait_for(lambda: server_ms(obs) > deadline, timeout=10,
             what="the server clock to pass the question's timeout")

    one_line_error(procs.cli("answer", "late", "k", "too late"), 1, "timed out")
    assert "answered" not in event_types(obs, "late"), obs.dump("late")
    procs.controller()
    assert final(obs, "late")["result"]["answer"] == "grey"


# --------------------------------------------------------------------------------------------
# 8. a cancelled waiting run never wakes


def test_a_cancelled_waiting_run_never_wakes(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    # A timeout long enough that a loaded machine cancels before it fires.
    enqueue(procs, "wq_question", {"key": "k", "timeout_s": 8.0}, "gone")
    wait_parked(obs, "gone", "question")
    assert ("gone", "k") in feed_keys(procs)

    assert "cancelled" in ok(procs.cli("cancel", "gone"))
    assert obs.status("gone") == "cancelled"
    assert ("gone", "k") not in feed_keys(procs)
    line = one_line_error(procs.cli("answer", "gone", "k", "hello"), 1)
    assert "cancelled" in line, line
    (question,) = questions(obs, "gone")
    assert question["state"] == "cancelled" and question["answer"] is None

    # Past its timeout: a later run's timeout as long, asked after this one's, has fired
    # (the controller wakes due runs oldest first), so this one's was due too.
    enqueue(procs, "wq_question", {"key": "k", "timeout_s": 8.0}, "witness")
    final(obs, "witness", "failed")
    assert obs.status("gone") == "cancelled"
    types = event_types(obs, "gone")
    assert types.count("final") == 1 and types[-1] == "final", obs.dump("gone")
    assert types.count("attempt_started") == 1 and "woken" not in types, obs.dump("gone")
    assert executions(obs, "gone") == {"prepare": 1}


# --------------------------------------------------------------------------------------------
# 9. pause and resume


def test_pause_parks_a_running_run_at_its_next_step_and_resume_finishes_it(
        procs: Procs) -> None:
    (worker,) = procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "wq_steps", {"steps": 3, "gate": True}, "pausing")
    obs.wait_step_started("pausing", "wq_steps.wq_work#0", attempt=1)

    out = ok(procs.cli("pause", "pausing"))
    assert "next step boundary" in out, out
    assert status_json(procs, "pausing")["pause_requested"] is True
    open_gate(obs, "pausing", 0)  # step 0 ends; the run parks before step 1
    wait_parked(obs, "pausing", "paused")
    data = status_json(procs, "pausing")
    assert data["waiting"]["reason"] == "paused" and data["worker"] is None, data
    assert executions(obs, "pausing") == {"work#0": 1}
    assert [s["status"] for s in data["steps"]] == ["succeeded"]

    kill9_groups([worker])
    procs.worker()
    open_gate(obs, "pausing", 1, 2)
    assert "already paused" in ok(procs.cli("pause", "pausing"))
    assert "resumed" in ok(procs.cli("resume", "pausing"))
    data = final(obs, "pausing")
    assert data["result"] == [0, 1, 2]
    assert executions(obs, "pausing") == {"work#0": 1, "work#1": 1, "work#2": 1}
    assert [s["attempts"] for s in data["steps"]] == [1, 1, 1]
    events = obs.events("pausing")
    parked = next(i for i, e in enumerate(events) if e.type == "parked")
    assert not [e for e in events[:parked] if e.type == "step_started"
                and e.data["step"] != "wq_steps.wq_work#0"], obs.dump("pausing")

    # A finished run: nothing to pause or resume.
    one_line_error(procs.cli("pause", "pausing"), 1, "already finished")
    one_line_error(procs.cli("resume", "pausing"), 1, "already finished")


def test_pause_of_a_queued_run_parks_it_when_a_worker_starts_it(procs: Procs) -> None:
    obs = procs.observer
    enqueue(procs, "wq_steps", {"steps": 2}, "queued")
    assert "will park" in ok(procs.cli("pause", "queued"))
    procs.start(workers=1, controller=False)

    wait_parked(obs, "queued", "paused")
    assert "step_started" not in event_types(obs, "queued"), obs.dump("queued")
    assert executions(obs, "queued") == {}
    waiting = status_json(procs, "queued")["waiting"]
    assert (waiting["reason"], waiting["for"]) == ("paused", {}) and waiting["since"], waiting

    # Not paused: resume refuses, exit 1, and the run stays as it is.
    enqueue(procs, "wq_approval", None, "not-paused")
    wait_parked(obs, "not-paused", "question")
    one_line_error(procs.cli("resume", "not-paused"), 1, "not paused")
    view = obs.view("not-paused")
    assert view is not None and (view.status, view.wait_reason, view.attempt) == (
        "waiting", "question", 1), obs.dump("not-paused")

    ok(procs.cli("resume", "queued"))
    assert final(obs, "queued")["result"] == [0, 1]
    assert executions(obs, "queued") == {"work#0": 1, "work#1": 1}


def test_a_paused_run_is_not_woken_by_an_answer_only_by_resume(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "wq_approval", None, "held")
    wait_parked(obs, "held", "question")

    # status --json says what it waits for: the question.
    waiting = status_json(procs, "held")["waiting"]
    assert waiting["reason"] == "question" and waiting["for"] == {"questions": ["ship"]}
    assert waiting["since"], waiting

    assert "paused" in ok(procs.cli("pause", "held"))
    waiting = status_json(procs, "held")["waiting"]
    assert waiting["reason"] == "paused", waiting

    out = ok(procs.cli("approve", "held", "ship", "--note", "while paused"))
    assert "when it next replays" in out, out
    (question,) = questions(obs, "held")
    assert question["state"] == "answered"  # recorded...
    view = obs.view("held")  # ...but the run stays paused
    assert view is not None and (view.status, view.wait_reason, view.attempt) == (
        "waiting", "paused", 1), obs.dump("held")
    assert "woken" not in event_types(obs, "held"), obs.dump("held")

    # The worker is free and idle: a run enqueued now finishes, and "held" is still parked
    # after it (had the answer queued a delivery, it was ahead of this one).
    enqueue(procs, "wq_steps", {"steps": 1}, "after")
    final(obs, "after")
    view = obs.view("held")
    assert view is not None and (view.status, view.wait_reason, view.attempt) == (
        "waiting", "paused", 1), obs.dump("held")

    assert "resumed" in ok(procs.cli("resume", "held"))
    data = final(obs, "held")
    assert data["result"]["decision"] == {"approved": True, "note": "while paused"}
    assert executions(obs, "held") == {"prepare": 1, "finish": 1}

    # watch --no-follow tells the story: parked, answered, woken, finished.
    watch = procs.cli("watch", "held", "--no-follow")
    assert watch.returncode == 0, show(watch)
    lines = watch.stdout.splitlines()
    kinds = Counter(word for line in lines for word in ("parked:", "woken (", "answered:",
                                                         "pause requested", "resumed")
                    if word in line)
    assert kinds == {"parked:": 1, "woken (": 1, "answered:": 1, "pause requested": 1,
                     "resumed": 1}, watch.stdout
    assert any("parked: waiting for an answer to ship" in line for line in lines), lines
    assert any("woken (resume); delivered again as delivery 2" in line for line in lines), lines


# --------------------------------------------------------------------------------------------
# 10. status and watch while waiting


def test_status_and_watch_show_a_parked_and_a_woken_run(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "wq_question", {"key": "colour", "choices": ["red", "blue"]}, "shown")
    wait_parked(obs, "shown", "question")

    data = status_json(procs, "shown")
    assert data["status"] == "waiting" and data["worker"] is None
    assert data["waiting"]["reason"] == "question"
    assert data["waiting"]["for"] == {"questions": ["colour"]}
    assert [(q["key"], q["state"], q["choices"]) for q in data["questions"]] == [
        ("colour", "open", ["red", "blue"])]
    text = ok(procs.cli("status", "shown"))
    assert "waiting: question; questions colour" in text, text

    watch = procs.cli("watch", "shown", "--no-follow")
    assert watch.returncode == 1, show(watch)  # not succeeded (yet)
    assert "parked: waiting for an answer to colour" in watch.stdout, watch.stdout
    assert "woken" not in watch.stdout

    ok(procs.cli("answer", "shown", "colour", "2"))
    final(obs, "shown")
    data = status_json(procs, "shown")
    assert data["waiting"] is None and data["result"]["answer"] == "blue"
    watch = procs.cli("watch", "shown", "--no-follow")
    assert watch.returncode == 0, show(watch)
    lines = watch.stdout.splitlines()
    parked = [i for i, line in enumerate(lines) if "parked:" in line]
    woken = [i for i, line in enumerate(lines) if "woken (answer); delivered again as delivery 2"
             in line]
    answered = [i for i, line in enumerate(lines) if 'question colour answered: "blue"' in line]
    assert len(parked) == len(woken) == len(answered) == 1, watch.stdout
    assert parked[0] < answered[0] < woken[0], watch.stdout

