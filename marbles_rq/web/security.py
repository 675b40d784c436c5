"""Who may read and who may write, for `marbles-rq web`.

* The token (`MARBLES_WEB_TOKEN`) is the only credential. Every write needs it; without a
  token configured the dashboard is read-only. Bound beyond loopback, reads need it too, and
  starting there without one is refused (see `check_bind`).
* A browser proves the token once, on /login, and gets a session cookie: a random session id
  and its expiry, signed with an HMAC keyed by the token (never the token itself), HttpOnly
  and SameSite=Strict. It ends after SESSION_TTL_S, at logout (its id is revoked in this
  process, so a copy of the cookie is refused too) and when the token changes. A script
  sends ``Authorization: Bearer <token>`` instead.
* Wrong tokens are throttled (`Throttle`): a few guesses per client address, then one every
  few seconds, and a ceiling for all clients together; a throttled request is answered 429
  without its token being compared, so guessing faster than that learns nothing.
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
import threading
import time
from dataclasses import dataclass, field
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


def loopback_host_header(value: str) -> bool:
    """A Host header that names this machine's loopback (localhost, 127.x.y.z, [::1]), with
    or without a port. On loopback, where reads need nothing, any other name is a browser
    led there by DNS rebinding (a page of evil.example whose name now resolves to
    127.0.0.1): its own origin, so the same-origin policy would let it read every run."""
    host = value.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return False
    else:
        name, _, port = host.partition(":")
        if port and not port.isdigit():
            return False
    if name.endswith("."):
        name = name[:-1]
    return name == "localhost" or is_loopback_address(name)


def is_loopback_address(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse (ConfigError, exit 2) what would expose runs without a credential."""
    if token is not None and len(token) < MIN_TOKEN:
        raise ConfigError(f"{TOKEN_ENV} is too short: use at least {MIN_TOKEN} characters "
                          f"(e.g. `openssl rand -hex 24`)")
    if token is not None and not all("!" <= c <= "~" for c in token):
        # A space or a character outside printable ASCII cannot survive an Authorization
        # header (trimmed, or read as latin-1): the bearer form would never match.
        raise ConfigError(f"{TOKEN_ENV} holds a space, a control or a non-ASCII character: "
                          f"use printable ASCII only (e.g. `openssl rand -hex 24`)")
    if token is None and not is_loopback(host):
        raise ConfigError(f"refusing to bind {host} without a token: set {TOKEN_ENV} (reads "
                          f"and writes then need it), or bind 127.0.0.1")


SESSION_TTL_S = 12 * 3600


def _session_mac(token: str, body: str) -> str:
    return hmac.new(token.encode(), b"marbles-rq web session v2\0" + body.encode(),
                    hashlib.sha256).hexdigest()


class Throttle:
    """Token buckets of wrong-token attempts: one per client address (BURST guesses, then
    one per EVERY_S) and one for everyone (a guesser with many addresses). Addresses are
    forgotten once their bucket is full again, so the table stays small."""

    BURST, EVERY_S = 5, 10.0
    ALL_BURST, ALL_EVERY_S = 50, 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used: dict[str, tuple[float, float]] = {}  # address -> (level, at)
        self._all = (0.0, 0.0)

    @staticmethod
    def _drain(level: float, at: float, every: float, now: float) -> float:
        return max(0.0, level - (now - at) / every)

    def wait_s(self, address: str) -> float:
        """0 when `address` may try a token now, else the seconds until it may."""
        now = time.monotonic()
        with self._lock:
            level, at = self._used.get(address, (0.0, now))
            mine = self._drain(level, at, self.EVERY_S, now)
            everyone = self._drain(*self._all, self.ALL_EVERY_S, now)
            waits = [0.0]
            if mine + 1 > self.BURST:
                waits.append((mine + 1 - self.BURST) * self.EVERY_S)
            if everyone + 1 > self.ALL_BURST:
                waits.append((everyone + 1 - self.ALL_BURST) * self.ALL_EVERY_S)
            return max(waits)

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            level, at = self._used.get(address, (0.0, now))
            self._used[address] = (self._drain(level, at, self.EVERY_S, now) + 1, now)
            self._all = (self._drain(*self._all, self.ALL_EVERY_S, now) + 1, now)
            if len(self._used) > 10_000:
                self._used = {a: (lv, t) for a, (lv, t) in self._used.items()
                              if self._drain(lv, t, self.EVERY_S, now) > 0}


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else ""


@dataclass(frozen=True)
class Guard:
    token: str | None
    public: bool  # bound beyond loopback: reads need the token too
    throttle: Throttle = field(default_factory=Throttle, compare=False)
    # Session ids signed out here -> their expiry (kept until then, never longer).
    revoked: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def writable(self) -> bool:
        return self.token is not None

    def session_cookie(self) -> str:
        """A new session: `<id>.<expiry>.<mac>`."""
        assert self.token is not None
        body = f"{secrets.token_urlsafe(18)}.{int(time.time()) + SESSION_TTL_S}"
        return f"{body}.{_session_mac(self.token, body)}"

    def _session_id(self, cookie: str) -> str | None:
        """The id of a session cookie that is ours, unexpired and not signed out."""
        if self.token is None or cookie.count(".") != 2:
            return None
        sid, expiry, mac = cookie.split(".")
        if not hmac.compare_digest(mac.encode(),
                                   _session_mac(self.token, f"{sid}.{expiry}").encode()):
            return None
        if not expiry.isdigit() or int(expiry) <= time.time() or sid in self.revoked:
            return None
        return sid

    def sign_out(self, request: Request) -> None:
        sid = self._session_id(request.cookies.get(SESSION_COOKIE, ""))
        if sid is not None:
            now = time.time()
            for old in [s for s, until in self.revoked.items() if until <= now]:
                self.revoked.pop(old, None)
            self.revoked[sid] = now + SESSION_TTL_S

    def token_ok(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(),
                                                              self.token.encode())

    def try_token(self, request: Request, given: str) -> bool:
        """Compare a token a client sent, counting a wrong one against its address."""
        if self.token_ok(given):
            return True
        self.throttle.failed(client_address(request))
        return False

    def throttled_s(self, request: Request) -> float:
        return self.throttle.wait_s(client_address(request))

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
            # One verdict per request (a page asks more than once): a guess counts once.
            verdict = request.scope.get("mrq_bearer")
            if verdict is None:
                verdict = request.scope["mrq_bearer"] = self.try_token(request, bearer)
            return bool(verdict)
        return self._session_id(request.cookies.get(SESSION_COOKIE, "")) is not None

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
