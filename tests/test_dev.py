"""`marbles-rq dev`, as real processes: it starts Redis, a controller and workers; a run
enqueued against it finishes; a worker killed with SIGKILL is restarted; SIGINT stops every
child and keeps the data, which the next `dev` start sees; and it refuses a port that
something else holds, or a directory another `dev` runs in."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import (
    CHAIN_SOURCE,
    REPO_ROOT,
    Observer,
    _cli_argv,
    _pdeathsig,
    children,
    pid_alive,
    wait_for,
)
from tests.redis_procs import RedisServer, free_port


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARBLES_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


class DevProc:
    """One `marbles-rq dev` process; its stdout and stderr go to a file we wait on."""

    def __init__(self, home: Path, port: int, *args: str, source: Path = CHAIN_SOURCE) -> None:
        self.home, self.port = home, port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.out = home.parent / f"dev-{port}-{time.monotonic_ns()}.out"
        home.parent.mkdir(parents=True, exist_ok=True)
        # No dashboard unless a test asks for one (its own port: tests run side by side).
        web = [] if {"--web-port", "--no-web"} & set(args) else ["--no-web"]
        self.argv = [*_cli_argv(), "--source", str(source), "dev", "--dir", str(home),
                     "--port", str(port), "--lease-ms", "2000", "--progress-every", "0.3",
                     "--stop-timeout", "20", *web, *args]
        with self.out.open("wb") as fh:
            self.popen = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=_env(), stdout=fh,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=_pdeathsig)

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_line(self, needle: str, timeout: float = 60.0) -> None:
        def seen() -> bool:
            if needle in self.text():
                return True
            if self.popen.poll() is not None:
                raise AssertionError(f"dev exited {self.popen.returncode} before printing "
                                     f"{needle!r}:\n{self.text()}")
            return False

        wait_for(seen, timeout=timeout, what=f"{needle!r} in dev's output",
                 context=self.report)

    def roles(self) -> dict[str, list[int]]:
        """dev's live children by role: redis, controller, worker (from their command lines)."""
        found: dict[str, list[int]] = {}
        for pid in children(self.popen.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv if a]
            # redis-server rewrites its title: "/usr/bin/redis-server 127.0.0.1:6399"
            if words and Path(words[0].split()[0]).name == "redis-server":
                found.setdefault("redis", []).append(pid)
            for role in ("controller", "worker", "web"):
                if role in words:
                    found.setdefault(role, []).append(pid)
        return found

    def report(self) -> str:
        parts = [f"--- dev output ({self.out}) ---\n{self.text()[-6000:]}"]
        for log in sorted((self.home / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()  # its children get SIGTERM from the kernel (PDEATHSIG)
            self.popen.wait()


@pytest.fixture
def devs() -> Iterator[list[DevProc]]:
    started: list[DevProc] = []
    try:
        yield started
    finally:
        for proc in started:
            with contextlib.suppress(Exception):
                proc.stop(timeout=30)
            proc.kill()
            print(proc.report())


def _cli(url: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_cli_argv(), "--source", str(CHAIN_SOURCE), *args], cwd=REPO_ROOT,
                          env=_env(MARBLES_REDIS_URL=url), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _enqueue(url: str, run_id: str) -> None:
    done = _cli(url, "enqueue", "chain", "--input", '{"steps": 2, "sleep_s": 0.1}',
                "--id", run_id)
    assert done.returncode == 0, done.stderr


SEND_AT_READY = """
import json, sys
import marbles_rq as mr
with mr.connect(sys.argv[1]) as client:
    sent = client.send_event("gh", "at-ready", "push", {"n": 1})
    print(json.dumps([sent.state, sent.workflow,
                      client.handle(sent.run_id).result(timeout=60) == sent.run_id]))
"""


def test_dev_declares_its_event_triggers_before_it_says_ready(tmp_path: Path,
                                                              devs: list[DevProc]) -> None:
    """The moment dev says ready, a sender without the source (another process, no
    MARBLES_SOURCE) finds the source's triggers: its event starts the triggered run."""
    home, port = tmp_path / "marbles", free_port()
    dev = DevProc(home, port, "--workers", "1",
                  source=REPO_ROOT / "tests" / "trigger_workflows.py")
    devs.append(dev)
    dev.wait_line(" ready: ")
    done = subprocess.run([sys.executable, "-c", SEND_AT_READY, dev.url], env=_env(),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, (done.stderr, dev.report())
    assert json.loads(done.stdout) == ["started", "t_on_push", True]


def test_dev_runs_restarts_stops_and_keeps_the_data(tmp_path: Path,
                                                    devs: list[DevProc]) -> None:
    home, port = tmp_path / "marbles", free_port()
    dev = DevProc(home, port, "--workers", "1")
    devs.append(dev)
    dev.wait_line(" ready: ")
    # The moment it says ready, a caller without the source can start its workflows by name.
    import marbles_rq as mr

    with mr.connect(dev.url) as client:
        assert client.start("chain", {"steps": 1}, id="r0").created
    observer = Observer(dev.url, context=dev.report)
    try:
        def all_up() -> dict[str, list[int]] | None:
            roles = dev.roles()
            return roles if {"redis", "controller", "worker"} <= roles.keys() else None

        roles = wait_for(all_up, timeout=30, what="redis, controller and worker children",
                         context=dev.report)
        _enqueue(dev.url, "r1")
        observer.wait_status("r1", "succeeded", timeout=60)

        # The only worker dies hard: dev restarts it, and the next run is done by the new one.
        (old,) = roles["worker"]
        os.kill(old, signal.SIGKILL)
        dev.wait_line(f"worker-1 (pid {old}) exited with signal SIGKILL; restarting it")
        dev.wait_line("worker-1 restarted (pid ")
        new = wait_for(lambda: [p for p in dev.roles().get("worker", []) if p != old],
                       timeout=30, what="a new worker child", context=dev.report)[0]
        _enqueue(dev.url, "r2")
        view = observer.wait_status("r2", "succeeded", timeout=60)
        assert view.worker is not None and view.worker.endswith(f".{new}"), view.worker
        dev.wait_line("3 succeeded, 0 failed")  # the progress line counts from the store

        # Health commands see this host's worker and the leading controller.
        assert _cli(dev.url, "health", "worker").returncode == 0
        done = _cli(dev.url, "health", "controller")
        assert done.returncode == 0 and "leads" in done.stdout, done

        # A second dev in the same directory is refused while this one runs.
        other = subprocess.run([*dev.argv[:-2], "--port", str(free_port())], cwd=REPO_ROOT,
                               env=_env(), capture_output=True, text=True, timeout=60)
        assert other.returncode == 3, other
        assert "marbles-rq dev already runs in" in other.stderr, other.stderr
        assert len(other.stderr.strip().splitlines()) == 1, other.stderr
    finally:
        observer.close()

    # Ctrl-C: every child stops, and the data stays.
    pids = [p for group in dev.roles().values() for p in group]
    assert dev.stop(signal.SIGINT) == 0, dev.report()
    assert not [p for p in pids if pid_alive(p)], pids
    text = dev.text()
    assert "stopping: controller" in text and "stopped; data kept in" in text, text
    assert (home / "redis" / "appendonlydir").is_dir()
    assert "Redis is now ready to exit" in (home / "redis" / "redis.log").read_text()

    again = DevProc(home, port, "--workers", "1")
    devs.append(again)
    again.wait_line(" ready: ")
    again.wait_line("3 succeeded, 0 failed")
    observer = Observer(again.url)
    try:
        assert observer.status("r1") == "succeeded"
    finally:
        observer.close()
    assert again.stop(signal.SIGTERM) == 0, again.report()


def test_dev_refuses_a_port_held_by_something_else(tmp_path: Path,
                                                  redis_server: RedisServer) -> None:
    # A listener that is not Redis at all.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        dev = DevProc(tmp_path / "m1", port, "--workers", "1")
        code = dev.popen.wait(timeout=60)
    lines = dev.text().strip().splitlines()
    assert code == 3, dev.text()
    assert lines == [f"error: port {port} on 127.0.0.1 is taken by something that is not "
                     f"marbles-rq dev's redis-server (it does not answer PING); stop "
                     f"it or pick another with --port"], lines

    # A Redis server, but with another data dir: not ours, so not touched.
    dev = DevProc(tmp_path / "m2", redis_server.port, "--workers", "1")
    assert dev.popen.wait(timeout=60) == 3, dev.text()
    (line,) = dev.text().strip().splitlines()
    assert "a Redis server with data dir" in line and "--port" in line, line
    assert redis_server.is_running()
    assert not (tmp_path / "m2" / "redis" / "appendonlydir").exists()


def test_dev_reuses_its_redis_started_by_redis_local(tmp_path: Path,
                                                    devs: list[DevProc]) -> None:
    """ops/redis-local and dev share ./.marbles/redis: dev runs on a server already started
    there, and leaves it running when it stops (it did not start it)."""
    home, port = tmp_path / "marbles", free_port()
    local = [str(REPO_ROOT / "ops" / "redis-local")]
    env = _env(MARBLES_LOCAL_PORT=str(port))
    started = subprocess.run([*local, "start", str(home / "redis")], env=env,
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    try:
        dev = DevProc(home, port, "--workers", "1")
        devs.append(dev)
        dev.wait_line("reusing redis-server pid ")
        dev.wait_line(" ready: ")
        assert "redis" not in dev.roles()
        assert dev.stop(signal.SIGINT) == 0, dev.report()
        assert "left redis-server pid" in dev.text()
        status = subprocess.run([*local, "status", str(home / "redis")], env=env,
                                capture_output=True, text=True, timeout=30)
        assert status.returncode == 0 and status.stdout.startswith("running"), status

        # The same data dir on another port would be a second server on one AOF: refused.
        elsewhere = DevProc(home, free_port(), "--workers", "1")
        assert elsewhere.popen.wait(timeout=60) == 3, elsewhere.text()
        (line,) = elsewhere.text().strip().splitlines()
        assert f"already serves {home / 'redis'} on another port ({port})" in line, line
    finally:
        subprocess.run([*local, "stop", str(home / "redis")], env=env, capture_output=True,
                       timeout=90)


@pytest.mark.parametrize(("args", "needle"), [
    (["dev"], "dev needs --source"),
    (["--source", str(CHAIN_SOURCE), "dev", "--workers", "-1"], "--workers"),
    (["--source", str(CHAIN_SOURCE), "--prefix", "a b", "dev"], "invalid key prefix"),
])
def test_dev_bad_input_is_one_line_and_exit_2(args: list[str], needle: str,
                                              tmp_path: Path) -> None:
    done = subprocess.run([*_cli_argv(), *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / ".marbles").exists()  # refused before anything was made


def test_dev_help_names_its_options() -> None:
    done = subprocess.run([sys.executable, "-m", "marbles_rq", "dev", "--help"], cwd=REPO_ROOT,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in ("--workers", "--pool", "--port", "--dir", "--stop-timeout", "--web-port",
                   "--no-web"):
        assert option in done.stdout


def test_dev_starts_the_dashboard_and_prints_its_url_and_token(tmp_path: Path,
                                                               devs: list[DevProc]) -> None:
    """dev starts `marbles-rq web` beside the workers: the URL it prints serves the
    dashboard, the token it prints signs in (writes allowed), and stopping dev stops it."""
    import re

    import httpx

    home, port, web_port = tmp_path / "marbles", free_port(), free_port()
    dev = DevProc(home, port, "--workers", "1", "--web-port", str(web_port))
    devs.append(dev)
    dev.wait_line(" ready: ")
    found = re.search(r"dashboard  (http://127\.0\.0\.1:(\d+)/) \(token (\S+):", dev.text())
    assert found, dev.text()
    url, token = found[1], found[3]
    assert int(found[2]) == web_port
    assert (home / "web.token").read_text().strip() == token
    assert (home / "web.token").stat().st_mode & 0o077 == 0  # the owner's only

    def answers() -> bool:
        try:
            return httpx.get(url + "runs", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, timeout=60, what="the dashboard to answer", context=dev.report)
    with httpx.Client(base_url=url, timeout=10) as client:
        csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/login").text)
        assert csrf
        signed = client.post("/login", data={"token": token, "csrf": csrf[1], "next": "/runs"},
                             headers={"Origin": url.rstrip("/")})
        assert signed.status_code == 303, signed.text
        wrong = client.post("/login", data={"token": "not-it", "csrf": csrf[1]},
                            headers={"Origin": url.rstrip("/")})
        assert wrong.status_code != 303
    (web_pid,) = dev.roles()["web"]
    assert dev.stop() == 0
    assert not pid_alive(web_pid)
    # The next start keeps the token (a signed-in browser stays signed in).
    again = DevProc(home, port, "--workers", "0", "--web-port", str(web_port))
    devs.append(again)
    again.wait_line(" ready: ")
    assert f"(token {token}:" in again.text()


def test_dev_keeps_the_token_file_owner_only_when_it_was_not(tmp_path: Path,
                                                             devs: list[DevProc]) -> None:
    """A web.token left world-readable (copied, or written by hand) is made owner-only:
    whether dev writes a new token into it or reuses the one in it."""
    home, port, web_port = tmp_path / "marbles", free_port(), free_port()
    home.mkdir()
    path = home / "web.token"
    path.write_text("short\n")  # too short to reuse: a new token is written over it
    path.chmod(0o644)
    dev = DevProc(home, port, "--workers", "0", "--web-port", str(web_port))
    devs.append(dev)
    dev.wait_line(" ready: ")
    token = path.read_text().strip()
    assert len(token) >= 16 and f"(token {token}:" in dev.text()
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)
    assert dev.stop() == 0
    path.chmod(0o644)  # reused as it is
    again = DevProc(home, port, "--workers", "0", "--web-port", str(web_port))
    devs.append(again)
    again.wait_line(" ready: ")
    assert f"(token {token}:" in again.text()
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)
