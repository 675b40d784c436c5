"""Rate limits per key (flow/rate_limits.py): the limiter script on a server and on a
3-master cluster; 20/s over 2,000 runs on 4 forking workers and on --pool 4, with kill -9 of
the controller and of a worker mid-test, measured from step starts recorded server-side;
held runs released in order of arrival per key; `limits` from the CLI; bad input; the test
kit on its virtual clock."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import marbles_rq as mr
from marbles_rq.engine.authoring import DefinitionError, load_source
from marbles_rq.engine.ops import RunRequest
from marbles_rq.engine.runs import RunStore
from marbles_rq.flow.rate_specs import Rate, RateError, interval_us, rate_id
from marbles_rq.store import open_store
from tests.procs import Procs, wait_for
from tests.redis_procs import RedisServer
from tests.test_web_browser import browser, shots  # noqa: F401 (fixtures)

RATE_SOURCE = Path(__file__).with_name("rate_workflows.py")
PROCS_SOURCES = (RATE_SOURCE,)


@pytest.fixture(autouse=True)
def _registry() -> None:
    load_source(str(RATE_SOURCE))  # the test process enqueues these workflows itself


def _enqueue(url: str, requests: list[RunRequest], rq_url: str | None = None) -> None:
    with mr.connect(url, rq_url=rq_url) as client:
        handles = client.start_many([mr.StartRequest(r.name, input_json=r.input, id=r.run_id)
                                     for r in requests])
    assert all(h.created for h in handles)


def _starts(procs: Procs, ids: list[str], step: str) -> dict[str, int]:
    """Each run's start of `step` (its first try), in server ms, from its step_started event:
    the admission instant for a step a rate limit let through."""
    out: dict[str, int] = {}
    for rid in ids:
        for ev in procs.observer.events(rid):
            if ev.type == "step_started" and ev.data.get("step") == step:
                out[rid] = int(ev.data.get("started_ms") or ev.at_ms)
                break
    return out


def _most_in_window(starts: list[int], window_ms: int) -> int:
    """The most starts in any half-open window [t, t + window_ms)."""
    starts = sorted(starts)
    most, lo = 0, 0
    for hi, t in enumerate(starts):
        while starts[lo] <= t - window_ms:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


# --------------------------------------------------------------------------------------------
# rate strings


def test_rate_strings() -> None:
    assert interval_us("20/s") == 50_000
    assert interval_us("100/min") == 600_000
    assert interval_us("5/10s") == 2_000_000
    assert interval_us(" 3 / h ") == 1_200_000_000
    for bad in ("fast", "0/s", "-1/s", "10/d", "10", "/s", "1.5/s", "10/0s", "", None, 5):
        with pytest.raises(RateError, match="invalid rate"):
            interval_us(bad)
    assert Rate("25/s", burst=5).spec() == "25/s burst 5"
    with pytest.raises(RateError, match="invalid burst"):
        Rate("25/s", burst=0)


def test_bad_definitions_are_refused_at_load() -> None:
    with pytest.raises(DefinitionError, match="invalid rate 'fast'"):
        mr.workflow("bad_rate", rate_limit="fast")(lambda ctx: None)
    with pytest.raises(DefinitionError, match="rate_key needs rate_limit"):
        mr.workflow("bad_key", rate_key="customer")(lambda ctx, inp: None)
    with pytest.raises(DefinitionError, match="takes no input"):
        mr.workflow("bad_key2", rate_limit="1/s", rate_key="customer")(lambda ctx: None)
    with pytest.raises(DefinitionError, match="invalid rate 5"):
        mr.workflow("bad_type", rate_limit=5)(lambda ctx: None)


# --------------------------------------------------------------------------------------------
# the script


def _script_calls(url: str, prefix: str) -> None:
    store = open_store(url, prefix=prefix)
    keys, scripts = store.keys, store.scripts
    ident = rate_id("t")
    lim = dict(state_key=keys.rate_state(ident), queue_key=keys.rate_queue(ident),
               admitted_key=keys.rate_admitted(ident))

    def take(token: str, interval: int = 10_000_000, burst: int = 1, stale: int = 60_000,
             lookahead: int = 0) -> Any:
        return scripts.take_rate(**lim, token=token, interval_us=interval, burst=burst,
                                 stale_ms=stale, keep_ms=60_000, lookahead_us=lookahead)

    first = take("a")
    assert first.status == "admitted" and int(first.values[1]) == 1
    assert take("a").status == "admitted" and int(take("a").values[1]) == 0  # a resend
    held = [take(t) for t in ("b", "c", "d")]
    assert [(h.status, int(h.values[1])) for h in held] == [("held", 0), ("held", 1),
                                                          ("held", 2)]
    # a queued run asking again keeps its place; the estimates grow with it
    assert int(take("c").values[1]) == 1
    assert int(held[0].values[0]) < int(held[1].values[0]) < int(held[2].values[0])
    assert store.client.zcard(lim["queue_key"]) == 3
    # a head that does not come back for its turn is dropped after stale_ms, so the run
    # behind it passes (a limit of one per 20 ms: its turn comes soon)
    ident1 = rate_id("s")
    lim.update(state_key=keys.rate_state(ident1), queue_key=keys.rate_queue(ident1),
               admitted_key=keys.rate_admitted(ident1))
    assert [take(t, interval=20_000).status for t in ("x", "y", "z")] == [
        "admitted", "held", "held"]
    time.sleep(0.05)  # y's turn passes on the server's clock; y does not come back
    assert take("z", interval=20_000, stale=60_000).status == "held"  # not stale yet
    assert take("z", interval=20_000, stale=0).status == "admitted"
    assert store.client.zcard(lim["queue_key"]) == 0
    # burst 3 (a new limit): three at once, then one per interval, the queue's head first
    ident2 = rate_id("u")
    lim.update(state_key=keys.rate_state(ident2), queue_key=keys.rate_queue(ident2),
               admitted_key=keys.rate_admitted(ident2))
    got = [take(t, burst=3).status for t in ("p", "q", "r", "s")]
    assert got == ["admitted", "admitted", "admitted", "held"]
    # the head chain: a lookahead of two intervals releases the first two queued runs (the
    # caller wakes them); the rest wait for the chain (their near flag is 0); an admission
    # releases the runs newly within the lookahead, each once
    ident3 = rate_id("c")
    lim.update(state_key=keys.rate_state(ident3), queue_key=keys.rate_queue(ident3),
               admitted_key=keys.rate_admitted(ident3))
    chain = dict(interval=20_000, lookahead=40_000)
    assert take("h0", **chain).status == "admitted"
    held = [take(t, **chain) for t in ("h1", "h2", "h3", "h4")]
    assert [int(h.values[3]) for h in held] == [1, 1, 0, 0]
    time.sleep(0.03)
    first = take("h1", **chain)
    assert first.status == "admitted" and [v.decode() for v in first.values[2:]] == ["h3"]
    assert take("h1", **chain).values[2:] == []  # a resend releases nobody again


def test_take_rate_script(redis_url: str) -> None:
    _script_calls(redis_url, "rate1")


def test_take_rate_script_on_a_cluster(cluster_url: str) -> None:
    """Each limit is one hash tag: the script runs on a cluster with no cross-slot call."""
    _script_calls(cluster_url, "rate2")


# --------------------------------------------------------------------------------------------
# 20/s across workers, with kills


def _rate_run(procs: Procs, ids: list[str], *, kill: bool, pool: int | None,
              workers: list[Any]) -> None:
    obs = procs.observer
    _enqueue(procs.url, [RunRequest("paced", str(i).encode(), rid)
                         for i, rid in enumerate(ids)], procs.env.get("MARBLES_RQ_URL"))
    if kill:
        # mid-test: the controller, then a worker (its horse or executors go with it)
        wait_for(lambda: obs.status(ids[len(ids) // 4]) == "succeeded" or None,
                 timeout=600, what="a quarter of the runs done")
        ctl = next(p for p in procs.procs if p.role == "controller")
        ctl.kill9()
        procs.controller()
        wait_for(lambda: obs.status(ids[len(ids) // 2]) == "succeeded" or None,
                 timeout=600, what="half of the runs done")
        victim = workers[0]
        for pid in [*victim.children(), victim.pid]:
            with_suppress_kill(pid)
        victim.popen.wait(timeout=10)
        procs.worker(pool=pool)
    for rid in ids:
        obs.wait_status(rid, "succeeded", timeout=900)


def with_suppress_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _check_bound(procs: Procs, ids: list[str], step: str, rate: int) -> dict[str, Any]:
    starts = _starts(procs, ids, step)
    assert set(starts) == set(ids), "a run has no recorded start of its step"
    most = _most_in_window(list(starts.values()), 1000)
    span_s = (max(starts.values()) - min(starts.values())) / 1000
    store = RunStore(open_store(procs.url))
    pipe = store.client.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(store.keys.run(rid), "attempt")
    deliveries = sum(int(a) for a in pipe.execute())
    figures = {"runs": len(ids), "most_per_1s_window": most, "span_s": round(span_s, 1),
               "admitted_per_s": round((len(ids) - 1) / span_s, 2) if span_s else None,
               "deliveries_per_run": round(deliveries / len(ids), 2)}
    print(json.dumps(figures))
    assert most <= rate, figures
    assert most >= rate - 2, figures  # the limit is used, not just never exceeded
    return figures


@pytest.mark.parametrize("pool", [None, 4], ids=["4-forking-workers", "pool-4"])
def test_twenty_a_second_across_workers_with_kills(procs: Procs, pool: int | None) -> None:
    workers = procs.start(workers=1 if pool else 4, pool=pool)
    if pool:  # two supervisors of 4 executors: one is killed mid-test
        workers.append(procs.worker(pool=pool))
    ids = [f"r{i}" for i in range(2000)]
    _rate_run(procs, ids, kill=True, pool=pool, workers=workers)
    _check_bound(procs, ids, "paced.call_api#0", 20)
    # every admission recorded once, and the limit holds nobody now
    store = RunStore(open_store(procs.url))
    assert store.client.zcard(store.keys.rate_queue(rate_id("paced"))) == 0
    assert int(store.client.hget(store.keys.rate_state(rate_id("paced")), "admissions")) \
        >= len(ids)


@pytest.mark.parametrize("pool", [None, 4], ids=["4-forking-workers", "pool-4"])
def test_twenty_a_second_on_a_cluster(cluster_url: str, redis_server: RedisServer,
                                      tmp_path: Path, pool: int | None) -> None:
    procs = Procs(cluster_url, tmp_path / "procs", sources=PROCS_SOURCES)
    procs.env["MARBLES_RQ_URL"] = redis_server.url  # RQ on a standalone Redis (README)
    procs.env["MARBLES_TEST_EFFECTS_URL"] = redis_server.url  # the observer's plain client
    try:
        workers = procs.start(workers=1 if pool else 4, pool=pool)
        if pool:
            workers.append(procs.worker(pool=pool))
        ids = [f"c{i}" for i in range(2000)]
        _rate_run(procs, ids, kill=True, pool=pool, workers=workers)
        _check_bound(procs, ids, "paced.call_api#0", 20)
    finally:
        procs.stop_all()
        print(procs.report())


def test_limit_inside_a_body_sync_and_async(procs: Procs) -> None:
    procs.start(workers=1, pool=4)
    ids = [f"s{i}" for i in range(60)] + [f"a{i}" for i in range(60)]
    _enqueue(procs.url, [RunRequest("inner_limited" if rid[0] == "s" else "inner_async",
                                    b"1", rid) for rid in ids])
    for rid in ids:
        procs.observer.wait_status(rid, "succeeded", timeout=300)
    sync = _starts(procs, ids[:60], "inner_limited.call_api#1")
    asyn = _starts(procs, ids[60:], "inner_async.call_api#0")
    # one limit ("api") shared by both workflows
    assert _most_in_window([*sync.values(), *asyn.values()], 1000) <= 20
    assert procs.observer.view("s0") is not None
    assert procs.cli("status", "s0").returncode == 0


# --------------------------------------------------------------------------------------------
# order of arrival per key


def test_held_runs_released_in_arrival_order_per_key(procs: Procs) -> None:
    procs.start(workers=1)  # one forking worker: arrival order is the enqueue order
    ids = [f"o{i}" for i in range(16)]
    customers = {rid: ("acme" if i % 2 else "zeta") for i, rid in enumerate(ids)}
    _enqueue(procs.url, [RunRequest("slow_customer", json.dumps(
        {"customer": customers[rid], "n": i}).encode(), rid) for i, rid in enumerate(ids)])
    obs = procs.observer
    last = ids[-1]
    wait_for(lambda: obs.status(last) in ("waiting", "succeeded") or None, timeout=60,
             what="the last run reached its limit")
    done = procs.cli("status", last)
    assert " waiting " in done.stdout, done.stdout  # 8 runs of acme at 1/s: it waits
    assert "rate_limit; limit slow_customer[customer=acme], place " in done.stdout, done.stdout
    watched = procs.cli("watch", last, "--no-follow")
    assert "parked: waiting for rate limit slow_customer[customer=acme] (place " in \
        watched.stdout, watched.stdout
    for rid in ids:
        obs.wait_status(rid, "succeeded", timeout=120)
    admitted: dict[str, int] = {}
    held = 0
    for rid in ids:
        events = obs.events(rid)
        held += any(e.type == "parked" for e in events)
        ev = next(e for e in events if e.type == "rate_admitted")
        admitted[rid] = int(ev.data["at_ms"])
        assert ev.data["limit"] == f"slow_customer[customer={customers[rid]}]"
    assert held >= len(ids) // 2, held  # the limit held most of them: the order is tested
    for customer in ("acme", "zeta"):
        mine = [rid for rid in ids if customers[rid] == customer]
        assert sorted(mine, key=lambda r: admitted[r]) == mine  # arrival order
        gaps = [admitted[b] - admitted[a] for a, b in itertools.pairwise(mine)]
        assert min(gaps) >= 1000  # 1/s
    # the two keys do not wait for each other: they interleave
    both = sorted(ids, key=lambda r: admitted[r])
    assert {customers[r] for r in both[:4]} == {"acme", "zeta"}


# --------------------------------------------------------------------------------------------
# the CLI


def test_limits_cli_list_set_reset_and_bad_input(procs: Procs) -> None:
    procs.start(workers=1)
    _enqueue(procs.url, [RunRequest("rate_per_customer", b'{"customer": "acme"}', "l1")])
    procs.observer.wait_status("l1", "succeeded", timeout=60)
    listed = procs.cli("limits", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["paced"]["rate"] == "20/s" and rows["paced"]["held"] == 0
    acme = rows["rate_per_customer[customer=acme]"]
    assert (acme["rate"], acme["family"], acme["admissions"]) == ("4/s", "rate_per_customer", 1)
    assert acme["last_admission_ms"]
    changed = procs.cli("limits", "set", "rate_per_customer", "2/min", "--burst", "3", "--json")
    assert changed.returncode == 0, changed.stderr
    rows = {r["name"]: r for r in json.loads(procs.cli("limits", "--json").stdout)}
    acme = rows["rate_per_customer[customer=acme]"]
    assert (acme["rate"], acme["burst"], acme["overridden"], acme["source"]) == (
        "2/min", 3, True, "4/s")
    text = procs.cli("limits")
    assert "rate_per_customer[customer=acme]  2/min burst 3 (set at run time; source: 4/s)" \
        in text.stdout
    back = procs.cli("limits", "reset", "rate_per_customer", "--json")
    assert back.returncode == 0 and json.loads(back.stdout)["rate"] == "4/s"
    for args, needle in [(("limits", "set", "paced", "fast"), "invalid rate 'fast'"),
                         (("limits", "set", "paced", "0/s"), "invalid rate '0/s'"),
                         (("limits", "set", "paced", "5/s", "--burst", "0"), "invalid burst"),
                         (("limits", "set", "nosuch", "5/s"), "unknown rate limit 'nosuch'"),
                         (("limits", "reset", "nosuch"), "unknown rate limit 'nosuch'")]:
        done = procs.cli(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr
    # an input without its rate key is refused at enqueue, nothing recorded
    done = procs.cli("enqueue", "per_region", "--input", '{"n": 1}', "--id", "nokey")
    assert done.returncode == 2 and "rate per input field 'region'" in done.stderr, \
        done.stderr
    assert done.stderr.count("\n") == 1
    assert procs.observer.view("nokey") is None
    # nothing was changed by the refused commands
    rows = {r["name"]: r for r in json.loads(procs.cli("limits", "--json").stdout)}
    assert not any(r["overridden"] for r in rows.values())


def test_a_rate_set_at_run_time_applies(procs: Procs) -> None:
    procs.start(workers=1, pool=2)
    assert procs.cli("limits", "set", "paced", "5/s").returncode == 0
    ids = [f"v{i}" for i in range(15)]
    _enqueue(procs.url, [RunRequest("paced", b"1", rid) for rid in ids])
    for rid in ids:
        procs.observer.wait_status(rid, "succeeded", timeout=120)
    starts = _starts(procs, ids, "paced.call_api#0")
    assert _most_in_window(list(starts.values()), 1000) <= 5


# --------------------------------------------------------------------------------------------
# the test kit: virtual time


def test_the_kit_applies_limits_by_virtual_time() -> None:
    from marbles_rq.testing import Environment

    env = Environment()
    handles = [env.start("rate_per_customer", {"customer": "k", "n": i}) for i in range(6)]
    env.run_until_idle()
    assert [env.status(h).status for h in handles] == ["succeeded"] + ["waiting"] * 5
    env.advance(0.25)
    assert [env.status(h).status for h in handles].count("succeeded") == 2
    env.advance(2)
    assert [env.result(h) for h in handles] == list(range(6))
    at = [next(e for e in env.output(h) if e.type == "rate_admitted").data["at_ms"]
          for h in handles]
    assert [b - a for a, b in itertools.pairwise(at)] == [250] * 5


# --------------------------------------------------------------------------------------------
# the HTTP API and the clients


def test_limits_over_http_and_from_both_clients(procs: Procs) -> None:
    import asyncio

    from marbles_rq.flow.rate_store import UnknownRateLimitError
    from tests.test_web_api import API_TOKEN, curl
    from tests.web_stack import start_web

    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    procs.controller()
    procs.worker()
    _enqueue(procs.url, [RunRequest("rate_per_customer", b'{"customer": "acme"}', "h1")])
    procs.observer.wait_status("h1", "succeeded", timeout=60)
    got = curl(web, "GET", "/api/limits")
    assert got.status == 200, got.body
    names = {r["name"]: r for r in got.json()["limits"]}
    assert names["rate_per_customer[customer=acme]"]["admissions"] == 1
    put = curl(web, "PUT", "/api/limits/paced", {"rate": "5/s", "burst": 2})
    assert put.status == 200, put.body
    assert (put.json()["rate"], put.json()["burst"], put.json()["overridden"]) == ("5/s", 2,
                                                                                 True)
    for body, status, code in [({"rate": "fast"}, 400, "invalid_rate"),
                               ({"rate": "5/s", "burst": 0}, 400, "invalid_rate"),
                               ({"rat": "5/s"}, 400, "invalid_request")]:
        refused = curl(web, "PUT", "/api/limits/paced", body)
        assert (refused.status, refused.error()["code"]) == (status, code), refused.body
    assert curl(web, "PUT", "/api/limits/paced", raw=b"{nope").error()["code"] == \
        "malformed_json"
    unknown = curl(web, "PUT", "/api/limits/nosuch", {"rate": "5/s"})
    assert (unknown.status, unknown.error()["code"]) == (404, "unknown_rate_limit")
    assert curl(web, "DELETE", "/api/limits/nosuch").status == 404
    # the refusals changed nothing
    after = {r["name"]: r for r in curl(web, "GET", "/api/limits").json()["limits"]}
    assert (after["paced"]["rate"], after["paced"]["burst"]) == ("5/s", 2)
    reset = curl(web, "DELETE", "/api/limits/paced")
    assert reset.status == 200 and reset.json()["overridden"] is False
    assert reset.json()["rate"] == "20/s"

    with mr.connect(procs.url) as client:
        assert client.set_rate_limit("paced", "10/min").rate == "10/min"
        with pytest.raises(RateError, match="invalid rate"):
            client.set_rate_limit("paced", "often")
        with pytest.raises(UnknownRateLimitError, match="unknown rate limit 'nosuch'"):
            client.reset_rate_limit("nosuch")

    async def from_asyncio() -> None:
        async with mr.connect_async(procs.url) as client:
            listed = {i.name: i for i in await client.rate_limits()}
            assert listed["paced"].rate == "10/min" and listed["paced"].overridden
            assert (await client.reset_rate_limit("paced")).rate == "20/s"
            with pytest.raises(UnknownRateLimitError):
                await client.set_rate_limit("nosuch", "1/s")

    asyncio.run(from_asyncio())
    # the dashboard's system page lists them, the rate set at run time said so
    with mr.connect(procs.url) as client:
        client.set_rate_limit("rate_per_customer", "3/min")
    page = web.signed_in().get("/system")
    assert page.status_code == 200
    assert "Rate limits" in page.text and "rate_per_customer[customer=acme]" in page.text
    assert "3/min" in page.text and "set at run time (source: 4/s)" in page.text
    info = procs.cli("info", "--json")
    assert info.returncode == 0, info.stderr
    assert {"name": "paced", "rate": "20/s", "burst": 1, "held": 0,
            "last_admission": None} in json.loads(info.stdout)["rate_limits"]


# --------------------------------------------------------------------------------------------
# the dashboard, in a browser


def test_the_dashboard_shows_rate_limits(procs: Procs, browser: Any,  # noqa: F811
                                         shots: Path) -> None:  # noqa: F811
    from tests.test_web_browser import Page, expect
    from tests.web_stack import start_web

    web = start_web(procs)
    procs.start(workers=1)
    ids = [f"b{i}" for i in range(4)]
    _enqueue(procs.url, [RunRequest("slow_customer", b'{"customer": "acme"}', rid)
                         for rid in ids])
    wait_for(lambda: procs.observer.status(ids[-1]) == "waiting" or None, timeout=60,
             what="a run held by the limit")
    with mr.connect(procs.url) as client:
        client.set_rate_limit("slow_customer", "1/s", burst=1)
    for width, name in ((1280, "wide"), (390, "narrow")):
        tab = Page(browser, web, width=width)
        tab.sign_in()
        page = tab.goto("/system")
        row = page.locator("tr", has_text="slow_customer[customer=acme]")
        expect(row).to_be_visible()
        expect(row.locator("td[data-label='Rate']")).to_contain_text(
            "set at run time (source: 1/s)")
        tab.shot(shots, f"rate-limits-system-{name}")
        tab.close()
    for rid in ids:
        procs.observer.wait_status(rid, "succeeded", timeout=60)
