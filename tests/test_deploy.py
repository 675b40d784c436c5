"""The deployable stack: compose.yaml against the Compose specification's JSON schema (no
container engine runs here) and against this repository (every command and mounted file it
names exists); the systemd units through `systemd-analyze verify`; ops/redis-cluster as a
real 3-master cluster; and the health commands the healthchecks run, against real worker and
controller processes."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import yaml

from marbles_rq.cli import _register, cli
from marbles_rq.cli.health import health
from marbles_rq.transport.worker import worker_name
from tests.procs import REPO_ROOT, Procs, _cli_argv, pid_alive
from tests.redis_procs import RedisServer, free_port

COMPOSE = REPO_ROOT / "compose.yaml"
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"
UNITS = REPO_ROOT / "ops" / "systemd"
UNIT_EXEC = "/opt/marbles-rq/venv/bin/marbles-rq"


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # resolves the <<: merges
    return data


def _schema_errors(doc: dict[str, Any]) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(doc)]


def resolve(argv: list[str]) -> str:
    """The registered command path of `marbles-rq ARGS...` (e.g. 'health worker'), or fail
    naming what does not exist."""
    _register()
    command: click.Command = cli
    path: list[str] = []
    args = list(argv)
    while isinstance(command, click.Group):
        assert args, f"`marbles-rq {' '.join(argv)}` names no subcommand of {path or 'marbles-rq'}"
        name = args.pop(0)
        found = command.get_command(click.Context(command), name)
        assert found is not None, f"`marbles-rq {' '.join(argv)}`: no command {name!r}"
        command = found
        path.append(name)
    return " ".join(path)


def _app_commands(doc: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(where, argv) of every exec-form command and healthcheck in the file."""
    found = []
    for name, service in doc["services"].items():
        if isinstance(service.get("command"), list):
            found.append((f"{name}.command", service["command"]))
        test = service.get("healthcheck", {}).get("test")
        if isinstance(test, list) and test and test[0] == "CMD":
            found.append((f"{name}.healthcheck", test[1:]))
        elif isinstance(test, list) and test and test[0] == "CMD-SHELL":
            found.append((f"{name}.healthcheck", shlex.split(test[1])))
    return found


# ------------------------------------------------------------------------------- compose


def test_compose_validates_against_the_compose_spec_schema() -> None:
    doc = _compose()
    assert _schema_errors(doc) == []
    # The check is not vacuous: the same schema refuses a misspelt key and a bad healthcheck.
    broken = json.loads(json.dumps(doc))
    broken["services"]["worker"]["comand"] = ["marbles-rq", "worker"]
    broken["services"]["redis"]["healthcheck"]["interval"] = 5
    errors = _schema_errors(broken)
    assert any("comand" in e for e in errors), errors
    assert any("interval" in e for e in errors), errors


def test_compose_stack_shape() -> None:
    doc = _compose()
    services = doc["services"]
    assert set(services) == {"redis", "controller", "worker", "web"}
    # The dashboard: published on the host's loopback only, with the token from the
    # environment (bound beyond loopback, `marbles-rq web` refuses to start without one).
    web = services["web"]
    assert web["ports"] == ["127.0.0.1:8700:8700"]
    assert web["environment"]["MARBLES_WEB_TOKEN"].startswith("${MARBLES_WEB_TOKEN")
    assert "8700/healthz" in " ".join(web["healthcheck"]["test"])
    # Two controllers: one leads, one waits.
    assert services["controller"]["deploy"]["replicas"] == 2
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        # Scaled services must not pin a name: `--scale worker=N` needs N distinct containers.
        if name != "redis":
            assert "container_name" not in service and "hostname" not in service, name
            env = service["environment"]
            assert env["MARBLES_REDIS_URL"] == "redis://redis:6379/0"
            targets = [v.split(":")[1] for v in service["volumes"]]
            assert env["MARBLES_SOURCE"] in targets, "MARBLES_SOURCE is not mounted"
            assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    redis = services["redis"]
    assert "redis-data:/data" in redis["volumes"] and "redis-data" in doc["volumes"]
    conf_mount = next(v for v in redis["volumes"] if v.startswith("./ops/redis.conf:"))
    assert conf_mount.split(":")[1] in redis["command"], "redis-server is not given the conf"
    assert "--dir" in redis["command"] and "/data" in redis["command"]


