"""`marbles-rq rerun`: a new run of a finished run, from the top or from a step, with real
workers; refusals that write nothing."""

from __future__ import annotations

import json

import redis

from tests.procs import CHAIN_SOURCE, REPO_ROOT, Procs

CLI_SOURCE = REPO_ROOT / "tests" / "cli_workflows.py"
PROCS_SOURCES = (CHAIN_SOURCE, CLI_SOURCE)


def _counts(r: redis.Redis) -> dict[str, int]:
    return {s: int(r.get(f"counted:{s}") or 0) for s in ("first", "second", "third")}


def _ok(done: object) -> None:
    assert getattr(done, "returncode", 1) == 0, (getattr(done, "stdout", ""),
                                                 getattr(done, "stderr", ""))


def test_rerun_from_the_third_step_executes_only_it(procs: Procs) -> None:
    procs.start(workers=1)
    r = redis.Redis.from_url(procs.url)
    _ok(procs.cli("enqueue", "counted", "--input", '{"n": 4}', "--id", "orig"))
    final = procs.observer.wait_final("orig")
    assert final.data["status"] == "succeeded" and final.data["result"] == 53
    assert _counts(r) == {"first": 1, "second": 1, "third": 1}

    # An empty script cache (a restarted Redis): the run and its copied ledger still land
    # together (a NOSCRIPT inside the transaction once recorded the run without it).
    r.script_flush()
    done = procs.cli("rerun", "orig", "--from-step", "counted.third#0", "--id", "again")
    _ok(done)
    assert "rerun of orig from step counted.third#0" in done.stdout
    assert "counted.first#0, counted.second#0" in done.stdout
    final = procs.observer.wait_final("again")
    assert final.data["status"] == "succeeded" and final.data["result"] == 53
    # Steps 1 and 2 came from the copied ledger; only step 3 executed again.
    assert _counts(r) == {"first": 1, "second": 1, "third": 2}

    status = procs.cli("status", "again", "--json")
    _ok(status)
    data = json.loads(status.stdout)
    assert data["rerun_of"] == "orig" and data["rerun_from_step"] == "counted.third#0"
    assert data["input"] == {"n": 4, "note": ""}
    text = procs.cli("status", "again")
    assert "rerun of orig from step counted.third#0" in text.stdout

    # From the top: every step executes again. A bare path means its first call (#0).
    _ok(procs.cli("rerun", "orig", "--id", "top"))
    assert procs.observer.wait_final("top").data["status"] == "succeeded"
    assert _counts(r) == {"first": 2, "second": 2, "third": 3}
    _ok(procs.cli("rerun", "again", "--from-step", "counted.second", "--id", "mid"))
    assert procs.observer.wait_final("mid").data["result"] == 53
    assert _counts(r) == {"first": 2, "second": 3, "third": 4}

    # The same new id again: the existing run, nothing written.
    again = procs.cli("rerun", "orig", "--id", "top")
    _ok(again)
    assert "exists already" in again.stdout
    assert _counts(r) == {"first": 2, "second": 3, "third": 4}


def test_rerun_refusals_write_nothing(procs: Procs) -> None:
    r = redis.Redis.from_url(procs.url)

    def keys() -> list[bytes]:
        # The controller's per-minute rollups (derived, rewritten every few seconds) aside.
        return sorted(k for k in r.keys("*") if b":roll:" not in k and b":rollmin:" not in k)

    # No worker yet: the run stays queued.
    _ok(procs.cli("enqueue", "counted", "--input", '{"n": 1}', "--id", "pending"))
    before = keys()

    def refused(*args: str, expected: str) -> None:
        done = procs.cli("rerun", *args)
        assert done.returncode == 2, (done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], \
            done.stderr
        assert keys() == before

    refused("nope", expected="no run with id 'nope'")
    refused("pending", expected="run pending is queued; only a finished run can be rerun")
    refused("pending", "--id", "bad id!", expected="invalid new run id")
    refused("bad|id", expected="invalid run id")

    procs.start(workers=1)
    assert procs.observer.wait_final("pending").data["status"] == "succeeded"
    # The new leader raises its fence in every bucket while it recovers: done before `before`.
    next(p for p in procs.procs if p.role == "controller").wait_log("recovered monitors")
    before = keys()
    refused("pending", "--from-step", "counted.fourth", "--id", "x",
            expected="run pending has no step 'counted.fourth' (its steps: counted.first#0, "
                     "counted.second#0, counted.third#0)")
    refused("pending", "--from-step", "counted.third#1", expected="has no step")
