"""The controller's pruning duty: finished runs whose retention ended are removed with
everything they stored (purge_run), at most a budget every PRUNE_EVERY_S; a child run whose
parent has not finished is held until it has (see `Pruning._held`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from ..engine.paging import tags_of
from ..engine.runs import TERMINAL
from ..errors import CorruptRecordError, UnsupportedRecordVersionError
from ..store.records import RunRecord, decode
from ..store.redis_errors import is_outage
from ..store.replies import as_text

if TYPE_CHECKING:
    from .context import PassContext

log = logging.getLogger("marbles_rq.controller")

PRUNE_BUDGET = 200        # finished runs pruned per prune pass
PRUNE_EVERY_S = 5.0
HOLD_MAX_MS = 3_600_000  # a child kept for its parent is looked at again at most this late


def release_sessions(ctl: PassContext, run_id: str) -> None:
    """Release the sessions run `run_id` opened (marbles_rq/sessions/): a session whose
    last owner this was goes with it."""
    from ..sessions.store import SessionStore

    deleted = SessionStore(ctl.runs).release_run(run_id)
    if deleted:
        log.info("run %s pruned: %s of its sessions went with it", run_id, deleted)


class Pruning:
    kind = "pruning"

    def __init__(self) -> None:
        self._next_prune = 0.0

    def tick(self, ctl: PassContext) -> None:
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
            self.prune(ctl)

    def prune(self, ctl: PassContext, budget: int = PRUNE_BUDGET) -> int:
        """Remove finished runs whose retention ended, with everything they stored; a child
        run whose parent has not finished is held (see `_held`)."""
        due = ctl.due(ctl.keys.run_finished, ctl.server_ms(),
                      2 * -(-budget // len(ctl.buckets)), budget)
        if not due:
            return 0
        held = self._held(ctl, [run_id for _, run_id in due])
        due = [(bucket, run_id) for bucket, run_id in due if run_id not in held]
        pipe = ctl.store.client.pipeline(transaction=False)
        for _, run_id in due:
            pipe.smembers(ctl.keys.effect_index(run_id))
            pipe.hget(ctl.keys.run(run_id), "tags")  # its tag index entries go with it
            pipe.smembers(ctl.keys.run_sessions(run_id))
        replies = pipe.execute(raise_on_error=False)
        done = 0
        for (_, run_id), found, tags, sessions in zip(due, replies[0::3], replies[1::3],
                                                      replies[2::3], strict=True):
            members = [] if isinstance(found, Exception) else sorted(as_text(m) for m in found)
            seen = tags if isinstance(tags, bytes) else b""
            if isinstance(sessions, Exception) or sessions:
                # The sessions the run opened go first (their slots are not the run's: not
                # one script). Each release is idempotent, and the run stays due until it
                # is purged, so a kill -9 anywhere in between is finished by the next pass.
                release_sessions(ctl, run_id)
            reply = ctl.run_script(run_id, functools.partial(
                ctl.runs.scripts.purge_run, keys=ctl.keys.run_keys(run_id), run_id=run_id,
                receipts=members, tags=seen,
                tag_indexes=[ctl.keys.tag_index(k, v, ctl.keys.bucket_of(run_id))
                             for k, v in tags_of(seen).items()]))
            if reply is not None and reply.status == "ok":
                done += 1
        ctl.stats.pruned += done
        if done:
            log.info("pruned %s finished runs past their retention", done)
        return done

    def _held(self, ctl: PassContext, run_ids: list[str]) -> set[str]:
        """The children among `run_ids` whose parent has not finished: the parent reads a
        child's outcome when it gathers, however long after the child's retention that is.
        Each is held (lua/hold_finished.lua) and looked at again after its retention (at least
        a prune pass, at most an hour); once its parent has finished (final: it never gathers
        again) or is gone, the child is pruned. Read in two pipelined rounds: the children's
        records (for their parent), then their parents' status."""
        # A child's id is "<parent>.<key>" (engine/fanout.child_id): only such ids are read.
        maybe = [rid for rid in run_ids if "." in rid]
        if not maybe:
            return set()
        pipe = ctl.store.client.pipeline(transaction=False)
        for rid in maybe:
            pipe.hget(ctl.keys.run(rid), "doc")
        children: dict[str, RunRecord] = {}
        for rid, doc in zip(maybe, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(doc, bytes):
                try:
                    record = decode(RunRecord, doc, ctl.keys.run(rid))
                except (CorruptRecordError, UnsupportedRecordVersionError):
                    continue  # purge_run judges it as any run
                if record.parent:
                    children[rid] = record
        if not children:
            return set()
        pipe = ctl.store.client.pipeline(transaction=False)
        for record in children.values():
            pipe.hget(ctl.keys.run(record.parent), "status")
        held: set[str] = set()
        for (rid, record), status in zip(children.items(),
                                         pipe.execute(raise_on_error=False), strict=True):
            if isinstance(status, Exception):
                if is_outage(status):
                    raise status
                held.add(rid)  # unreadable now: not pruned on a guess
                continue
            if status is None or as_text(status) in TERMINAL:
                continue
            hold_ms = min(max(int(record.retention_s * 1000), int(PRUNE_EVERY_S * 1000)),
                          HOLD_MAX_MS)
            ctl.run_script(rid, functools.partial(
                ctl.runs.scripts.hold_finished, keys=ctl.keys.run_keys(rid), run_id=rid,
                hold_ms=hold_ms))
            held.add(rid)
        if held:
            log.debug("kept %s finished child runs whose parent has not finished", len(held))
        return held
