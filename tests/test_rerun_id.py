"""`rerun --id NEW_ID` (issue 16, item 10): the same id again returns that rerun, but an id
that names any other run (an unrelated run, or a rerun of another run or from another step)
is refused with one line, exit 2, and nothing written."""

from __future__ import annotations

import redis

from tests.procs import REPO_ROOT, Procs

PROCS_SOURCES = (REPO_ROOT / "tests" / "rerun_workflows.py",)


def test_rerun_refuses_an_id_taken_by_another_run(procs: Procs) -> None:
    procs.start(workers=1)
    r = redis.Redis.from_url(procs.url)
    for run_id in ("orig", "other"):
        procs.enqueue("ordered", 1, run_id)
        assert procs.observer.wait_final(run_id).data["status"] == "succeeded"
    done = procs.cli("rerun", "orig", "--id", "again")
    assert done.returncode == 0, done.stderr
    assert procs.observer.wait_final("again").data["status"] == "succeeded"
    next(p for p in procs.procs if p.role == "controller").wait_log("recovered monitors")
    before = sorted(r.keys("*"))

    def refused(*args: str, expected: str) -> None:
        done = procs.cli("rerun", *args)
        assert done.returncode == 2, (done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], \
            done.stderr
        assert sorted(r.keys("*")) == before

    refused("orig", "--id", "other",
            expected="run other exists already and is a run of ordered, not this rerun of "
                     "orig")
    refused("orig", "--id", "orig", expected="run orig exists already")
    refused("other", "--id", "again",
            expected="run again exists already and is a rerun of orig from the top")
    refused("orig", "--from-step", "ordered.mid", "--id", "again",
            expected="is a rerun of orig from the top, not this rerun")

    # The same rerun again: the existing run, nothing written.
    same = procs.cli("rerun", "orig", "--id", "again")
    assert same.returncode == 0 and "exists already" in same.stdout, same.stderr
    assert sorted(r.keys("*")) == before
