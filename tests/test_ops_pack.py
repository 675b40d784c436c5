"""The monitoring pack under ops/: the Prometheus alert rules pass `promtool check rules` and
their unit tests (`promtool test rules`), every PromQL expression of the Grafana dashboard
parses, and every metric name either uses is one that a real controller's or worker's
/metrics endpoint serves. The endpoints' new gauges (lane leader, live workers per lane,
open questions and the oldest one's age, Redis memory) and the labelled counters that start
at zero are checked on the same processes.

promtool comes from Debian's `prometheus` package (ops/test installs it as root): without
it these tests skip locally and fail in CI (CI=true)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import CHAIN_SOURCE, REPO_ROOT, Procs, wait_for
from tests.redis_procs import free_port
from tests.test_metrics import Samples, await_metric, scrape, value
from tests.web_stack import ci

PROCS_SOURCES = (CHAIN_SOURCE, REPO_ROOT / "tests" / "wait_workflows.py")
ALERTS = REPO_ROOT / "ops" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO_ROOT / "ops" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO_ROOT / "ops" / "grafana" / "marbles-rq.json"
METRIC = re.compile(r"\bmarbles_rq_[a-z0-9_]+")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool is missing (apt-get install -y prometheus; ops/test does as root)"
        if ci():
            pytest.fail(message + " (CI=true: the alert rules must be checked)", pytrace=False)
        pytest.skip(message)
    return found


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    for variable in doc["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def alert_exprs() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


def test_the_alert_rules_pass_promtool() -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 10 rules found" in checked.stdout
    # The unit tests fire the lane, worker, failure and memory alerts on made-up series,
    # and check they stay quiet where they must.
    tested = subprocess.run([tool, "test", "rules", ALERTS_TEST.name], capture_output=True,
                            text=True, timeout=60, cwd=ALERTS_TEST.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    names = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"]
             for r in g["rules"]}
    assert {"MarblesNoLaneLeader", "MarblesNoLiveWorker", "MarblesQueueDepthRising",
            "MarblesOldOpenQuestion", "MarblesFailureRate", "MarblesRedeliveryRate",
            "MarblesRedisErrors", "MarblesRedisMemoryHeadroom"} <= names


def test_the_scrape_config_loads_the_rules() -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "config", "prometheus.yml"], capture_output=True,
                             text=True, timeout=60, cwd=REPO_ROOT / "ops")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 10 rules found" in checked.stdout


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """Grafana's own variables ($__rate_interval, $workflow) replaced by what they expand to,
    each panel's query is checked by promtool as a recording rule's expression."""
    tool = promtool()
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "marbles-rq" and doc["panels"]
    for panel in doc["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel
    # (A variable's label_values(metric, label) is Grafana's: its metric is what is queried.)
    exprs = [re.sub(r"^label_values\((\w+), *\w+\)$", r"\1", e)
             .replace("$__rate_interval", "5m").replace("$workflow", ".*")
             for e in dashboard_exprs()]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([tool, "check", "rules", str(path)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _served(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_the_pack_uses_only_metrics_the_processes_export(procs: Procs) -> None:
    ctl_port, worker_port = free_port(), free_port()
    worker = procs.worker(extra=["--metrics-port", str(worker_port)])
    procs.controller(extra=["--metrics-port", str(ctl_port)])

    ctl = await_metric(ctl_port, lambda s: value(s, "marbles_rq_lane_leader", lane="0") == 1
                       and value(s, "marbles_rq_live_workers", lane="0") == 1,
                       "the controller to lead lane 0 and see the worker")
    work = scrape(worker_port)
    served = _served(ctl) | _served(work)
    used = {m for e in dashboard_exprs() + alert_exprs() for m in METRIC.findall(e)}
    assert used, "no metric found in the pack"
    assert used <= served, f"not exported: {sorted(used - served)}"

    # Labelled counters exist at 0 before anything happened (an increase() over a series
    # born at its first count misses that count).
    assert ("marbles_rq_runs_finished_total",
            frozenset({("workflow", "wq_approval"), ("status", "failed")})) in work
    assert value(work, "marbles_rq_runs_finished_total", workflow="wq_approval",
                 status="failed") == 0
    for kind in ("timeout", "connection", "oom", "readonly", "other"):
        assert ("marbles_rq_redis_errors_total", frozenset({("kind", kind)})) in ctl, kind
    assert ("marbles_rq_redeliveries_total",
            frozenset({("queue", "default"), ("cause", "worker_lost")})) in ctl
    assert value(ctl, "marbles_rq_open_questions") == 0
    assert value(ctl, "marbles_rq_oldest_open_question_age_seconds") == 0
    memory = [(n, dict(lbl)) for n, lbl in ctl if n == "marbles_rq_redis_memory_used_bytes"]
    assert len(memory) == 1 and value(ctl, memory[0][0], **memory[0][1]) > 0
    limit = value(ctl, "marbles_rq_redis_memory_limit_bytes", **memory[0][1])
    assert limit > value(ctl, memory[0][0], **memory[0][1])

    # A question asked: counted, and its age grows from the time it was asked.
    done = procs.cli("enqueue", "wq_approval", "--id", "ops-q")
    assert done.returncode == 0, done.stderr
    procs.observer.wait_status("ops-q", "waiting")
    first = await_metric(ctl_port, lambda s: value(s, "marbles_rq_open_questions") == 1
                         and value(s, "marbles_rq_oldest_open_question_age_seconds") > 0,
                         "the open question on the controller's endpoint")
    age = value(first, "marbles_rq_oldest_open_question_age_seconds")
    await_metric(ctl_port, lambda s: value(
        s, "marbles_rq_oldest_open_question_age_seconds") > age + 0.5,
        "the question's age to grow")

    # The worker stops: lane 0 has no live worker (its beat lapses or is taken off).
    worker.stop()
    await_metric(ctl_port, lambda s: value(s, "marbles_rq_live_workers", lane="0") == 0,
                 "lane 0 to have no live worker")


def test_two_controllers_lead_each_lane_once(redis_server: Any, tmp_path: Path) -> None:
    """Three lanes shared by two controllers: summed over both endpoints, each lane has one
    leader (what the alert and the dashboard sum); stopping one hands its lanes over."""
    procs = Procs(redis_server.url, tmp_path / "procs", sources=PROCS_SOURCES)
    procs.env.update(MARBLES_LANE_COUNT="3")
    ports = [free_port(), free_port()]
    try:
        ctls = [procs.controller(ready=False, extra=["--metrics-port", str(p)])
                for p in ports]

        def leaders(live: list[int]) -> dict[str, float] | None:
            """Leaders per lane summed over `live`'s endpoints, once each leads a lane."""
            per_lane: dict[str, float] = {}
            for port in live:
                led = 0.0
                for (name, labels), v in scrape(port).items():
                    if name == "marbles_rq_lane_leader":
                        lane = dict(labels)["lane"]
                        per_lane[lane] = per_lane.get(lane, 0) + v
                        led += v
                if not led:
                    return None  # not shared yet: the first to start took every lane
            return per_lane if per_lane == {"0": 1, "1": 1, "2": 1} else None

        wait_for(lambda: leaders(ports), timeout=60, what="the lanes shared, one leader each")
        ctls[1].stop()
        wait_for(lambda: leaders(ports[:1]), timeout=60, what="the survivor to lead all")
    finally:
        procs.stop_all()
        print(procs.report())
