"""Who may read and who may write, for `marbles-rq web`.

* The token (`MARBLES_WEB_TOKEN`) is the only credential. Every write needs it; without a
  token configured the dashboard is read-only. Bound beyond loopback, reads need it too, and
  starting there without one is refused (see `check_bind`).
* A browser proves the token once, on /login, and gets a session cookie holding an HMAC of
  the token (never the token itself), HttpOnly and SameSite=Strict; changing the token
  ends every session. A script sends ``Authorization: Bearer <token>`` instead.
* CSRF: a cookie-authenticated write must carry the per-browser CSRF value (a random cookie,
  echoed as a hidden form field: double submit) and, when the browser sends one, an Origin
  (or Referer) of this server. A bearer-token write needs neither: no browser adds that
  header to a cross-site request on its own, and the server answers no CORS preflight.
* Every comparison of a secret is constant-time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

from ..errors import ConfigError

TOKEN_ENV = "MARBLES_WEB_TOKEN"
MIN_TOKEN = 16
SESSION_COOKIE = "mrq_session"
CSRF_COOKIE = "mrq_csrf"
CSRF_FIELD = "csrf"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(host: str, token: str | None) -> None:
    """Refuse (ConfigError, exit 2) what would expose runs without a credential."""
    if token is not None and len(token) < MIN_TOKEN:
        raise ConfigError(f"{TOKEN_ENV} is too short: use at least {MIN_TOKEN} characters "
                          f"(e.g. `openssl rand -hex 24`)")
    if token is None and not is_loopback(host):
        raise ConfigError(f"refusing to bind {host} without a token: set {TOKEN_ENV} (reads "
                          f"and writes then need it), or bind 127.0.0.1")


def _session_value(token: str) -> str:
    return hmac.new(token.encode(), b"marbles-rq web session v1", hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Guard:
    token: str | None
    public: bool  # bound beyond loopback: reads need the token too

    @property
    def writable(self) -> bool:
        return self.token is not None

    def session_cookie(self) -> str:
        assert self.token is not None
        return _session_value(self.token)

    def token_ok(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(),
                                                              self.token.encode())

    def _bearer(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else None

    def authenticated(self, request: Request) -> bool:
        """The request carries the token (bearer) or a session made with it."""
        if self.token is None:
            return False
        bearer = self._bearer(request)
        if bearer is not None:
            return self.token_ok(bearer)
        cookie = request.cookies.get(SESSION_COOKIE, "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(),
                                                    self.session_cookie().encode())

    def may_read(self, request: Request) -> bool:
        return not self.public or self.authenticated(request)

    def write_refusal(self, request: Request, form_csrf: str | None) -> str | None:
        """None when the write may go ahead, else why not (one line)."""
        if self.token is None:
            return f"this dashboard is read-only: start it with {TOKEN_ENV} set to allow writes"
        if self._bearer(request) is not None:
            return None if self.authenticated(request) else "the token is wrong"
        if not self.authenticated(request):
            return "sign in with the token first (writes need it)"
        return csrf_refusal(request, form_csrf)


def csrf_refusal(request: Request, form_csrf: str | None) -> str | None:
    """Double submit (cookie == form field) and, when sent, Origin/Referer of this host."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    if not cookie or not form_csrf or not hmac.compare_digest(cookie.encode(),
                                                              form_csrf.encode()):
        return "the form's CSRF value is missing or stale: reload the page and try again"
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin and origin != "null":
        parts = urlsplit(origin)
        if parts.netloc != request.headers.get("host", ""):
            return "the request comes from another site (Origin does not match)"
    elif origin == "null":
        return "the request comes from an opaque origin"
    return None


def new_csrf() -> str:
    return secrets.token_urlsafe(32)
