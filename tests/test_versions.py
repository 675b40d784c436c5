"""Workflow versions: what a definition's version is (given, or a fingerprint of its code),
several versions of one workflow in one source, and a rolling deploy with real processes:
runs started on version 1 finish on version 1's code after its workers are gone, handed back
(not failed) while no live worker serves it, with `doctor` warning; new runs go to version 2.

Real redis-server, real `marbles-rq worker` / `controller` / `web` processes (tests/procs.py),
each deploy a source folder written to tmp_path.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

import marbles_rq as mr
from marbles_rq.engine import catalog, ops
from marbles_rq.engine.authoring import REGISTRY, DefinitionError, Registry, load_source
from marbles_rq.engine.runs import RunStore
from marbles_rq.store import open_store
from marbles_rq.transport.dispatch import rq_connection
from marbles_rq.transport.served import live_versions
from tests.procs import REPO_ROOT, Procs, _cli_argv, wait_for
from tests.redis_procs import RedisServer
from tests.web_stack import start_web

API_TOKEN = "api-token-0123456789abcdef-xyz"

# One workflow `order` in three deploys. Each step returns the code that ran it, so a run's
# result says which version's code executed it.
STEP = '''
@mr.step
def stamp(code: str) -> str:
    return code
'''
BODY = '''
def {fn}(ctx: mr.RunContext) -> dict:
    before = stamp("{v}-before")
    answer = ctx.ask.question("Ship it?", key="ship")
    return {{"code": "{v}", "before": before, "answer": answer, "after": stamp("{v}-after")}}
'''
V1 = f'@mr.workflow("order", version="1"){BODY.format(fn="order_v1", v="v1")}'
V2 = f'@mr.workflow("order", version="2"){BODY.format(fn="order_v2", v="v2")}'


def write_source(folder: Path, *parts: str, step: str = "stamp") -> Path:
    """A source folder with `parts` and the step they call (named `step`: sources loaded into
    this process need a step name of their own)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "import marbles_rq as mr\n" + STEP + "\n".join(parts)
    (folder / "flows.py").write_text(text.replace("stamp", step))
    return folder