def test_compose_names_only_commands_and_files_that_exist() -> None:
    doc = _compose()
    seen = set()
    for where, argv in _app_commands(doc):
        if argv[0] != "marbles-rq":
            continue
        path = resolve(argv[1:])
        seen.add(path)
        # And through the real entry point: `--help` of that command exits 0.
        done = subprocess.run([*_cli_argv(), *argv[1:], "--help"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{where}: {done.stderr}"
    assert seen == {"controller", "worker", "web", "health controller", "health worker"}
    # The image puts `marbles-rq` on PATH: the console script of this package.
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["marbles-rq"] == "marbles_rq.cli:main"
    for name, service in doc["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO_ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in doc["volumes"], f"{name}: undeclared volume {source}"
        if "build" in service:
            assert (REPO_ROOT / service["build"] / "Dockerfile").is_file()
    # Every file the Dockerfile copies exists (the wheel needs ops/redis.conf, see pyproject).
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO_ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_the_image_has_a_healthcheck_and_a_lean_build_context() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    check = dockerfile.split("HEALTHCHECK", 1)[1].split("CMD", 1)[1].split("\n")[0]
    # Each command the check runs is a `marbles-rq health` subcommand that exists.
    commands = [part.split(">")[0].split() for part in check.split("||")]
    assert commands == [["marbles-rq", "health", "worker"], ["marbles-rq", "health", "controller"]]
    assert isinstance(health, click.Group)
    assert {"worker", "controller"} <= set(health.commands)
    # The build context leaves out the local Redis data, the virtualenv, git and caches, and
    # keeps every file the Dockerfile copies.
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".marbles", ".git", "**/__pycache__"} <= ignored
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert source.split("/")[0] not in ignored, f".dockerignore drops {source}"


def test_units_point_at_documentation_a_wheel_install_can_reach() -> None:
    """Documentation= names the docs site (pyproject's project URL), not a path in a clone
    that a wheel install does not have."""
    site = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["urls"][
        "Documentation"]
    for unit in sorted(UNITS.glob("*.service")):
        docs = [line.split("=", 1)[1].split() for line in unit.read_text().splitlines()
                if line.startswith("Documentation=")]
        assert docs and all(url.startswith(site) for url in docs[0]), unit.name
        pages = [url[len(site):].strip("/") for url in docs[0]]
        for page in pages:
            assert (REPO_ROOT / "docs" / f"{page}.md").is_file(), f"{unit.name}: {page}"


def test_worker_names_are_unique_per_start() -> None:
    """`--scale worker=N` and restarted containers: every worker start gets its own name."""
    names = {worker_name() for _ in range(50)}
    assert len(names) == 50
    host = socket.gethostname()
    for name in names:
        assert re.fullmatch(rf"{re.escape(host)}\.[0-9a-f]{{8}}\.{os.getpid()}", name), name


# ------------------------------------------------------------------------------- systemd


def _unit(path: Path) -> dict[str, list[str]]:
    """Every `Key=value` of a unit file (keys may repeat)."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.mark.parametrize(("unit", "role"), [("marbles-rq-controller.service", "controller"),
                                             ("marbles-rq-worker@.service", "worker"),
                                             ("marbles-rq-web.service", "web")])
def test_systemd_unit_baseline(unit: str, role: str) -> None:
    keys = _unit(UNITS / unit)
    assert keys["KillMode"] == ["control-group"]
    assert keys["Restart"] == ["on-failure"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("PrivateTmp", "yes"), ("PrivateDevices", "yes"),
                       ("RestrictSUIDSGID", "yes"), ("CapabilityBoundingSet", "")):
        assert keys[key] == [value], key
    assert any(f.startswith("/etc/marbles-rq/") for f in keys["EnvironmentFile"])
    exec_argv = keys["ExecStart"][0].split()
    assert exec_argv[0] == UNIT_EXEC
    assert resolve(exec_argv[1:2]) == role


def test_systemd_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd); the "
                    "units' keys are still checked by test_systemd_unit_baseline")
    script = Path(sys.executable).parent / "marbles-rq"
    if not script.exists():
        pytest.skip(f"no marbles-rq console script beside {sys.executable} to point "
                    f"ExecStart at (pip install -e .)")
    # verify checks that ExecStart's binary exists: point it at this machine's marbles-rq.
    for unit in UNITS.glob("*.service"):
        (tmp_path / unit.name).write_text(unit.read_text().replace(UNIT_EXEC, str(script)))
    units = [tmp_path / "marbles-rq-controller.service",
             tmp_path / "marbles-rq-worker@1.service",  # an instance of the template
             tmp_path / "marbles-rq-web.service"]
    done = subprocess.run([analyze, "verify", *map(str, units)], capture_output=True,
                          text=True, timeout=120)
    ours = [ln for ln in (done.stdout + done.stderr).splitlines() if "marbles-rq" in ln]
    assert done.returncode == 0 and not ours, done.stdout + done.stderr
    # The hardening baseline, as systemd scores it (0 = locked down, 10 = fully exposed).
    for unit in units:
        done = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(unit)],
                              capture_output=True, text=True, timeout=120)
        match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
        if done.returncode != 0 and match is None:
            continue  # systemd before 250 has no offline security analysis
        assert match is not None, done.stdout + done.stderr
        assert float(match.group(1)) <= 2.5, done.stdout


# ------------------------------------------------------------------------- redis-cluster


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_base() -> int:
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 29000)
        if all(_free(p) and _free(p + 10000) for p in range(base, base + 3)):
            return base
    raise AssertionError("no three free ports (and their bus ports) found")


def test_redis_cluster_script_starts_stops_and_keeps_the_cluster(
        tmp_path: Path, redis_server: RedisServer) -> None:
    script = str(REPO_ROOT / "ops" / "redis-cluster")
    home = tmp_path / "cluster"
    env = {**os.environ, "MARBLES_CLUSTER_PORT": str(_cluster_base())}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([script, *args, str(home)], env=env, capture_output=True,
                              text=True, timeout=120)

    def mrq(url: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*_cli_argv(), "--redis-url", url, "--rq-url", redis_server.url,
                               "--source", str(REPO_ROOT / "examples" / "chain.py"), *args],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)

    started = run("start")
    try:
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip()
        assert re.fullmatch(r"redis\+cluster://127\.0\.0\.1:\d+", url), started.stdout
        assert run("status").returncode == 0
        doctor = mrq(url, "doctor")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert doctor.stdout.count("appendfsync = always") == 3, doctor.stdout  # each master
        done = mrq(url, "enqueue", "chain", "--input", '{"steps": 1}', "--id", "on-cluster")
        assert done.returncode == 0, done.stderr

        stopped = run("stop")
        assert stopped.returncode == 0, stopped.stderr
        status = run("status")
        assert status.returncode == 3 and status.stdout.count("stopped") == 3, status.stdout

        # Started again, the nodes re-form the same cluster from nodes.conf, with the data.
        again = run("start")
        assert again.returncode == 0 and again.stdout.strip() == url, again.stderr
        assert "creating the cluster" not in again.stderr
        status_run = mrq(url, "status", "on-cluster")
        assert status_run.returncode == 0 and "queued" in status_run.stdout, status_run
    finally:
        run("stop")


# -------------------------------------------------------------------------------- health


def test_health_worker_and_controller(procs: Procs) -> None:
    # Nothing runs against this Redis yet: both are unhealthy, one line each, exit 1.
    for role in ("worker", "controller"):
        done = procs.cli("health", role)
        assert done.returncode == 1, done
        assert done.stderr.startswith("unhealthy: ") and len(done.stderr.splitlines()) == 1

    worker = procs.worker()
    done = procs.cli("health", "worker")
    assert done.returncode == 0 and worker.name in done.stdout, done

    leader = procs.controller()
    procs.controller(ready=False)  # a standby on the same host
    done = procs.cli("health", "controller")
    assert done.returncode == 0 and f"controller pid {leader.pid} leads" in done.stdout, done

    # A worker killed hard keeps its RQ registration for minutes; health looks at the pid.
    name = worker.name
    worker.kill9()
    assert procs.observer.client.exists(f"rq:worker:{name}")
    assert not pid_alive(worker.pid)
    done = procs.cli("health", "worker")
    assert done.returncode == 1 and "no live worker" in done.stderr, done

    # Redis away: exit 3, as for every command.
    down = subprocess.run([*_cli_argv(), "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
                           "health", "worker"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 3, down
    leader.signal(signal.SIGTERM)
