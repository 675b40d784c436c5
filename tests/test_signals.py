"""Signals, from the user's side: a run waits for a signal without holding a worker and gets
each signal exactly once, whatever is killed; signals sent before it waits are buffered;
signal-with-start creates one run under concurrency; refusals (a finished or missing run,
a bad name, bad JSON, an oversized payload) are typed errors and one-line CLI errors that
record nothing. Real redis-server, real `marbles-rq worker` / `controller` processes and
CLI processes; the workflows are in tests/signal_workflows.py.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from marbles_rq.engine import ops
from marbles_rq.engine.execution import RunNotFoundError
from marbles_rq.engine.ops import PayloadTooLargeError
from marbles_rq.engine.signals import (
    InvalidSignalError,
    RunSettledError,
    send_signal,
    signals_json,
    start_with_signal,
)
from marbles_rq.transport.dispatch import rq_connection
from tests.procs import REPO_ROOT, Observer, Procs, stop_procs
from tests.signal_workflows import EXEC_PREFIX, GATE_PREFIX
from tests.test_waiting_questions import (
    cli_at_once,
    event_types,
    final,
    kill9_groups,
    ok,
    one_line_error,
    snapshot,
    wait_parked,
)

PROCS_SOURCES = (REPO_ROOT / "tests" / "signal_workflows.py",)


def enqueue(procs: Procs, name: str, input: Any, run_id: str) -> None:
    done = ops.enqueue(procs.observer.runs, rq_connection(procs.url),
                       ops.RunRequest(name, json.dumps(input).encode(), run_id))
    assert done.created, done


def executions(obs: Observer, run_id: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in obs.client.hgetall(EXEC_PREFIX + run_id).items()}


def taken_events(obs: Observer, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in obs.events(run_id) if e.type == "signal_taken"]


# --------------------------------------------------------------------------------------------


def test_waiting_run_survives_kill9_of_everything_and_gets_the_signal_once(
        procs: Procs) -> None:
    procs.start(workers=2)
    obs = procs.observer
    enqueue(procs, "sg_once", None, "survivor")
    view = wait_parked(obs, "survivor", "signal")
    assert view.worker is None and view.wait_for == {"signals": ["go"]}, obs.dump("survivor")
    status = json.loads(ok(procs.cli("status", "survivor", "--json")))
    assert status["waiting"]["reason"] == "signal"
    assert status["waiting"]["for"] == {"signals": ["go"]}
    assert "waiting: signal; signal go" in ok(procs.cli("status", "survivor"))

    kill9_groups(procs.procs)
    assert obs.status("survivor") == "waiting", obs.dump("survivor")
    # Sent while nothing runs: woken (queued), its delivery enqueued for whoever comes.
    out = ok(procs.cli("signal", "survivor", "go", "--payload", '{"by": "ann"}'))
    assert "signal go #1 recorded; run woken" in out, out
    procs.start(workers=2)

    data = final(obs, "survivor")
    assert data["result"]["payload"] == {"by": "ann"}, obs.dump("survivor")
    assert executions(obs, "survivor") == {"prepare": 1, "finish": 1}, obs.dump("survivor")
    assert [e["seqs"] for e in taken_events(obs, "survivor")] == [[1]], obs.dump("survivor")
    assert signals_json(obs.runs, "survivor") == {"go": {"sent": 1, "taken": 1,
                                                         "buffered": 0}}
    assert event_types(obs, "survivor").count("final") == 1


def test_kill9_after_the_signal_was_taken_replays_it_from_the_ledger(procs: Procs) -> None:
    """The signal is taken, then every process dies before the run finishes: the
    redelivery reads the payload from the ledger (the buffer is empty by then)."""
    [worker] = procs.start(workers=1)
    obs = procs.observer
    enqueue(procs, "sg_drain", None, "replayed")
    obs.wait_step_started("replayed", "sg_drain.sg_gate#0", attempt=1)
    send_signal(obs.runs, "replayed", "items", "a", rq=rq_connection(procs.url))
    send_signal(obs.runs, "replayed", "items", "b", rq=rq_connection(procs.url))
    obs.client.rpush(GATE_PREFIX + "replayed", "go")
    wait_parked(obs, "replayed", "signal")  # drained a and b, waits for the next
    assert [e["seqs"] for e in taken_events(obs, "replayed")] == [[1, 2], []]
    kill9_groups([worker, *[p for p in procs.procs if p.role == "controller"]])

    procs.start(workers=1)
    sent = send_signal(obs.runs, "replayed", "items", "c", rq=rq_connection(procs.url))
    assert (sent.seq, sent.woken) == (3, True)
    data = final(obs, "replayed")
    assert data["result"] == {"drained": ["a", "b"], "again": [], "next": "c"}, \
        obs.dump("replayed")
    assert [e["seqs"] for e in taken_events(obs, "replayed")] == [[1, 2], [], [3]]
    assert executions(obs, "replayed") == {"gate": 1}


def test_a_thousand_signals_from_eight_threads_arrive_once_each_in_order(
        procs: Procs) -> None:
    procs.start(workers=2, controller=False)
    obs = procs.observer
    enqueue(procs, "sg_collect", {"n": 1000, "name": "tick"}, "busy")
    rq = rq_connection(procs.url)
    seqs: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def sender(t: int) -> None:
        try:
            for i in range(125):
                sent = send_signal(obs.runs, "busy", "tick", {"t": t, "i": i}, rq=rq)
                with lock:
                    seqs.append(sent.seq)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert sorted(seqs) == list(range(1, 1001))  # each numbered once
    data = final(obs, "busy", )
    got = data["result"]
    assert len(got) == 1000
    assert len({(p["t"], p["i"]) for p in got}) == 1000, "a signal was taken twice"
    for t in range(8):
        assert [p["i"] for p in got if p["t"] == t] == list(range(125)), f"sender {t}"
    taken = [s for e in taken_events(obs, "busy") for s in e["seqs"]]
    assert taken == list(range(1, 1001)), "taken out of order, or twice"
    assert signals_json(obs.runs, "busy") == {"tick": {"sent": 1000, "taken": 1000,
                                                       "buffered": 0}}


def test_signal_with_start_from_eight_clients_creates_one_run_that_sees_all(
        procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    commands = [["signal", "--start", "sg_collect", "--id", "swa",
                 "--input", '{"n": 8, "name": "hello"}', "hello", "--payload",
                 json.dumps({"client": c}), "--json"] for c in range(8)]
    done = cli_at_once(procs, *commands)
    replies = [json.loads(ok(d)) for d in done]
    assert sum(r["created"] for r in replies) == 1, replies
    assert sorted(r["seq"] for r in replies) == list(range(1, 9))
    data = final(obs, "swa")
    assert sorted(p["client"] for p in data["result"]) == list(range(8)), obs.dump("swa")
    assert event_types(obs, "swa").count("queued") == 1


def test_signal_with_start_through_the_engine_function(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    rq = rq_connection(procs.url)
    request = ops.RunRequest("sg_once", b"null", "sws")
    first = start_with_signal(obs.runs, rq, request, "go", {"n": 1})
    assert (first.created, first.seq, first.dispatched) == (True, 1, True)
    data = final(obs, "sws")
    assert data["result"]["payload"] == {"n": 1}
    with pytest.raises(RunSettledError) as refused:
        start_with_signal(obs.runs, rq, request, "go", {"n": 2})
    assert refused.value.code == "run_settled"
    with pytest.raises(InvalidSignalError):
        start_with_signal(obs.runs, rq, ops.RunRequest("sg_once", b"null", None), "go")


def test_refusals_are_typed_one_line_and_record_nothing(procs: Procs,
                                                        tmp_path: Any) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    enqueue(procs, "sg_once", None, "done")
    send_signal(obs.runs, "done", "go", 1, rq=rq_connection(procs.url))
    final(obs, "done")
    enqueue(procs, "sg_collect", {"n": 1}, "open")  # waits, so every refusal below is its own
    wait_parked(obs, "open", "signal")
    stop_procs(procs.procs)  # a worker's heartbeats would change the snapshot
    before = snapshot(obs)

    with pytest.raises(RunSettledError) as settled:
        send_signal(obs.runs, "done", "go", 2)
    assert settled.value.code == "run_settled" and "already finished" in str(settled.value)
    one_line_error(procs.cli("signal", "done", "go"), 1, "already finished", "succeeded")

    with pytest.raises(RunNotFoundError):
        send_signal(obs.runs, "nobody", "go", 2)
    one_line_error(procs.cli("signal", "nobody", "go"), 2, "no run")

    with pytest.raises(InvalidSignalError):
        send_signal(obs.runs, "open", "a|b", 1)
    one_line_error(procs.cli("signal", "open", "a|b"), 2, "signal name")
    one_line_error(procs.cli("signal", "open", ""), 2, "signal name")
    with pytest.raises(InvalidSignalError):
        send_signal(obs.runs, "open", "item", payload_json=b"{bad")
    one_line_error(procs.cli("signal", "open", "item", "--payload", "{bad"), 2, "JSON")
    with pytest.raises(InvalidSignalError):
        send_signal(obs.runs, "open", "item", object())  # not JSON-able
    big = tmp_path / "big.json"
    big.write_text(json.dumps("x" * (1 << 20)))
    with pytest.raises(PayloadTooLargeError):
        send_signal(obs.runs, "open", "item", payload_json=big.read_bytes())
    one_line_error(procs.cli("signal", "open", "item", "--payload", f"@{big}"), 2, "limit")
    one_line_error(procs.cli("signal", "open"), 2, "RUN NAME")
    one_line_error(procs.cli("signal", "--start", "sg_once", "go"), 2, "--id")
    one_line_error(procs.cli("signal", "--start", "nope", "--id", "x1", "go"), 2, "nope")

    assert snapshot(obs) == before, "a refused signal wrote something"
    assert obs.status("open") == "waiting"


def test_a_signal_sent_before_the_wait_is_buffered_and_taken(procs: Procs) -> None:
    obs = procs.observer
    enqueue(procs, "sg_once", None, "early")  # no worker yet: it stays queued
    out = ok(procs.cli("signal", "early", "go", "--payload", '"first"'))
    assert "signal go #1 recorded; the run takes it when it asks" in out, out
    ok(procs.cli("signal", "early", "go", "--payload", '"second"'))
    status = json.loads(ok(procs.cli("status", "early", "--json")))
    assert status["signals"] == {"go": {"sent": 2, "taken": 0, "buffered": 2}}

    procs.start(workers=1, controller=False)
    data = final(obs, "early")
    assert data["result"]["payload"] == "first"
    assert "parked" not in event_types(obs, "early"), "it had its signal and still parked"
    assert signals_json(obs.runs, "early") == {"go": {"sent": 2, "taken": 1, "buffered": 1}}


def test_drain_then_wait(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    rq = rq_connection(procs.url)
    enqueue(procs, "sg_drain", None, "drainer")
    obs.wait_step_started("drainer", "sg_drain.sg_gate#0", attempt=1)
    for item in ("x", "y", "z"):
        send_signal(obs.runs, "drainer", "items", item, rq=rq)
    obs.client.rpush(GATE_PREFIX + "drainer", "go")
    wait_parked(obs, "drainer", "signal")
    send_signal(obs.runs, "drainer", "items", "last", rq=rq)
    data = final(obs, "drainer")
    assert data["result"] == {"drained": ["x", "y", "z"], "again": [], "next": "last"}


def test_timeout_fires(procs: Procs) -> None:
    procs.start(workers=1)  # the controller's timer wakes it
    obs = procs.observer
    enqueue(procs, "sg_timeout", {"timeout_s": 1.0}, "late")
    view = wait_parked(obs, "late", "signal")
    assert view.wait_for == {"signals": ["never"]}
    data = final(obs, "late", )
    assert data["result"]["timed_out"] is True, obs.dump("late")
    assert data["result"]["code"] == "signal_timeout"
    assert [e.get("timed_out") for e in taken_events(obs, "late")] == [True]


def test_a_retried_send_with_its_request_id_is_recorded_once(procs: Procs) -> None:
    obs = procs.observer
    enqueue(procs, "sg_collect", {"n": 2}, "retried")  # no worker: it stays queued
    first = send_signal(obs.runs, "retried", "item", "a", request_id="req-1")
    again = send_signal(obs.runs, "retried", "item", "a", request_id="req-1")
    assert (first.seq, again.seq) == (1, 1)
    out = ok(procs.cli("signal", "retried", "item", "--payload", '"b"', "--request-id", "req-2"))
    out2 = ok(procs.cli("signal", "retried", "item", "--payload", '"b"', "--request-id", "req-2"))
    assert "#2 recorded" in out and "#2 recorded" in out2, (out, out2)
    assert signals_json(obs.runs, "retried") == {"item": {"sent": 2, "taken": 0,
                                                          "buffered": 2}}
    procs.start(workers=1, controller=False)
    assert final(obs, "retried")["result"] == ["a", "b"]


def test_parallel_branches_waiting_for_one_name_each_get_their_own(procs: Procs) -> None:
    procs.start(workers=1, controller=False)
    obs = procs.observer
    rq = rq_connection(procs.url)
    enqueue(procs, "sg_twins", None, "twins")
    wait_parked(obs, "twins", "signal")
    send_signal(obs.runs, "twins", "twin", "one", rq=rq)
    send_signal(obs.runs, "twins", "twin", "two", rq=rq)
    data = final(obs, "twins")
    assert sorted(data["result"]) == ["one", "two"], obs.dump("twins")
    assert sorted(s for e in taken_events(obs, "twins") for s in e["seqs"]) == [1, 2]