def mrq(*args: str, source: Path | str, redis_url: str = "redis://127.0.0.1:1/0"
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_cli_argv(), "--redis-url", redis_url, "--source", str(source),
                           *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


def listed(source: Path | str) -> dict[str, Any]:
    """`marbles-rq list --json`'s workflows by name (no Redis needed: a fresh process, so a
    fresh import of the source)."""
    done = mrq("list", "--json", source=source)
    assert done.returncode == 0, done.stderr
    return {w["name"]: w for w in json.loads(done.stdout)["workflows"]}


# --------------------------------------------------------------------------------------------
# what a version is


FINGERPRINTED = '''
import marbles_rq as mr
from marbles_rq import step as _step


@mr.step(retries=1)
def fp_charge(amount: int) -> int:
    return amount * 2


@_step
def fp_unused(x: int) -> int:
    return x


@mr.workflow("fp_order")
def fp_order(ctx: mr.RunContext) -> list:
    # a comment
    return [fp_charge(n) for n in range(3)]
'''


def test_the_default_version_is_a_stable_fingerprint_of_body_and_steps(tmp_path: Path) -> None:
    source = tmp_path / "fp.py"
    source.write_text(FINGERPRINTED)
    first = listed(source)["fp_order"]
    version = first["version"]
    assert len(version) == 10 and int(version, 16) >= 0, version
    assert first["versions"] == [version]
    # Another process importing the same file: the same version.
    assert listed(source)["fp_order"]["version"] == version
    # So is this one (a third import, in the test process).
    load_source(str(source))
    assert REGISTRY.workflows["fp_order"].version == version

    def version_after(old: str, new: str) -> str:
        changed = tmp_path / f"fp{abs(hash(new))}.py"
        text = FINGERPRINTED.replace(old, new)
        assert text != FINGERPRINTED
        changed.write_text(text)
        return str(listed(changed)["fp_order"]["version"])

    # An edit of a step the workflow calls: a new version.
    assert version_after("return amount * 2", "return amount * 3") != version
    # An edit of the body: a new version.
    assert version_after("range(3)", "range(4)") != version
    # A step it does not call, a decorator's options, a whole-line comment: the same code.
    assert version_after("return x\n", "return x + 1\n") == version
    assert version_after("@mr.step(retries=1)", "@mr.step(retries=5)") == version
    assert version_after("# a comment", "# another comment") == version


@pytest.mark.parametrize("bad", ["", "two words", "v/1", "x" * 65, "é", 2])
def test_an_explicit_version_is_checked(bad: Any) -> None:
    with pytest.raises(DefinitionError, match="invalid workflow version") as err:
        mr.workflow("v21_bad", version=bad)
    assert "\n" not in str(err.value)
    assert "v21_bad" not in REGISTRY.workflows


@pytest.mark.parametrize("bad", ["yes", "false", 1, None])
def test_current_must_be_a_bool(bad: Any) -> None:
    # current="false" is truthy: taken as given it would make that version current.
    with pytest.raises(DefinitionError, match="current= must be True or False") as err:
        mr.workflow("v21_cur", version="1", current=bad)
    assert "\n" not in str(err.value)
    assert "v21_cur" not in REGISTRY.workflows


def test_two_versions_in_one_source(tmp_path: Path) -> None:
    source = write_source(tmp_path / "both", V1.replace('"order"', '"v21_two"'),
                          V2.replace('"order"', '"v21_two"'), step="v21_two_stamp")
    load_source(str(source))
    one, two = REGISTRY.versions["v21_two"]["1"], REGISTRY.versions["v21_two"]["2"]
    assert (one.fn.__name__, two.fn.__name__) == ("order_v1", "order_v2")
    # New runs start on the one declared last; each recorded version is served by its own.
    assert REGISTRY.workflows["v21_two"] is two
    assert REGISTRY.serving("v21_two", "1") is one
    assert REGISTRY.serving("v21_two", "2") is two
    assert REGISTRY.serving("v21_two", "3") is None
    assert REGISTRY.serving("nope", "1") is None
    # A run recorded before runs carried a version: the current definition.
    assert REGISTRY.serving("v21_two", "") is two
    record = ops.prepare(ops.RunRequest("v21_two"))
    assert record.wf_version == "2"
    # `list` shows every version, the current one first in its line.
    shown = listed(source)["v21_two"]
    assert shown["version"] == "2" and shown["versions"] == ["1", "2"]
    text = mrq("list", source=source).stdout
    assert "  v21_two: queue default, no timeout, kept 7 d, no input\n    version 2 (new runs " \
           "start on it); also serves 1\n" in text, text


def test_current_true_picks_the_version_new_runs_start_on(tmp_path: Path) -> None:
    source = write_source(tmp_path / "pinned",
                          V1.replace('"order", version="1"', '"v21_pin", version="1", '
                                                            'current=True'),
                          V2.replace('"order"', '"v21_pin"'), step="v21_pin_stamp")
    load_source(str(source))
    assert REGISTRY.workflows["v21_pin"].version == "1"
    assert sorted(REGISTRY.versions["v21_pin"]) == ["1", "2"]
    twice = write_source(tmp_path / "twice",
                         V1.replace('"order", version="1"', '"v21_cur", version="1", '
                                                           'current=True'),
                         V2.replace('"order", version="2"', '"v21_cur", version="2", '
                                                           'current=True'), step="v21_cur_stamp")
    with pytest.raises(DefinitionError, match="more than one version says current=True"):
        load_source(str(twice))


def test_the_same_name_and_version_twice_is_refused(tmp_path: Path) -> None:
    dup = write_source(tmp_path / "dup", V1.replace('"order"', '"v21_dup"'),
                       V1.replace('"order"', '"v21_dup"').replace("order_v1", "again"),
                       step="v21_dup_stamp")
    with pytest.raises(DefinitionError) as err:
        load_source(str(dup))
    text = str(err.value)
    assert "duplicate workflow 'v21_dup' version '1'" in text and text.count("flows.py:") == 2
    # Two without a version: a duplicate name, as before versions (with the way out).
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "flows.py").write_text(textwrap.dedent('''
        import marbles_rq as mr

        @mr.workflow("v21_plain")
        def a(ctx): return 1

        @mr.workflow("v21_plain")
        def b(ctx): return 2
    '''))
    with pytest.raises(DefinitionError, match=r"duplicate workflow name 'v21_plain'.*"
                                              r"give each a version="):
        load_source(str(plain))


