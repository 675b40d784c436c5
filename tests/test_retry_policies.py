"""Retry policies and pause on exhaustion, from the user's side, on real processes: a real
redis-server, real `marbles-rq worker` / `controller` / `web` processes (tests/procs.py),
real CLI processes and a real HTTP receiver for the pause notifications. The workflows are
in tests/retry_workflows.py; each counted step counts its tries in Redis, so "no try lost
or counted twice" is the ledger's attempt count equal to that count, whatever was killed.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import DefinitionError
from marbles_rq.engine.failed_steps import NotFailedStepError
from marbles_rq.engine.input_patch import PatchRefusedError, check_patch, merge_patch
from marbles_rq.engine.retry_policy import RetryPolicyError
from marbles_rq.payloads.fields import open_record
from marbles_rq.store.records import StepRecord
from tests.procs import REPO_ROOT, Observer, Procs, wait_for
from tests.retry_workflows import EXEC_PREFIX, GATE_PREFIX, Card
from tests.test_waiting_questions import enqueue, kill9_groups, ok, one_line_error, show
from tests.web_stack import start_web

PROCS_SOURCES = (REPO_ROOT / "tests" / "retry_workflows.py",)
API_TOKEN = "api-token-0123456789abcdef-xyz"
SECRET = "notify-secret-0123456789"


def tries(obs: Observer, run_id: str, name: str) -> int:
    return int(obs.client.hget(EXEC_PREFIX + run_id, name) or 0)


def ledger(obs: Observer, run_id: str) -> dict[str, StepRecord]:
    raw = obs.client.hgetall(obs.runs.keys.steps(run_id))
    # As stored, opened: sealed when MARBLES_KEYS is set (payloads/fields.py).
    return {(k if isinstance(k, str) else k.decode()):
            open_record(obs.runs.store, msgspec.json.decode(v, type=StepRecord))
            for k, v in raw.items()}


def waiting(obs: Observer, run_id: str, reason: str, timeout: float = 60.0) -> Any:
    def check() -> Any:
        view = obs.view(run_id)
        return view if view is not None and view.status == "waiting" and (
            view.wait_reason == reason) else None

    return wait_for(check, timeout=timeout, what=f"run {run_id} waiting ({reason})",
                    context=lambda: obs.dump(run_id))


def final(obs: Observer, run_id: str, status: str) -> Any:
    obs.wait_final(run_id, timeout=90)
    view = obs.view(run_id)
    assert view is not None and view.status == status, obs.dump(run_id)
    return view


def status_json(procs: Procs, run_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ok(procs.cli("status", run_id, "--json")))
    return data


# --------------------------------------------------------------------------------------------
# definitions (no server)


def test_bad_retry_definitions_are_refused_with_one_line() -> None:
    for kwargs, words in [
        ({"initial": "soon"}, "initial"), ({"initial": -1}, "initial"),
        ({"backoff": 0.5}, "backoff"), ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"), ({"initial": "10m", "max_interval": "1m"},
                                                   "max_interval"),
        ({"non_retryable": (ValueError, "KeyError")}, "non_retryable"),
        ({"jitter": "yes"}, "jitter")]:
        with pytest.raises(RetryPolicyError) as refused:
            mr.Retry(**kwargs)
        assert words in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(DefinitionError, match="not both"):
        mr.step(retry=mr.Retry(), retries=3)(lambda: None)
    with pytest.raises(DefinitionError, match="on_exhausted"):
        mr.step(on_exhausted="retry")(lambda: None)
    with pytest.raises(DefinitionError, match="on_exhausted"):
        mr.workflow(on_exhausted="later")(lambda ctx: None)
    with pytest.raises(DefinitionError, match="retry="):
        mr.workflow(retry=3)(lambda ctx: None)


def test_the_shorthand_and_the_workflow_default_are_retry_policies() -> None:
    from marbles_rq.engine.authoring import StepDef, WorkflowDef

    short = StepDef("s", lambda: None, retries=3, backoff="fixed", delay_s=2.0, jitter=False)
    assert short.policy().max_attempts == 4 and short.policy().delay_for(3) == 2.0
    wf = WorkflowDef("w", lambda ctx: None, None, retry=mr.Retry(max_attempts=7),
                     on_exhausted="pause")
    plain = StepDef("p", lambda: None)
    assert plain.policy(wf).max_attempts == 7 and plain.exhausted(wf) == "pause"
    own = StepDef("o", lambda: None, retry=mr.Retry(max_attempts=2), on_exhausted="fail")
    assert own.policy(wf).max_attempts == 2 and own.exhausted(wf) == "fail"
    assert plain.policy().max_attempts == 1 and plain.exhausted() == "fail"
    # Without max_interval, the ceiling is 5 minutes, or the first wait when longer.
    assert mr.Retry().max_interval_s == 300.0
    assert mr.Retry(initial="1h", jitter=False).delay_for(3) == 3600.0
    backoff = mr.Retry(initial="1s", backoff=3.0, max_interval="20s", jitter=False)
    assert [backoff.delay_for(n) for n in (1, 2, 3, 4)] == [1.0, 3.0, 9.0, 20.0]


def test_an_input_patch_is_a_merge_patch_over_the_arguments_by_name() -> None:
    args = {"amount": 500, "card": {"number": "4242", "cvc": "123"}}
    assert merge_patch(args, {"card": {"cvc": None}}) == {"amount": 500,
                                                         "card": {"number": "4242"}}
    assert check_patch("charge", args, {"amount": 5}) == {**args, "amount": 5}
    for patch, words in [({"nope": 1}, "no argument 'nope'"), ({"amount": None}, "removes"),
                         ([1], "JSON object"), ({}, "JSON object")]:
        with pytest.raises(PatchRefusedError, match=words):
            check_patch("charge", args, patch)
    with pytest.raises(PatchRefusedError, match="not JSON"):
        check_patch("charge", None, {"amount": 5})
    # Checked where the step's code is not at hand (a bare client) too: what JSON cannot
    # record as given is refused, not written (NaN would be recorded as null, a removal
    # that every later try of the step refuses), nor what is over the payload limit.
    for patch, words in [({"amount": float("nan")}, "NaN"), ({"amount": object()}, "not JSON"),
                         ({"card": {"cvc": float("inf")}}, "NaN"),
                         ({"card": {"cvc": "x" * 2_000_000}}, "bytes; the limit is")]:
        with pytest.raises(PatchRefusedError, match=words):
            check_patch("charge", args, patch)


def test_the_test_kit_pauses_retries_with_a_patch_and_fails() -> None:
    from marbles_rq.engine import failed_steps
    from marbles_rq.testing import Environment
    from tests import retry_workflows

    def charge(amount: int, card: Card) -> dict[str, Any]:
        if amount > 100:  # as rt_charge, without counting its tries in Redis
            raise ValueError(f"amount {amount} is over the limit")
        return {"charged": amount, "cvc": card.cvc}

    env = Environment(schedules=False)
    env.mock_step("rt_charge", charge)
    run = env.start(retry_workflows.rt_order, 500)
    env.advance(1)
    assert run.status().status == "waiting"
    with pytest.raises(PatchRefusedError, match="does not fit"):
        env.retry(run, {"amount": "lots"})
    # A patch checked without the step's code that does not fit: the next try fails at once
    # and the step pauses again, saying so.
    store = env.engine.store
    failed_steps.retry(store.waits(), store.get(run.id), run.id, {"amount": "lots"}, None)
    env.run_until_idle()
    again = env.status_json(run)["waiting"]
    assert again["reason"] == "failed_step" and "does not fit" in again["for"]["error"]
    env.retry(run, {"amount": 5, "card": {"cvc": None}})
    assert run.result() == {"charged": 5, "cvc": ""}
    second = env.start(retry_workflows.rt_order, 900)
    env.advance(1)
    env.fail(second, reason="nope")
    with pytest.raises(mr.RunFailedError, match="given up: nope"):
        second.result()
    with pytest.raises(NotFailedStepError):
        env.fail(second)


# --------------------------------------------------------------------------------------------
# retries park the run


def test_a_retry_parks_the_run_and_frees_the_worker_for_another(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("rt_flaky", {"fails": 2}, "flaky-1")
    view = waiting(obs, "flaky-1", "retry")
    # The only worker is free: another run goes through while this one waits for its retry
    # (enqueued from here, without a CLI's start-up; its end comes before the second try's
    # start: checked below).
    enqueue(procs, "rt_quick", None, "quick-1")
    assert view.wait_for["attempt"] == 1 and view.wait_for["max_attempts"] == 5
    assert view.wait_for["error"] == "RuntimeError: try 1 fails"
    next_at = view.wait_for["next_at_ms"]
    text = ok(procs.cli("status", "flaky-1"))
    assert "step rt_flaky_step#0: attempt 2 of 5, next at" in text, text
    assert "last error RuntimeError: try 1 fails" in text, text
    listed = ok(procs.cli("runs", "--workflow", "rt_flaky"))
    assert re.search(r"flaky-1 .* attempt [23] of 5, next at ", listed) or (
        "succeeded" in listed), listed
    with mr.connect(procs.url) as client:
        row = client.runs(workflow="rt_flaky").runs[0]
        assert row.status == "succeeded" or (row.waiting is not None and row.waiting["for"][
            "next_at_ms"] >= next_at), row
    quick = final(obs, "quick-1", "succeeded")
    done = final(obs, "flaky-1", "succeeded")
    assert msgspec.json.decode(done.result) == 3
    step = ledger(obs, "flaky-1")["rt_flaky.rt_flaky_step#0"]
    assert step.status == "succeeded" and step.attempts == 3 == tries(obs, "flaky-1", "flaky")
    parks = [e.data for e in obs.events("flaky-1") if e.type == "parked"]
    assert [(p["reason"], p["attempt"]) for p in parks] == [("retry", 1), ("retry", 2)]
    # No try before its time: the second one started at or after the first wait's end.
    started = [e for e in obs.events("flaky-1") if e.type == "step_started"]
    assert [e.data["attempt"] for e in started] == [1, 2, 3], started
    assert started[1].happened_ms >= next_at
    assert quick.finished_ms is not None and quick.finished_ms < started[1].happened_ms


def test_kill9_during_the_wait_and_during_the_retried_try_keeps_the_count(
        procs: Procs) -> None:
    first = procs.worker()
    procs.controller()
    obs = procs.observer
    procs.enqueue("rt_flaky", {"fails": 2, "gate_try": 3}, "flaky-kill")
    waiting(obs, "flaky-kill", "retry")
    kill9_groups([first])  # during the wait: nothing holds the run, the count is stored
    second = procs.worker()
    wait_for(lambda: tries(obs, "flaky-kill", "flaky") == 3, timeout=60,
             what="the third try to start", context=lambda: obs.dump("flaky-kill"))
    kill9_groups([second])  # during the retried try (it waits on its gate)
    obs.client.rpush(GATE_PREFIX + "flaky-kill", "go")  # a later try passes at once
    procs.worker()
    done = final(obs, "flaky-kill", "succeeded")
    # The killed third try counted: the fourth one succeeded; every try is in the ledger.
    assert msgspec.json.decode(done.result) == 4
    step = ledger(obs, "flaky-kill")["rt_flaky.rt_flaky_step#0"]
    assert step.attempts == 4 == tries(obs, "flaky-kill", "flaky")


def test_kill9_during_the_last_try_runs_it_again_as_the_last(procs: Procs) -> None:
    """max_attempts bounds the tries across kills: the last try, interrupted, runs again
    under its own number (the step fails with 5 of 5 tries, not 6 of 5)."""
    first = procs.worker()
    procs.controller()
    obs = procs.observer
    procs.enqueue("rt_flaky", {"fails": 99, "gate_try": 5}, "flaky-last")
    wait_for(lambda: tries(obs, "flaky-last", "flaky") == 5, timeout=90,
             what="the fifth try to start", context=lambda: obs.dump("flaky-last"))
    kill9_groups([first])  # during the last try (it waits on its gate)
    procs.worker()
    final(obs, "flaky-last", "failed")
    assert tries(obs, "flaky-last", "flaky") == 6  # the body ran again after the kill
    step = ledger(obs, "flaky-last")["rt_flaky.rt_flaky_step#0"]
    assert step.attempts == 5, obs.dump("flaky-last")
    started = [e.data.get("attempt") for e in obs.events("flaky-last")
               if e.type == "step_started"]
    assert max(started) == 5, started


def test_a_non_retryable_failure_fails_at_once(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    procs.enqueue("rt_nonretry", "value", "nr-value")
    procs.enqueue("rt_nonretry", "declined", "nr-declined")
    for run_id, kind, message in [("nr-value", "ValueError", "bad value"),
                                  ("nr-declined", "NonRetryable", "card declined for good")]:
        view = final(obs, run_id, "failed")
        assert view.error is not None and (view.error.type, view.error.message) == (
            kind, message)
        assert tries(obs, run_id, "invalid") == 1
        assert ledger(obs, run_id)["rt_nonretry.rt_invalid#0"].attempts == 1
        assert "parked" not in [e.type for e in obs.events(run_id)]


# --------------------------------------------------------------------------------------------
# pause on exhaustion, retry, fail


def test_pause_then_retry_with_a_patched_input_succeeds(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    procs.enqueue("rt_order", 500, "order-1")
    view = waiting(obs, "order-1", "failed_step")
    assert view.wait_for["error"] == "ValueError: amount 500 is over the limit"
    assert view.wait_for["attempts"] == 2 == tries(obs, "order-1", "charge")
    text = ok(procs.cli("status", "order-1"))
    assert "waiting: failed_step" in text and "2 of 2 attempts failed" in text, text
    feed = json.loads(ok(procs.cli("feed", "--json")))
    assert [(f["run"], f["step"]) for f in feed["failed_steps"]] == [
        ("order-1", "rt_order.rt_charge#0")]

    # Patches that do not fit: one line, exit 2, nothing changed.
    for patch, words in [("{not json", "not valid JSON"), ("null", "is null"),
                         ("[1]", "JSON object"), ('{"nope": 1}', "no argument"),
                         ('{"amount": "lots"}', "does not fit"),
                         ('{"card": {"number": 4242}}', "does not fit")]:
        one_line_error(procs.cli("retry", "order-1", "--input-patch", patch), 2, words)
    assert obs.view("order-1").wait_reason == "failed_step"  # type: ignore[union-attr]

    patch = {"amount": 50, "card": {"cvc": None}}
    done = procs.cli("retry", "order-1", "--input-patch", json.dumps(patch))
    assert "retried with its input patched" in ok(done), show(done)
    view = final(obs, "order-1", "succeeded")
    assert msgspec.json.decode(view.result) == {"charged": 50, "card": "4242", "cvc": ""}
    step = ledger(obs, "order-1")["rt_order.rt_charge#0"]
    assert step.patches == [patch] and step.attempts == 1
    assert status_json(procs, "order-1")["steps"][0]["patches"] == [patch]
    retried = [e.data for e in obs.events("order-1") if e.type == "step_retried"]
    assert retried[0]["patch"] == patch
    assert retried[0]["args"] == {"amount": 50, "card": {"number": "4242"}}
    assert json.loads(ok(procs.cli("feed", "--json")))["failed_steps"] == []
    # Acting again on a run that is not paused on a failed step: one line, exit 2.
    one_line_error(procs.cli("retry", "order-1"), 2, "already finished")
    one_line_error(procs.cli("fail", "order-1"), 2, "already finished")


def test_pause_then_fail_gives_up_with_the_reason(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    procs.enqueue("rt_order", 700, "order-2")
    waiting(obs, "order-2", "failed_step")
    done = procs.cli("fail", "order-2", "--reason", "card expired")
    assert "given up" in ok(done), show(done)
    view = final(obs, "order-2", "failed")
    assert view.error is not None and view.error.type == "ValueError"
    assert view.error.message == "amount 700 is over the limit (given up: card expired)"
    assert ledger(obs, "order-2")["rt_order.rt_charge#0"].status == "failed"
    assert tries(obs, "order-2", "charge") == 2  # giving up runs nothing
    # A paused run cancelled leaves the feed with its pause.
    procs.enqueue("rt_order", 800, "order-3")
    waiting(obs, "order-3", "failed_step")
    keys = obs.runs.keys
    feed = keys.feed(keys.bucket_of("order-3"))
    assert obs.client.zscore(feed, "order-3|!failed_step") is not None
    ok(procs.cli("cancel", "order-3"))
    assert obs.client.zscore(feed, "order-3|!failed_step") is None
    assert json.loads(ok(procs.cli("feed", "--json")))["failed_steps"] == []
    one_line_error(procs.cli("retry", "order-3"), 2, "already finished (cancelled)")


def test_retry_and_fail_refuse_runs_not_paused_on_a_failed_step(procs: Procs) -> None:
    procs.start(workers=1)
    obs = procs.observer
    procs.enqueue("rt_patient", None, "patient-1")  # its next try is a minute away
    waiting(obs, "patient-1", "retry")
    for command in (["retry", "patient-1"], ["fail", "patient-1", "--reason", "x"]):
        line = one_line_error(procs.cli(*command), 2, "not paused on a failed step")
        assert "waiting (retry)" in line
    one_line_error(procs.cli("retry", "no-such-run"), 2, "no run with id")
    one_line_error(procs.cli("fail", "bad id!"), 2, "run id")
    ok(procs.cli("cancel", "patient-1"))
    final(obs, "patient-1", "cancelled")


def test_retry_and_fail_from_the_client_and_the_http_api(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    from tests.test_web_api import curl

    obs = procs.observer
    for run_id in ("c-1", "c-2", "h-1", "h-2"):
        procs.enqueue("rt_order", 500, run_id)
    for run_id in ("c-1", "c-2", "h-1", "h-2"):
        waiting(obs, run_id, "failed_step")

    with mr.connect(procs.url) as client:
        with pytest.raises(PatchRefusedError):
            client.handle("c-1").retry(input_patch={"amount": "x"})
        assert client.handle("c-1").retry(input_patch={"amount": 7}).outcome == "retried"
        with pytest.raises(NotFailedStepError):
            client.handle("c-1").fail()

    async def use_async() -> str:
        async with mr.connect_async(procs.url) as client:
            return (await client.handle("c-2").fail(reason="async")).outcome

    assert asyncio.run(use_async()) == "failed"
    assert msgspec.json.decode(final(obs, "c-1", "succeeded").result)["charged"] == 7
    assert "(given up: async)" in final(obs, "c-2", "failed").error.message

    bad = curl(web, "POST", "/api/runs/h-1/retry", {"input_patch": {"nope": 1}})
    assert bad.status == 422 and bad.error()["code"] == "patch_refused"
    assert curl(web, "POST", "/api/runs/h-1/retry",
                {"input_patch": {"amount": 9}}).json()["outcome"] == "retried"
    assert curl(web, "POST", "/api/runs/h-2/fail", {"reason": "http"}).json()[
        "outcome"] == "failed"
    assert msgspec.json.decode(final(obs, "h-1", "succeeded").result)["charged"] == 9
    final(obs, "h-2", "failed")
    again = curl(web, "POST", "/api/runs/h-1/retry")
    assert again.status == 409 and again.error()["code"] == "not_failed_step"
    missing = curl(web, "POST", "/api/runs/nope/fail", {})
    assert missing.status == 404
    unknown_field = curl(web, "POST", "/api/runs/h-2/fail", {"why": 1})
    assert unknown_field.status == 400


# --------------------------------------------------------------------------------------------
# notifications


def receiver(tmp: Path, fail_first: int) -> tuple[subprocess.Popen[bytes], str, Path]:
    port_file, log = tmp / "port", tmp / "received.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.notify_receiver", str(port_file),
                             str(log), SECRET, str(fail_first)], cwd=REPO_ROOT)
    wait_for(lambda: port_file.exists() and port_file.read_text(), timeout=20,
             what="the receiver to listen")
    return proc, f"http://127.0.0.1:{port_file.read_text()}/hooks/paused", log


def received(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_pause_is_notified_signed_and_retried_until_received(procs: Procs,
                                                                tmp_path: Path) -> None:
    server, url, log = receiver(tmp_path, fail_first=2)
    try:
        procs.env.update(MARBLES_NOTIFY_URL=url, MARBLES_NOTIFY_SECRET=SECRET)
        procs.start(workers=1)
        obs = procs.observer
        procs.enqueue("rt_order", 500, "notify-1")
        waiting(obs, "notify-1", "failed_step")
        got = wait_for(lambda: [r for r in received(log) if r["status"] == 204] or None,
                       timeout=60, what="the notification to be received")
        calls = received(log)
        assert [c["status"] for c in calls] == [500, 500, 204] and all(c["valid"] for c in calls)
        body = got[0]["body"]
        assert (body["type"], body["run"], body["workflow"], body["step"]) == (
            "step_paused", "notify-1", "rt_order", "rt_order.rt_charge#0")
        assert body["error"] == "ValueError: amount 500 is over the limit"
        assert body["delivery"] == 3 and len({c["body"]["id"] for c in calls}) == 1
        keys = obs.runs.keys
        assert sum(obs.client.zcard(keys.notices(b)) for b in range(keys.buckets)) == 0
    finally:
        server.kill()
        server.wait()


def test_a_notification_that_is_never_taken_is_dropped_after_its_tries(
        procs: Procs, tmp_path: Path) -> None:
    server, url, log = receiver(tmp_path, fail_first=-1)
    try:
        procs.env.update(MARBLES_NOTIFY_URL=url, MARBLES_NOTIFY_SECRET=SECRET,
                         MARBLES_NOTIFY_TRIES="2")
        workers = procs.start(workers=1)
        ctl = next(p for p in procs.procs if p.role == "controller")
        procs.enqueue("rt_order", 500, "notify-2")
        ctl.wait_log("pause notification dropped after 2 tries", timeout=60)
        assert [c["status"] for c in received(log)] == [500, 500]
        keys = procs.observer.runs.keys
        assert sum(procs.observer.client.zcard(keys.notices(b))
                   for b in range(keys.buckets)) == 0
        # The run never waited on its notification: it is paused, and takes a retry.
        assert procs.observer.view("notify-2").wait_reason == "failed_step"  # type: ignore
        assert workers
    finally:
        server.kill()
        server.wait()



# --------------------------------------------------------------------------------------------
# on a cluster


def test_retries_pauses_and_notifications_on_a_cluster(cluster_url: str, tmp_path: Path
                                                       ) -> None:
    """Each script of the feature touches one bucket's keys (the run's tag): a 3-master
    cluster refuses any that does not. A retry parks and wakes, a pause takes a patched
    retry, and its notification leaves the outbox."""
    server, url, log = receiver(tmp_path, fail_first=1)
    procs = Procs(cluster_url, tmp_path / "procs", sources=list(PROCS_SOURCES))
    procs.env.update(MARBLES_LANE_COUNT="3", RQ_KEY_PREFIX="{mrq:rq}", MARBLES_NOTIFY_URL=url,
                     MARBLES_NOTIFY_SECRET=SECRET)
    try:
        procs.start(workers=1)
        procs.enqueue("rt_flaky", {"fails": 1}, "cl-flaky")
        procs.enqueue("rt_order", 500, "cl-order")

        def status(run_id: str) -> dict[str, Any]:
            return status_json(procs, run_id)

        wait_for(lambda: (status("cl-order")["waiting"] or {}).get("reason") == "failed_step",
                 timeout=60, what="cl-order to pause")
        ok(procs.cli("retry", "cl-order", "--input-patch", '{"amount": 20}'))
        wait_for(lambda: status("cl-order")["status"] == "succeeded", timeout=60,
                 what="cl-order to succeed", context=lambda: procs.report())
        assert status("cl-order")["result"]["charged"] == 20
        wait_for(lambda: status("cl-flaky")["status"] == "succeeded", timeout=60,
                 what="cl-flaky to succeed", context=lambda: procs.report())
        assert status("cl-flaky")["steps"][0]["attempts"] == 2
        got = wait_for(lambda: [r for r in received(log) if r["status"] == 204] or None,
                       timeout=60, what="the notification")
        assert got[0]["body"]["run"] == "cl-order" and all(r["valid"] for r in received(log))
    finally:
        procs.stop_all()
        server.kill()
        server.wait()
