"""The controller's blob collection: blobs (payloads/blobs.py) no holder references any
more are deleted, in bounded batches, by the leader of lane 0 (the blob index is one per
deployment, not per bucket, so one lane's leader walks it).

Each pass reads at most BATCH entries of the index ``{P:blobs}:index`` that are due (scored
by when they are looked at next: their put + the grace, then every grace while held), reads
their holders, and asks each holder older than the grace (payloads/holders.py) whether it
still references the blob. Then per blob, each step one script and idempotent, so a
controller killed anywhere in between leaves nothing a later pass cannot finish:

1. collect_blob drops the dead holders (only those whose time is the one read: a holder
   that put the blob again since is kept) and, when none is left, deletes the bytes (Redis
   backend) or marks the blob `$del` (file, S3: puts wait meanwhile);
2. for `$del`: the object is deleted, then finish_blob removes the mark;
3. reindex_blob removes the index entry (counted in `collected`), or looks at a held blob
   again one grace later -- either only if no put moved its entry since.

An index entry whose blob was never written (a writer died between the two) has no holder
and is simply dropped. The writes need no controller fence: each is conditional on what it
acts on (holders' times, the `$del` mark, the entry's score), so two controllers that
overlap for a moment do the same thing twice, harmlessly. A holder of a kind nobody
registered is never judged: its blob is kept (one warning per kind).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..payloads import holders as holder_kinds
from ..payloads.blobs import blob_store_for, grace_ms
from ..store.redis_errors import is_outage, one_line
from ..store.replies import as_text

if TYPE_CHECKING:
    from .context import DutyContext

log = logging.getLogger("marbles_rq.controller.blobs")

BATCH = 100          # index entries looked at per pass
MAX_EVERY_S = 5.0    # passes at most this far apart (closer with a short grace: tests)
DELETING = b"$del"


class BlobCollection:
    kind = "blobs"

    def __init__(self, batch: int = BATCH) -> None:
        self.batch = batch
        self._next = 0.0
        self._warned: set[str] = set()

    def recover(self, ctl: DutyContext) -> int:
        return 0  # the index is durable: the next pass finishes what a killed leader left

    def tick(self, ctl: DutyContext) -> None:
        if ctl.keys.lane_of_bucket(ctl.buckets.start) != 0:
            return  # lane 0's leader walks the deployment's one index
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + max(0.2, min(MAX_EVERY_S, grace_ms() / 2000))
        self.collect(ctl)

    def collect(self, ctl: DutyContext) -> int:
        """One bounded pass; returns how many blobs it deleted."""
        store, keys = ctl.store, ctl.keys
        client, scripts = store.client, store.scripts
        now = ctl.server_ms()
        due: list[Any] = client.zrangebyscore(keys.blobs_index, "-inf", now, start=0,
                                              num=self.batch, withscores=True)
        if not due:
            return 0
        pipe = client.pipeline(transaction=False)
        for sha, _ in due:
            pipe.hgetall(keys.blob_holders(as_text(sha)))
        found: list[Any] = pipe.execute(raise_on_error=False)
        grace = grace_ms()
        backend = blob_store_for(store)
        epoch, deleted = ctl.epoch, 0
        for (raw_sha, score), held in zip(due, found, strict=True):
            if not ctl.leads(epoch):
                break
            sha, seen = as_text(raw_sha), int(score)
            if isinstance(held, Exception):
                if is_outage(held):
                    raise held
                self._warn(f"read:{sha}", "blob %s: its holders are unreadable (%s); kept",
                           sha, one_line(held))
                continue
            dead, alive = self._judge(ctl, sha, held, now - grace)
            if alive and not dead and DELETING not in held:
                scripts.reindex_blob(index=keys.blobs_index, sizes=keys.blobs_sizes,
                                     stats=keys.blobs_stats, sha=sha, seen=seen,
                                     next_ms=now + grace)
                continue
            reply = scripts.collect_blob(holders=keys.blob_holders(sha),
                                         blob=keys.blob(sha) if backend.inline else None,
                                         dead=dead)
            if reply.status == "kept":
                next_ms = now + grace
            else:
                next_ms = 0
                if reply.status == "delete":
                    backend.delete_object(sha)
                    client.delete(keys.blob(sha))  # bytes put in Redis before a move, if any
                    if scripts.finish_blob(holders=keys.blob_holders(sha)) == "gone":
                        next_ms = now + grace  # a put took a stale mark over: held again
            if scripts.reindex_blob(index=keys.blobs_index, sizes=keys.blobs_sizes,
                                    stats=keys.blobs_stats, sha=sha, seen=seen,
                                    next_ms=next_ms) == "removed":
                deleted += 1
        if deleted:
            log.info("collected %s blobs no holder references", deleted)
        return deleted

    def _judge(self, ctl: DutyContext, sha: str, held: dict[bytes, bytes],
               cutoff: int) -> tuple[list[tuple[str, bytes]], bool]:
        """(the holders that no longer reference `sha`, with their times; whether any
        holder is left that does or may)."""
        dead: list[tuple[str, bytes]] = []
        alive = False
        for raw, ms in held.items():
            if raw == DELETING:
                continue
            holder = as_text(raw)
            if int(ms) > cutoff:
                alive = True  # put within the grace: its record may not be written yet
                continue
            try:
                refs = holder_kinds.references(ctl.store, holder, sha)
            except Exception as exc:
                if is_outage(exc):
                    raise
                self._warn(f"check:{holder}", "blob %s: asking holder %s failed (%s); kept",
                           sha, holder, one_line(exc))
                refs = True
            if refs is None:
                kind = holder_kinds.holder_kind(holder)[0]
                self._warn(f"kind:{kind}", "blobs held by %r: no holder kind %r is registered "
                           "in the controller; kept", holder, kind)
                alive = True
            elif refs:
                alive = True
            else:
                dead.append((holder, ms))
        return dead, alive

    def _warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)