def test_a_registry_without_declared_versions_serves_by_name() -> None:
    """A registry built by hand (a client's stand-in from the catalog) still serves: its one
    definition is its current version."""
    @mr.workflow("v21_hand", version="7")
    def hand(ctx: mr.RunContext) -> int:
        return 7

    registry = Registry(workflows={"v21_hand": hand})
    assert registry.serving("v21_hand", "7") is hand
    assert registry.serving("v21_hand", "") is hand
    assert registry.serving("v21_hand", "6") is None
    assert registry.versions == {"v21_hand": {"7": hand}}


# --------------------------------------------------------------------------------------------
# which versions the live workers serve


def test_a_lapsed_or_unknown_workers_entry_does_not_count(redis_server: RedisServer) -> None:
    store = open_store(redis_server.url)
    runs = RunStore(store)
    keys = runs.keys
    now_ms = int(store.client.time()[0]) * 1000
    store.client.zadd(keys.workers, {"alive": now_ms + 60_000, "lapsed": now_ms - 1})
    store.client.hset(keys.worker_versions, mapping={
        "alive": msgspec.json.encode({"order": ["2"]}),
        "lapsed": msgspec.json.encode({"order": ["1"]}),
        "gone": msgspec.json.encode({"order": ["0"]})})
    live = live_versions(runs)
    assert live.served == {"order": {"2": ["alive"]}}
    assert live.serves("order", "2") and not live.serves("order", "1")
    assert live.serves("order", "") and not live.serves("other", "")
    store.client.zadd(keys.workers, {"old-worker": now_ms + 60_000})  # says nothing
    assert live_versions(runs).silent == ["old-worker"]


# --------------------------------------------------------------------------------------------
# a rolling deploy


def _status(procs: Procs, run_id: str) -> dict[str, Any]:
    done = procs.cli("status", run_id, "--json")
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _waiting_on_question(procs: Procs, run_id: str) -> None:
    def check() -> bool:
        view = procs.observer.view(run_id)
        return view is not None and view.status == "waiting" and view.wait_reason == "question"

    wait_for(check, timeout=60, what=f"run {run_id} to wait on its question",
             context=lambda: procs.observer.dump(run_id))


def _answer(procs: Procs, run_id: str, value: str) -> None:
    done = procs.cli("answer", run_id, "ship", value)
    assert done.returncode == 0, done.stderr


def _result(procs: Procs, run_id: str) -> dict[str, Any]:
    view = procs.observer.wait_status(run_id, "succeeded", "failed", timeout=60)
    assert view.status == "succeeded", procs.observer.dump(run_id)
    data: dict[str, Any] = view.to_json()
    return data


def test_a_rolling_deploy_finishes_old_runs_on_old_code(redis_server: RedisServer,
                                                         tmp_path: Path) -> None:
    v1 = write_source(tmp_path / "v1", V1)
    v2 = write_source(tmp_path / "v2", V2)
    both = write_source(tmp_path / "v1v2", V1, V2)
    old = Procs(redis_server.url, tmp_path / "procs-v1", sources=[v1])
    new = Procs(redis_server.url, tmp_path / "procs-v2", sources=[v2])
    fleet = Procs(redis_server.url, tmp_path / "procs-v1v2", sources=[both])
    try:
        _rolling_deploy(old, new, fleet)
    finally:
        for p in (old, new, fleet):
            p.stop_all()
        for p in (old, new, fleet):
            print(p.report(lines=30))


