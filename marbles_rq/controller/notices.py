"""Pause notifications: each run paused on a step whose tries ran out is POSTed to
MARBLES_NOTIFY_URL as JSON, from the durable outbox its park wrote in the same script
(lua/park_run.lua, `<tag>:notices`), by the elected controller.

The body is signed as inbound webhooks are checked (web/webhooks.py): header
``X-Marbles-Signature: sha256=<hex HMAC-SHA256 of the raw body>`` with the secret in
MARBLES_NOTIFY_SECRET. A try that fails (no answer in NOTIFY_TIMEOUT_S, or a status other
than 2xx) is tried again after 1 s, 2 s, 4 s ... (at most 5 min); after MARBLES_NOTIFY_TRIES
tries (8 by default) the notification is dropped with a log line and the metric
`marbles_rq_pause_notices_total{outcome="dropped"}`. The POSTs go from a thread of their own:
neither the run (parked already) nor the controller's pass waits for them. A receiver may
get a notification twice (a controller killed between the POST and its settle): its `id`
is stable, for the receiver to drop repeats.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from .. import metrics
from ..envvars import NOTIFY_SECRET_ENV, NOTIFY_URL_ENV, env_int
from ..errors import MarblesError
from ..store.redis_errors import one_line

if TYPE_CHECKING:
    from .context import DutyContext

log = logging.getLogger("marbles_rq.controller.notices")

TRIES_ENV = "MARBLES_NOTIFY_TRIES"
DEFAULT_TRIES = 8
NOTIFY_TIMEOUT_S = 5.0
FIRST_BACKOFF_MS = 1_000
MAX_BACKOFF_MS = 300_000
BATCH = 50  # notifications read per bucket per pass
SIGNATURE_HEADER = "X-Marbles-Signature"


def sign(secret: bytes, body: bytes) -> str:
    """The signature header's value (as web/webhooks.sign)."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def backoff_ms(tries: int) -> int:
    """The wait after failed try `tries` (from 1)."""
    return int(min(MAX_BACKOFF_MS, FIRST_BACKOFF_MS * 2 ** min(tries - 1, 30)))


class NoticesDuty:
    kind = "notices"

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._warned = False

    def recover(self, ctl: DutyContext) -> int:
        return 0  # the outbox is durable: the next pass sends what a previous leader left

    def tick(self, ctl: DutyContext) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            return  # still sending the previous batch
        due = ctl.due_scored(ctl.keys.notices, ctl.server_ms(), BATCH)
        if not due:
            return  # nothing due: no thread (a pass comes several times a second)
        self._thread = threading.Thread(target=self._drain, args=(ctl, ctl.epoch, due),
                                        name="marbles-notices", daemon=True)
        self._thread.start()

    def close(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=NOTIFY_TIMEOUT_S + 1)

    def _drain(self, ctl: DutyContext, epoch: int, due: list[tuple[int, str, int]]) -> None:
        try:
            self.send_due(ctl, epoch, due)
        except (redis.RedisError, MarblesError, OSError) as exc:
            log.error("pause notifications: %s; the next pass tries again", one_line(exc))

    def send_due(self, ctl: DutyContext, epoch: int,
                 due: list[tuple[int, str, int]] | None = None) -> int:
        """POST the notifications that are due (`due`, else read now); how many were
        settled (sent or dropped)."""
        if due is None:
            due = ctl.due_scored(ctl.keys.notices, ctl.server_ms(), BATCH)
        if not due:
            return 0
        url = os.environ.get(NOTIFY_URL_ENV, "")
        secret = os.environ.get(NOTIFY_SECRET_ENV, "").encode()
        tries_max = env_int(TRIES_ENV, DEFAULT_TRIES, unit="tries")
        if url and not secret and not self._warned:
            self._warned = True
            log.warning("%s is set without %s: pause notifications go unsigned",
                        NOTIFY_URL_ENV, NOTIFY_SECRET_ENV)
        import httpx

        settled = 0
        with httpx.Client(timeout=NOTIFY_TIMEOUT_S) as http:
            for bucket, member, _ in due:
                if not ctl.leads(epoch):
                    break
                settled += self._send_one(ctl, epoch, http, url, secret, tries_max, bucket,
                                          member)
        return settled

    def _send_one(self, ctl: DutyContext, epoch: int, http: Any, url: str, secret: bytes,
                  tries_max: int, bucket: int, member: str) -> int:
        try:
            notice = msgspec.json.decode(member)
            tries = int(notice.get("tries") or 0) + 1
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            log.warning("pause notification %r is not JSON; dropped", member[:200])
            return self._settle(ctl, epoch, bucket, member, "", 0, "dropped")
        if not url:
            log.warning("run %s paused on step %s: no %s set in the controller; its "
                        "notification is dropped", notice.get("run"), notice.get("step"),
                        NOTIFY_URL_ENV)
            return self._settle(ctl, epoch, bucket, member, "", 0, "dropped")
        body = msgspec.json.encode({k: v for k, v in notice.items() if k != "tries"}
                                   | {"delivery": tries})
        headers = {"Content-Type": "application/json", "X-Marbles-Notice-Id":
                   str(notice.get("id", ""))}
        if secret:
            headers[SIGNATURE_HEADER] = sign(secret, body)
        try:
            answer = http.post(url, content=body, headers=headers)
            problem = None if 200 <= answer.status_code < 300 else f"HTTP {answer.status_code}"
        except Exception as exc:  # httpx.HTTPError, a bad URL: the try failed
            problem = f"{type(exc).__name__}: {one_line(exc)}"
        if problem is None:
            log.info("run %s: pause notification sent (try %s)", notice.get("run"), tries)
            return self._settle(ctl, epoch, bucket, member, "", 0, "delivered")
        if tries >= tries_max:
            log.warning("run %s: pause notification dropped after %s tries (last: %s)",
                        notice.get("run"), tries, problem)
            return self._settle(ctl, epoch, bucket, member, "", 0, "dropped")
        wait = backoff_ms(tries)
        log.info("run %s: pause notification try %s failed (%s); again in %.1f s",
                 notice.get("run"), tries, problem, wait / 1000)
        again = msgspec.json.encode(notice | {"tries": tries}).decode()
        return self._settle(ctl, epoch, bucket, member, again, ctl.server_ms() + wait,
                            "retried") and 0

    def _settle(self, ctl: DutyContext, epoch: int, bucket: int, member: str, again: str,
                due_ms: int, outcome: str) -> int:
        reply = ctl.runs.scripts.settle_notice(
            notices=ctl.keys.notices(bucket), fence=ctl.keys.controller_fence(bucket),
            ctl_epoch=epoch, member=member, next=again, due_ms=due_ms)
        if reply.status == "ok":
            metrics.notice_outcome(outcome)
            return 1
        return 0
