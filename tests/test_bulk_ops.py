"""Bulk operations by filter, and search tags, from the user's side: the CLI's filter form of
cancel, pause, resume, rerun, approve and reject (dry run, confirmation, summary, Ctrl-C and
the same command again), `runs --tag/--queue/--cursor`, tags on `status --json`, the client's
`cancel_many` ... and `runs(tag=)`, and POST /api/runs:bulk. Real redis-server, real worker,
real CLI and web processes; workflows in tests/bulk_workflows.py. Where no worker runs, the
runs stay queued: what is checked is what the commands recorded."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import marbles_rq as mr
from marbles_rq.client import Client
from marbles_rq.engine.selection import FilterError, RunFilter
from marbles_rq.engine.tags import TagError, check_tags
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.web_stack import start_web

SOURCE = REPO_ROOT / "tests" / "bulk_workflows.py"
PROCS_SOURCES = (SOURCE,)
API_TOKEN = "api-token-0123456789abcdef-bulk"

Done = subprocess.CompletedProcess


def show(done: Done[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout!r}\nstderr: {done.stderr!r}"


def one_line_error(done: Done[str], code: int, *words: str) -> str:
    assert done.returncode == code, show(done)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), show(done)
    assert done.stdout == "", show(done)
    for word in words:
        assert word in lines[0], show(done)
    return lines[0]


def client(procs: Procs) -> Client:
    return mr.connect(procs.url, source=str(SOURCE))


def start(c: Client, workflow: str, n: int, *, prefix: str, customer: str = "acme",
          queue: str | None = None) -> list[str]:
    return [c.start(workflow, {"customer": customer, "n": i}, id=f"{prefix}-{i:04d}",
                    queue=queue).id for i in range(n)]


def statuses(c: Client, ids: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for run_id in ids:
        status = c.status(run_id).status
        out[status] = out.get(status, 0) + 1
    return out


def summary(done: Done[str]) -> dict[str, Any]:
    assert done.returncode == 0, show(done)
    return dict(json.loads(done.stdout))


# --------------------------------------------------------------------------------------------


def test_cancel_by_filter_dry_run_confirmation_and_again(procs: Procs) -> None:
    c = client(procs)
    quick = start(c, "quick", 30, prefix="q")
    other = start(c, "tagged", 5, prefix="t")
    before = statuses(c, quick)
    assert before == {"queued": 30}

    dry = procs.cli("cancel", "--workflow", "quick", "--status", "queued", "--dry-run")
    assert dry.returncode == 0, show(dry)
    assert dry.stdout.startswith("30 runs match (status queued, workflow quick)"), show(dry)
    sample = [line.strip() for line in dry.stdout.splitlines()[1:] if line.strip() != "..."]
    assert len(sample) == 10 and set(sample) <= set(quick)
    dry_json = procs.cli("cancel", "--workflow", "quick", "--dry-run", "--json")
    assert json.loads(dry_json.stdout)["matched"] == 30
    assert statuses(c, quick) == {"queued": 30}  # a dry run changes nothing

    # stdin is not a terminal (DEVNULL) and no --yes: refused, one line, nothing done.
    refused = procs.cli("cancel", "--workflow", "quick")
    one_line_error(refused, 2, "refusing to cancel 30 runs", "--yes")
    assert statuses(c, quick) == {"queued": 30}

    done = procs.cli("cancel", "--workflow", "quick", "--yes", "--batch-size", "7")
    assert done.returncode == 0, show(done)
    assert done.stdout.strip() == "cancel: done 30, skipped 0, failed 0", show(done)
    assert done.stderr.count("cancel: ") == 5  # a progress line per batch of 7
    assert statuses(c, quick) == {"cancelled": 30}
    assert statuses(c, other) == {"queued": 5}  # another workflow: untouched

    again = summary(procs.cli("cancel", "--workflow", "quick", "--yes", "--json"))
    assert again["done"] == 0 and again["skipped"] == {"already cancelled": 30}
    assert again["failed"] == {}


def test_on_a_terminal_it_asks_first(procs: Procs) -> None:
    import pty

    c = client(procs)
    ids = start(c, "quick", 4, prefix="tty")

    def answer(text: str) -> Done[str]:
        master, slave = pty.openpty()
        try:
            proc = subprocess.Popen(procs.cli_argv("cancel", "--workflow", "quick"),
                                    cwd=REPO_ROOT, env=procs.env, stdin=slave,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            os.write(master, text.encode())
            out, err = proc.communicate(timeout=60)
        finally:
            os.close(master)
            os.close(slave)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    declined = answer("n\n")
    assert declined.returncode == 1, show(declined)
    assert "cancel 4 runs (workflow quick)? [y/N]" in declined.stderr
    assert "nothing done" in declined.stderr
    assert statuses(c, ids) == {"queued": 4}
    accepted = answer("y\n")
    assert accepted.stdout.strip() == "cancel: done 4, skipped 0, failed 0", show(accepted)
    assert statuses(c, ids) == {"cancelled": 4}


def test_ctrl_c_stops_between_batches_and_the_same_command_does_the_rest(
        procs: Procs) -> None:
    c = client(procs)
    ids = start(c, "quick", 150, prefix="i")
    argv = procs.cli_argv("cancel", "--workflow", "quick", "--yes", "--batch-size", "1")
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=procs.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the first batch is done: interrupt the rest
        assert first.startswith("cancel: 1 of 150"), first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (out, err)
    assert "stopping after this batch" in err and "interrupted after" in err, err
    first_done = int(out.split("done ")[1].split(",")[0])
    assert 1 <= first_done < 150, out
    assert statuses(c, ids).get("cancelled") == first_done  # exactly what it said it did

    rest = summary(procs.cli("cancel", "--workflow", "quick", "--yes", "--json"))
    assert rest["done"] == 150 - first_done
    assert rest["skipped"] == {"already cancelled": first_done}
    assert statuses(c, ids) == {"cancelled": 150}


def test_bad_filters_are_one_line_and_exit_2(procs: Procs) -> None:
    c = client(procs)
    ids = start(c, "quick", 3, prefix="b")
    for args, words in (
            (("cancel", "--status", "bogus"), ("--status",)),
            (("cancel", "--tag", "no-equals"), ("key=value",)),
            (("cancel", "--tag", "bad key=x"), ("invalid tag key",)),
            (("pause", "--since", "yesterday"), ("--since", "ISO 8601")),
            (("resume", "--since", "2026-12-02T10:00:00Z", "--until", "2026-12-01T10:00:00Z"),
             ("since is after until",)),
            (("cancel",), ("give a run id, or a filter",)),
            (("cancel", ids[0], "--workflow", "quick"), ("not both",)),
            (("cancel", ids[0], "--dry-run"), ("--dry-run",)),
            (("approve", "--workflow", "quick", "--yes"), ("--question",)),
            (("rerun", "--workflow", "quick", "--id", "x"), ("--id",)),
            (("runs", "--tag", "=x"), ("invalid tag key",)),
    ):
        one_line_error(procs.cli(*args), 2, *words)
    assert statuses(c, ids) == {"queued": 3}


def test_odd_targets_and_filters_are_refused_before_anything_is_done(procs: Procs) -> None:
    c = client(procs)
    # Runs whose ids are single characters: a lone id string must not be walked as ids.
    for run_id in ("x", "y"):
        c.start("quick", {"customer": "acme", "n": 0}, id=run_id)
    with pytest.raises(mr.MarblesError, match="list of run ids"):
        c.cancel_many("xy")
    with pytest.raises(mr.MarblesError, match="list of run ids"):
        c.cancel_many(None)  # type: ignore[arg-type]
    with pytest.raises(mr.MarblesError, match="invalid run id"):
        c.rerun_many(["x", 5])  # type: ignore[list-item]
    assert statuses(c, ["x", "y"]) == {"queued": 2}
    for criteria in ({"since": float("nan")}, {"until": float("inf")},
                     {"since": -float("inf")}, {"since": 1e300}, {"workflow": 5},
                     {"queue": ["slow"]}):
        with pytest.raises(FilterError):
            c.select(**criteria)
    assert c.select(tags="customer=acme").tags == (("customer", "acme"),)
    one_line_error(procs.cli("cancel", "--since", "99999999999999d", "--dry-run"), 2,
                   "since must be epoch seconds")
    assert statuses(c, ["x", "y"]) == {"queued": 2}


def test_long_ids_sharing_a_prefix_get_reruns_of_their_own(procs: Procs) -> None:
    """A rerun's id is the run's id cut to fit 128 characters, plus the operation's key:
    two long ids alike in their first 113 characters got the same rerun id, so the second
    run was never rerun ("already rerun")."""
    c = client(procs)
    ids = [f"{'o' * 118}-{i}" for i in range(2)]
    for run_id in ids:
        c.start("quick", {"customer": "acme", "n": 0}, id=run_id)
        c.cancel(run_id)  # finished: a rerun may be made
    done = c.rerun_many(ids)
    assert (done.done, done.skipped) == (2, {}), done
    again = c.rerun_many(ids)
    assert (again.done, again.skipped) == (0, {"already rerun": 2}), again


def test_pause_resume_and_rerun_by_filter(procs: Procs) -> None:
    c = client(procs)
    ids = start(c, "quick", 12, prefix="p", queue="slow")
    paused = summary(procs.cli("pause", "--queue", "slow", "--yes", "--json"))
    assert paused["done"] == 12
    assert all(c.status(i).pause_requested for i in ids)
    assert summary(procs.cli("pause", "--queue", "slow", "--yes", "--json"))["skipped"] == {
        "already paused": 12}
    resumed = summary(procs.cli("resume", "--queue", "slow", "--yes", "--json"))
    assert resumed["done"] == 12
    assert summary(procs.cli("resume", "--queue", "slow", "--yes", "--json"))["skipped"] == {
        "not paused": 12}

    # These stay queued on "slow" (the worker started below takes "default" only): a rerun
    # of an unfinished run is skipped, not an error.
    rerun_queued = summary(procs.cli("rerun", "--queue", "slow", "--yes", "--json"))
    assert rerun_queued["skipped"] == {"not finished": 12} and rerun_queued["done"] == 0

    done_ids = start(c, "quick", 6, prefix="d")
    procs.start(controller=False)
    for run_id in done_ids:
        procs.observer.wait_status(run_id, "succeeded")
    first = summary(procs.cli("rerun", "--workflow", "quick", "--status", "succeeded",
                              "--yes", "--json"))
    assert first["done"] == 6, first
    again = summary(procs.cli("rerun", "--workflow", "quick", "--status", "succeeded",
                              "--yes", "--json"))
    # The runs it made match the filter now: they are its own, not rerun again.
    assert again["done"] == 0 and again["skipped"] == {
        "already rerun": 6, "a rerun made by this operation": 6}, again
    reruns = [r for r in c.runs(workflow="quick", limit=100).runs
              if c.status(r.id).rerun_of in done_ids]
    assert len(reruns) == 6


def test_approve_and_reject_by_question_and_tag(procs: Procs) -> None:
    procs.start(controller=False)
    c = client(procs)
    acme = start(c, "approval", 3, prefix="a", customer="acme")
    initech = start(c, "approval", 2, prefix="n", customer="initech")
    for run_id in acme + initech:
        procs.observer.wait_status(run_id, "waiting")
    dry = procs.cli("approve", "--question", "ship", "--dry-run")
    assert dry.stdout.startswith("5 runs match (open question ship)"), show(dry)

    ok = summary(procs.cli("approve", "--question", "ship", "--tag", "customer=acme",
                           "--note", "bulk ok", "--yes", "--json"))
    assert ok["done"] == 3, ok
    for run_id in acme:
        procs.observer.wait_status(run_id, "succeeded")
        assert c.result(run_id, timeout=30) == {"approved": True, "note": "bulk ok"}
    assert statuses(c, initech) == {"waiting": 2}

    no = summary(procs.cli("reject", "--question", "ship", "--yes", "--json"))
    assert no["done"] == 2, no
    for run_id in initech:
        assert c.result(run_id, timeout=30) == {"approved": False, "note": None}
    nothing = procs.cli("approve", "--question", "ship", "--yes")
    assert nothing.stdout.strip() == "no runs match (open question ship); nothing to approve"


def test_tags_on_status_runs_and_the_client(procs: Procs) -> None:
    procs.start(controller=False)
    c = client(procs)
    acme = start(c, "tagged", 4, prefix="ta", customer="acme")
    initech = start(c, "tagged", 3, prefix="ti", customer="initech")
    plain = start(c, "quick", 2, prefix="tq")
    for run_id in acme + initech + plain:
        procs.observer.wait_status(run_id, "succeeded")

    doc = json.loads(procs.cli("status", acme[0], "--json").stdout)
    assert doc["tags"] == {"team": "billing", "customer": "acme"}
    assert c.status(initech[0]).tags == {"team": "billing", "customer": "initech"}
    assert c.status(plain[0]).tags == {}

    assert {r.id for r in c.runs(tag="customer=acme", limit=100).runs} == set(acme)
    assert {r.id for r in c.runs(tag={"team": "billing"}, limit=100).runs} == set(
        acme + initech)
    both = c.runs(tag=["team=billing", "customer=initech"], limit=100).runs
    assert {r.id for r in both} == set(initech) and both[0].tags["team"] == "billing"

    listed = procs.cli("runs", "--tag", "customer=acme", "--limit", "2")
    assert listed.returncode == 0, show(listed)
    lines = listed.stdout.splitlines()
    assert len(lines) == 2 and all("customer=acme" in line for line in lines)
    cursor = listed.stderr.strip().removeprefix("next page: --cursor ")
    rest = procs.cli("runs", "--tag", "customer=acme", "--cursor", cursor)
    assert len(rest.stdout.splitlines()) == 2 and rest.stderr == ""
    assert {line.split()[0] for line in lines + rest.stdout.splitlines()} == set(acme)
    assert procs.cli("runs", "--queue", "nowhere").stdout == ""

    # The client's bulk form: by filter and by ids, a summary back.
    reran = c.rerun_many(c.select(tags=["customer=initech"]))
    assert reran.done == 3 and reran.n_failed == 0
    by_ids = c.cancel_many(acme[:2])
    assert by_ids.done == 0 and by_ids.skipped == {"already finished": 2}


def test_a_pruned_run_leaves_no_tag_index_entry(procs: Procs) -> None:
    import redis

    procs.start(workers=1)  # and a controller, which prunes every few seconds
    c = client(procs)
    ids = start(c, "brief", 3, prefix="pr", customer="acme")
    keys = c.reader.keys
    r = redis.Redis.from_url(procs.url)
    indexes = {keys.tag_index(k, v, keys.bucket_of(i)) for i in ids
               for k, v in (("team", "ops"), ("customer", "acme"))}

    def pruned() -> bool:
        return all(c.reader.get(i) is None for i in ids)

    wait_for(pruned, timeout=60, what="the runs to be pruned")
    assert [k for k in indexes if r.exists(k)] == []
    r.close()


def test_tag_bounds_are_clear_errors() -> None:
    assert check_tags({"n": 5, "ok": True}) == {"n": "5", "ok": "true"}
    with pytest.raises(TagError, match="at most 16"):
        check_tags({f"k{i}": "v" for i in range(17)})
    with pytest.raises(TagError, match="invalid tag key"):
        check_tags({"a b": "v"})
    with pytest.raises(TagError, match="128 printable"):
        check_tags({"k": "x" * 129})
    with pytest.raises(mr.MarblesError, match="invalid tag key"):
        mr.workflow(tags={"": "x"})(lambda ctx: None)
    with pytest.raises(FilterError, match="at least one"):
        RunFilter.build()


def test_bulk_over_http(procs: Procs) -> None:
    import httpx

    c = client(procs)
    ids = start(c, "quick", 8, prefix="h")
    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    with httpx.Client(base_url=web.url, headers=auth, timeout=60) as http:
        dry = http.post("/api/runs:bulk", json={"action": "cancel", "dry_run": True,
                                                "filter": {"workflow": "quick"}})
        assert dry.status_code == 200, dry.text
        assert dry.json()["matched"] == 8 and len(dry.json()["sample"]) == 8
        assert statuses(c, ids) == {"queued": 8}
        done = http.post("/api/runs:bulk", json={"action": "cancel",
                                                 "filter": {"workflow": "quick"}})
        assert done.status_code == 200 and done.json()["done"] == 8, done.text
        again = http.post("/api/runs:bulk", json={"action": "cancel", "ids": ids[:3]})
        assert again.json()["skipped"] == {"already cancelled": 3}
        for body, code in (({"action": "cancel"}, "invalid_request"),
                           ({"action": "explode", "ids": ids}, "invalid_request"),
                           ({"action": "cancel", "filter": {}}, "invalid_filter"),
                           ({"action": "cancel", "filter": {"tags": ["x"]}}, "invalid_tag")):
            refused = http.post("/api/runs:bulk", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == code, (
                body, refused.text)
        page = http.get("/api/runs", params={"tag": "team=billing"})
        assert page.status_code == 200 and page.json()["runs"] == []
        spec = http.get("/api/openapi.json").json()
        assert "post" in spec["paths"]["/api/runs:bulk"]
        assert "BulkBody" in spec["components"]["schemas"]


def test_async_client_bulk(procs: Procs) -> None:
    import asyncio

    c = client(procs)
    ids = start(c, "quick", 5, prefix="as")

    async def main() -> tuple[int, Any]:
        ac = mr.connect_async(procs.url, source=str(SOURCE))
        try:
            count, _ = await ac.count(ac.select(workflow="quick"))
            return count, await ac.cancel_many(ac.select(workflow="quick"))
        finally:
            await ac.aclose()

    count, done = asyncio.run(main())
    assert count == 5 and done.done == 5
    assert statuses(c, ids) == {"cancelled": 5}


def test_tags_and_bulk_cancel_on_a_three_master_cluster(cluster_url: str,
                                                        redis_url: str) -> None:
    """Every tag index is on its run's slot: the tag script and the filtered walk work on a
    Redis Cluster (the runs spread over the three masters; RQ's queues on a server)."""
    c = mr.connect(cluster_url, source=str(SOURCE), rq_url=redis_url)
    acme = start(c, "tagged", 12, prefix="ca", customer="acme")
    other = start(c, "tagged", 4, prefix="co", customer="initech")
    for run_id in acme + other:  # the declared tag, recorded when each was started
        assert c.status(run_id).tags == {"team": "billing"}
    assert {r.id for r in c.runs(tag="team=billing", limit=100).runs} == set(acme + other)
    by_tag = c.cancel_many(acme[:5])
    assert by_tag.done == 5
    from marbles_rq.engine.tags import tag_run

    for run_id in acme:  # as ctx.tag does from a body
        tag_run(c.runs_store, run_id, {"customer": "acme"})
    found = c.runs(tag=["customer=acme", "team=billing"], limit=100).runs
    assert {r.id for r in found} == set(acme)
    done = c.cancel_many(c.select(tags=["customer=acme"]))
    assert done.done == 7 and done.skipped == {"already cancelled": 5}
    assert statuses(c, other) == {"queued": 4}
    dry = subprocess.run([*procs_cli(cluster_url), "--rq-url", redis_url, "cancel", "--tag",
                          "team=billing", "--status", "queued", "--dry-run"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                         cwd=REPO_ROOT)
    assert dry.stdout.startswith("4 runs match"), show(dry)


def procs_cli(url: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "marbles_rq", "--redis-url", url, "--source", str(SOURCE)]


def test_the_bulk_operations_page_runs_as_written(tmp_path: Path, redis_server: Any) -> None:
    """docs/how-to/bulk-operations.md: its python blocks run, its cli lines exit 0, against
    a worker and a controller that load examples/review.py (until the docs site's own test
    executes every page)."""
    from tests.test_docs_client import blocks, run_blocks

    page = REPO_ROOT / "docs" / "how-to" / "bulk-operations.md"
    found = blocks(page)
    assert found and all(b.mark is not None for b in found)
    stack = Procs(redis_server.url, tmp_path / "procs",
                  sources=(REPO_ROOT / "examples" / "review.py",))
    try:
        stack.start(workers=1)
        out = run_blocks(stack, [b for b in found if b.mark == "run"], tmp_path)
        assert "approve: done 3, skipped 0, failed 0" in out, out
        for block in (b for b in found if b.mark == "cli"):
            for line in block.code.splitlines():
                args = shlex.split(line)
                assert args[0] == "marbles-rq"
                done = stack.cli(*args[1:])
                assert done.returncode == 0, (line, show(done))
        typed = [b for b in found if b.mark == "typecheck"]
        source = tmp_path / "typed.py"
        source.write_text("\n".join(b.code for b in typed))
        checked = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.devnull,
                                  "--ignore-missing-imports", str(source)],
                                 capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
        assert checked.returncode == 0, checked.stdout
    finally:
        stack.stop_all()