def _rolling_deploy(old: Procs, new: Procs, fleet: Procs) -> None:
    obs = new.observer
    # Version 1 deployed: two runs start on it and wait on their question.
    old_worker = old.worker()
    new.controller()  # hands deferred runs back to the queue
    for rid in ("r1", "r2"):
        done = old.cli("enqueue", "order", "--id", rid)
        assert done.returncode == 0, done.stderr
    for rid in ("r1", "r2"):
        _waiting_on_question(old, rid)
        assert _status(old, rid)["version"] == "1"
    assert "version 1" in old.cli("status", "r1").stdout

    # Version 2 deployed beside it, then version 1's workers stopped.
    new.worker()
    old_name = old_worker.name
    old_worker.stop()
    old_worker.wait_exit(30)

    def entries() -> list[Any] | None:
        served = obs.client.hgetall(obs.runs.keys.worker_versions)
        return None if old_name.encode() in served else list(map(json.loads, served.values()))

    # A stopped worker's entry goes with it.
    assert wait_for(entries, timeout=30, what="the v1 worker's entry to go") == [
        {"order": ["2"]}]

    # New runs, from the new source, start on version 2.
    assert new.cli("enqueue", "order", "--id", "n1").returncode == 0
    _waiting_on_question(new, "n1")
    assert _status(new, "n1")["version"] == "2"
    _answer(new, "n1", "go")
    assert _result(new, "n1")["result"]["code"] == "v2"

    # A run of version 1 answered while only version 2 is served: handed back, not failed.
    _answer(new, "r1", "yes")

    def handed_back() -> dict[str, Any] | None:
        data = _status(new, "r1")
        return data if data["status"] == "queued" and data["note"] else None

    data = wait_for(handed_back, timeout=60, what="r1 to be handed back",
                    context=lambda: obs.dump("r1"))
    assert data["version"] == "1" and data["error"] is None
    assert "version '1' of workflow 'order'" in data["note"], data["note"]
    assert "serves '2'" in data["note"], data["note"]
    assert "version '1' of workflow 'order'" in new.cli("status", "r1").stdout
    # It stays handed back, however often the version 2 worker is offered it.
    wait_for(lambda: int(obs.client.hget(obs.runs.keys.run("r1"), "deferred") or 0) >= 2,
             timeout=60, what="r1 to be handed back twice", context=lambda: obs.dump("r1"))
    assert obs.status("r1") in ("queued", "running")
    assert _status(new, "r1")["attempt"] == 1  # hand-backs are not counted as deliveries

    # doctor names the versions live workers serve and warns about the waiting runs.
    doctor = new.cli("doctor")
    assert doctor.returncode == 0, doctor.stderr
    assert "order: version 2 (1 worker)" in doctor.stdout, doctor.stdout
    warnings = [line for line in doctor.stderr.splitlines() if "'order'" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: 2 not finished runs of workflow 'order' version '1': no live worker serves "
        "it, so they wait (e.g. run r"), doctor.stderr
    report = json.loads(new.cli("doctor", "--json").stdout)
    assert report["workflows"]["order"].keys() == {"2"}
    assert [(u["workflow"], u["version"], u["runs"]) for u in report["unserved"]] == [
        ("order", "1", 2)]

    # A run recorded before runs carried a version is served by the current definition.
    stand_in = catalog.lookup(obs.client, obs.runs.keys, "order")  # what v2 declared
    assert stand_in.version == "2"
    record = msgspec.structs.replace(
        ops.prepare(ops.RunRequest("order"), Registry(workflows={"order": stand_in})),
        id="legacy", wf_version="")
    ops.enqueue_record(obs.runs, rq_connection(new.url), record)
    _waiting_on_question(new, "legacy")
    _answer(new, "legacy", "ok")
    assert _result(new, "legacy")["result"]["code"] == "v2"

    # The fleet that serves both: the old runs finish on version 1's code.
    fleet.worker()
    r1 = _result(new, "r1")
    assert r1["result"] == {"code": "v1", "before": "v1-before", "answer": "yes",
                            "after": "v1-after"}
    assert r1["version"] == "1"
    _answer(new, "r2", "later")
    assert _result(new, "r2")["result"]["code"] == "v1"
    # Its doctor warns no more; new runs from the fleet's source still go to version 2.
    doctor = fleet.cli("doctor")
    assert "'order'" not in doctor.stderr, doctor.stderr
    assert "order: version 1 (1 worker), version 2 (2 workers)" in doctor.stdout, doctor.stdout
    assert fleet.cli("enqueue", "order", "--id", "n2").returncode == 0
    assert _status(fleet, "n2")["version"] == "2"

    # The version in `runs --json`, the table, the HTTP API and the dashboard.
    rows = {r["id"]: r for r in json.loads(new.cli("runs", "--json").stdout)}
    assert {rid: rows[rid]["version"] for rid in ("r1", "r2", "n1", "n2", "legacy")} == {
        "r1": "1", "r2": "1", "n1": "2", "n2": "2", "legacy": ""}
    web = start_web(new, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    with httpx.Client(base_url=web.url, timeout=10,
                      headers={"Authorization": f"Bearer {API_TOKEN}"}) as api:
        assert api.get("/api/runs/r1").json()["version"] == "1"
        page = api.get("/api/runs", params={"workflow": "order"}).json()
        assert {r["id"]: r["version"] for r in page["runs"]}["n1"] == "2"
    browser = web.signed_in()
    try:
        html = browser.get("/runs/r1").text
    finally:
        browser.close()
    assert '<dd class="mono" id="run-version">1</dd>' in html, html
