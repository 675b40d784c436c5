"""`marbles-rq web`: the dashboard and signed webhooks (see marbles_rq/web)."""

from __future__ import annotations

import logging
import os
import socket

import click

from ..deployment import Settings
from ..errors import ConfigError
from .procs import metrics_options


@click.command()
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Address to listen on. Beyond loopback, MARBLES_WEB_TOKEN must be set.")
@click.option("--port", type=click.IntRange(0, 65535), default=8700, show_default=True,
              help="Port to listen on (0: any free port; the URL is printed).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@metrics_options
@click.pass_obj
def web(settings: Settings, bind: str, port: int, log_level: str, metrics_port: int | None,
        metrics_bind: str) -> None:
    """Serve the dashboard, POST /events/<source> webhooks and the HTTP API (/api/). Writes
    (cancel, pause, resume, rerun, answers, schedule pause) need MARBLES_WEB_TOKEN; without
    it the dashboard is read-only, and only loopback may be bound. The API needs
    MARBLES_API_TOKEN as a bearer token; without it, it answers only on loopback."""
    import uvicorn

    from ..engine.ops import max_payload
    from ..web.api_auth import API_TOKEN_ENV, check_api_token
    from ..web.app import create_app
    from ..web.security import TOKEN_ENV, Guard, check_bind, is_loopback
    from ..web.server import HeaderDeadlineH11
    from ..web.settings import WebSettings
    from ..web.webhooks import Webhooks, secrets_from_env

    token = os.environ.get(TOKEN_ENV) or None
    check_bind(bind, token)  # before anything else: a refused start touches nothing
    api_token = os.environ.get(API_TOKEN_ENV) or None
    check_api_token(api_token)
    max_body = max_payload()  # a bad MARBLES_MAX_PAYLOAD: exit 2 now, not a 500 per webhook
    secrets = secrets_from_env()
    if metrics_port is not None:
        from ..metrics import serve_metrics

        serve_metrics(metrics_port, metrics_bind)  # its own port; a bad one: exit 2
    settings = WebSettings.of(settings)
    settings.load_source()
    guard = Guard(token, public=not is_loopback(bind))
    webhooks = Webhooks(secrets, settings, max_body)
    webhooks.check()
    app = create_app(settings, guard, webhooks, api_token=api_token)
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP.
    # Without it a reply's headers and body (two writes) waited for the client's delayed
    # ACK: 40 ms added to every request on a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    host = f"[{bind}]" if ":" in bind else bind
    mode = "reads and writes need the token" if guard.public else (
        "reads open on loopback; writes need the token" if token else
        f"read-only: set {TOKEN_ENV} to allow writes")
    click.echo(f"marbles-rq web: dashboard on http://{host}:{sock.getsockname()[1]}/ ({mode})",
               err=True)
    api_mode = ("needs the bearer token " + API_TOKEN_ENV if api_token else
                f"off: set {API_TOKEN_ENV}" if guard.public else
                f"open on loopback: set {API_TOKEN_ENV} to require a token")
    click.echo(f"marbles-rq web: HTTP API on http://{host}:{sock.getsockname()[1]}/api/ "
               f"({api_mode})", err=True)
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=2, proxy_headers=False,
                            http=HeaderDeadlineH11)
    uvicorn.Server(config).run(sockets=[sock])
