"""Who may call the HTTP API (/api/...).

* With MARBLES_API_TOKEN set, every call needs ``Authorization: Bearer <token>``, wherever
  the server is bound; it is compared in constant time. The dashboard's token
  (MARBLES_WEB_TOKEN) and its sessions are not accepted here, nor this token there: a
  service gets a credential that cannot sign anyone in to the dashboard.
* Without it, the API answers only on a server bound to loopback (as the dashboard's reads
  do), and there only requests that no browser page could have sent: a Host naming the
  loopback (not a DNS-rebound name) and no Origin header (every browser sends one with a
  cross-site POST, which a form could otherwise send to 127.0.0.1 without a preflight).
  Bound beyond loopback without the token, `web` still starts (the dashboard has its own
  token) but every /api call is answered 403 "api_disabled": never open by default.
* Wrong tokens count against the dashboard's per-address throttle (security.Throttle): a
  throttled client is answered 429 before its token is compared.
* GET /api/openapi.json (the document, no data) needs nothing.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from ..errors import ConfigError
from .api_errors import error_response
from .security import MIN_TOKEN, Throttle, client_address, loopback_host_header

API_TOKEN_ENV = "MARBLES_API_TOKEN"
OPEN_PATHS = frozenset({"/api/openapi.json"})


def check_api_token(token: str | None) -> None:
    """Refuse (ConfigError, exit 2) a token too short to resist guessing, or one that
    cannot travel in an Authorization header."""
    if token is None:
        return
    if len(token) < MIN_TOKEN:
        raise ConfigError(f"{API_TOKEN_ENV} is too short: use at least {MIN_TOKEN} characters "
                          f"(e.g. `openssl rand -hex 24`)")
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"{API_TOKEN_ENV} holds a space, a control or a non-ASCII "
                          f"character: use printable ASCII only (e.g. `openssl rand -hex 24`)")


@dataclass(frozen=True)
class ApiGuard:
    token: str | None
    public: bool  # bound beyond loopback
    throttle: Throttle

    def refusal(self, request: Request) -> Response | None:
        """None when the request may go ahead, else the reply that refuses it."""
        if request.url.path in OPEN_PATHS:
            return None
        if self.token is None:
            return self._tokenless(request)
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return error_response("unauthorized", f"this API needs the header "
                                  f"`Authorization: Bearer <{API_TOKEN_ENV}>`",
                                  headers={"WWW-Authenticate": "Bearer"})
        address = client_address(request)
        wait_s = self.throttle.wait_s(address)
        if wait_s > 0:
            return error_response("throttled", f"too many wrong tokens: try again in "
                                  f"{math.ceil(wait_s)} s",
                                  headers={"Retry-After": str(math.ceil(wait_s))})
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            self.throttle.failed(address)
            return error_response("unauthorized", "the token is wrong",
                                  headers={"WWW-Authenticate": "Bearer"})
        return None

    def _tokenless(self, request: Request) -> Response | None:
        if self.public:
            return error_response("api_disabled", f"the HTTP API is off: this server is "
                                  f"bound beyond loopback and {API_TOKEN_ENV} is not set")
        if not loopback_host_header(request.headers.get("host", "")):
            return error_response("forbidden", f"without {API_TOKEN_ENV} the API answers "
                                  f"only for localhost, 127.0.0.1 or [::1]")
        if "origin" in request.headers:
            return error_response("forbidden", f"a browser page may not call the API "
                                  f"without a token: set {API_TOKEN_ENV} and send it as a "
                                  f"bearer token")
        return None
