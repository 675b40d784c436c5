"""A real `marbles-rq web` process for the dashboard tests (tests/test_web*.py), started
beside the workers and controller of a `Procs`, and read with httpx."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

import httpx
import redis

from tests.procs import Proc, Procs, db_contents
from tests.redis_procs import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
WEB_SOURCE = REPO_ROOT / "tests" / "web_workflows.py"
TOKEN = "test-token-0123456789abcdef"
SECRET = "webhook-secret-for-github"


class Web:
    def __init__(self, proc: Proc, url: str) -> None:
        self.proc, self.url = proc, url

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, follow_redirects=False,
                            **kwargs)  # type: ignore[arg-type]

    def signed_in(self) -> httpx.Client:
        """A client holding a session cookie and the CSRF cookie, as a browser would."""
        client = self.client()
        csrf = self.csrf(client)
        reply = client.post("/login", data={"token": TOKEN, "csrf": csrf, "next": "/runs"},
                            headers={"Origin": self.url})
        assert reply.status_code == 303, reply.text
        return client

    def csrf(self, client: httpx.Client) -> str:
        """The CSRF value of `client`'s browser session, as the forms carry it."""
        page = client.get("/login")
        match = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert match, page.text
        return match.group(1)


def start_web(procs: Procs, *, token: str | None = TOKEN, bind: str = "127.0.0.1",
              extra_env: dict[str, str] | None = None, ready: bool = True) -> Web:
    port = free_port()
    env = dict(procs.env)
    env.pop("MARBLES_WEB_TOKEN", None)
    env.pop("MARBLES_API_TOKEN", None)  # only what extra_env sets
    if token is not None:
        env["MARBLES_WEB_TOKEN"] = token
    env["MARBLES_WEBHOOK_SECRET_GITHUB"] = SECRET
    env.update(extra_env or {})
    n = sum(1 for p in procs.procs if p.role == "web")
    proc = Proc("web", [*procs.base_argv(), "web", "--bind", bind, "--port", str(port)],
                procs.dir / f"web-{n}.log", env)
    procs.procs.append(proc)
    if ready:
        proc.wait_log("Application startup complete")
    host = "127.0.0.1" if bind in ("0.0.0.0", "127.0.0.1") else bind
    return Web(proc, f"http://{host}:{port}")


def ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def dump_keys(url: str) -> dict[str, object]:
    """Every key of the server and its value: equal before and after means nothing written
    (tests/procs.py db_contents)."""
    client = redis.Redis.from_url(url)
    try:
        return db_contents(client)
    finally:
        client.close()


def signed(body: bytes, secret: str = SECRET) -> dict[str, str]:
    """The headers of a webhook request signed with `secret`."""
    return {"X-Marbles-Signature": "sha256=" + hmac.new(secret.encode(), body,
                                                        hashlib.sha256).hexdigest(),
            "Content-Type": "application/json"}
