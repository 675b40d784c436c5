"""The HTTP API when Redis dies under it: a request answers one JSON line (503
redis_unavailable), and an output stream already sending ends with a last event carrying
that line, cleanly, with no traceback in the server's log."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import marbles_rq as mr
from tests.procs import REPO_ROOT, Procs, wait_for
from tests.redis_procs import RedisServer
from tests.test_web_api import API_TOKEN, curl, sse_events
from tests.web_stack import start_web

CLIENT_SOURCE = REPO_ROOT / "tests" / "client_workflows.py"
PROCS_SOURCES = [CLIENT_SOURCE]


def test_redis_killed_under_an_output_stream(procs: Procs, redis_server: RedisServer) -> None:
    web = start_web(procs, extra_env={"MARBLES_API_TOKEN": API_TOKEN})
    run = mr.connect(procs.url, source=str(CLIENT_SOURCE)).start("cl_slow", {"steps": 1})
    stream = subprocess.Popen(
        ["curl", "-sS", "-N", "--max-time", "60", "-H", f"Authorization: Bearer {API_TOKEN}",
         f"{web.url}/api/runs/{run.id}/output"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        probe = redis_server.client()
        wait_for(lambda: int(probe.info("clients")["blocked_clients"]) >= 1, timeout=30,
                 what="the stream's blocking read")
        os.kill(redis_server.pid, signal.SIGKILL)
        out, err = stream.communicate(timeout=30)
    finally:
        if stream.poll() is None:
            stream.kill()
    assert stream.returncode == 0, err  # ended by the server, not cut (curl: 18)
    events = sse_events(out.decode())
    assert [e["event"] for e in events] == ["queued", "api_error"]
    error = json.loads(events[-1]["data"])["error"]
    assert error["code"] == "redis_unavailable" and "\n" not in error["message"]
    reply = curl(web, "GET", f"/api/runs/{run.id}")
    assert reply.status == 503 and reply.error()["code"] == "redis_unavailable"
    assert "Traceback" not in web.proc.log.read_text()
