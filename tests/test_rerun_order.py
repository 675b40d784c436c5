"""`rerun --from-step` copies the steps committed before PATH, in the store's commit order,
never in a worker's clock order: steps recorded in one millisecond, or by workers whose
clocks disagree, keep their order (issue 16, item 4). Old ledgers (entries without a
commit place) stay readable, in their clock order. Real workers, real CLI."""

from __future__ import annotations

import json

import msgspec
import redis

from marbles_rq.store import open_store
from marbles_rq.store.records import StepRecord, decode, encode
from tests.procs import REPO_ROOT, Procs

PROCS_SOURCES = (REPO_ROOT / "tests" / "rerun_workflows.py",)
STEPS = ("zeta", "alpha", "mid")  # the order `ordered` executes them in


def _ok(done: object) -> None:
    assert getattr(done, "returncode", 1) == 0, (getattr(done, "stdout", ""),
                                                 getattr(done, "stderr", ""))


def _counts(r: redis.Redis) -> dict[str, int]:
    return {s: int(r.get(f"ordered:{s}") or 0) for s in STEPS}


def _rewrite(url: str, run_id: str, at_ms: dict[str, int], *, legacy: bool = False) -> None:
    """Give the run's entries other worker clocks (`at_ms` by step name); `legacy` also
    drops what a ledger written before commit places lacks."""
    r = redis.Redis.from_url(url)
    key = open_store(url, read_only=True).keys.steps(run_id)
    for field, raw in r.hgetall(key).items():
        record = decode(StepRecord, raw, key)
        record = msgspec.structs.replace(record, at_ms=at_ms[record.name])
        data = encode(record)
        if legacy:
            doc = json.loads(data)
            doc.pop("epoch", None)
            doc.pop("wseq", None)
            data = json.dumps(doc).encode()
        r.hset(key, field, data)


def _rerun(procs: Procs, *args: str) -> list[str]:
    done = procs.cli("rerun", *args, "--json")
    _ok(done)
    copied: list[str] = json.loads(done.stdout)["copied_steps"]
    return copied


def _finished(procs: Procs, run_id: str) -> None:
    final = procs.observer.wait_final(run_id)
    assert final.data["status"] == "succeeded" and final.data["result"] == 23, final.data


def _original(procs: Procs) -> redis.Redis:
    procs.start(workers=1)
    r = redis.Redis.from_url(procs.url)
    _ok(procs.cli("enqueue", "ordered", "--input", "1", "--id", "orig"))
    _finished(procs, "orig")
    assert _counts(r) == {"zeta": 1, "alpha": 1, "mid": 1}
    return r


def test_steps_recorded_in_one_millisecond_keep_the_commit_order(procs: Procs) -> None:
    r = _original(procs)
    # All three recorded in one millisecond: by name, alpha and mid would come before zeta.
    _rewrite(procs.url, "orig", {"zeta": 5_000, "alpha": 5_000, "mid": 5_000})
    assert _rerun(procs, "orig", "--from-step", "ordered.alpha", "--id", "same-ms") == [
        "ordered.zeta#0"]
    _finished(procs, "same-ms")
    assert _counts(r) == {"zeta": 1, "alpha": 2, "mid": 2}


def test_skewed_worker_clocks_do_not_reorder_the_ledger(procs: Procs) -> None:
    r = _original(procs)
    # mid was committed last by a worker whose clock was seconds behind zeta's and alpha's:
    # by clock it would come first and be copied, though it ran after alpha.
    _rewrite(procs.url, "orig", {"zeta": 9_000, "alpha": 9_500, "mid": 1_000})
    assert _rerun(procs, "orig", "--from-step", "ordered.alpha", "--id", "skewed") == [
        "ordered.zeta#0"]
    _finished(procs, "skewed")
    assert _counts(r) == {"zeta": 1, "alpha": 2, "mid": 2}
    view = json.loads(procs.cli("status", "skewed", "--json").stdout)
    assert [s["path"] for s in view["steps"]] == [f"ordered.{s}" for s in STEPS]

    # A rerun of the rerun: the entries copied into it come before what it executed.
    _rewrite(procs.url, "skewed", {"zeta": 9_000, "alpha": 2_000, "mid": 1_000})
    assert _rerun(procs, "skewed", "--from-step", "ordered.mid", "--id", "again") == [
        "ordered.zeta#0", "ordered.alpha#0"]
    _finished(procs, "again")
    assert _counts(r) == {"zeta": 1, "alpha": 2, "mid": 3}


def test_a_ledger_written_before_commit_places_is_read_in_clock_order(procs: Procs) -> None:
    procs.start(workers=1)
    r = redis.Redis.from_url(procs.url)
    _ok(procs.cli("enqueue", "ordered", "--input", "1", "--id", "old"))
    _finished(procs, "old")
    _rewrite(procs.url, "old", {"zeta": 1_000, "alpha": 2_000, "mid": 3_000}, legacy=True)
    status = procs.cli("status", "old", "--json")
    _ok(status)
    assert [s["path"] for s in json.loads(status.stdout)["steps"]] == [
        f"ordered.{s}" for s in STEPS]
    assert _rerun(procs, "old", "--from-step", "ordered.mid", "--id", "from-old") == [
        "ordered.zeta#0", "ordered.alpha#0"]
    _finished(procs, "from-old")
    assert _counts(r) == {"zeta": 1, "alpha": 1, "mid": 2}
