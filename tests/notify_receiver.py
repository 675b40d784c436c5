"""A pause-notification receiver for tests/test_retry_policies.py, run as its own process:
``python -m tests.notify_receiver PORT_FILE LOG_FILE SECRET FAIL_FIRST``.

It checks each POST's X-Marbles-Signature (HMAC-SHA256 of the raw body with SECRET) as a
real receiver would, answers 500 to the first FAIL_FIRST requests (-1: to every one), and
appends one JSON line per request to LOG_FILE: {"valid", "status", "body"}."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> None:
    port_file, log_file, secret, fail_first = (Path(sys.argv[1]), Path(sys.argv[2]),
                                               sys.argv[3].encode(), int(sys.argv[4]))
    seen = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            want = "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()
            valid = hmac.compare_digest(want, self.headers.get("X-Marbles-Signature", ""))
            seen[0] += 1
            status = 401 if not valid else (500 if fail_first < 0 or seen[0] <= fail_first
                                            else 204)
            with log_file.open("a") as fh:
                fh.write(json.dumps({"valid": valid, "status": status,
                                     "body": json.loads(body or b"null")}) + "\n")
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()
