"""Growing a deployment's bucket count: every key of every bucket moves to its new bucket.

Offline: it refuses while a controller leads or a worker beats, and while it runs (and after,
for processes started before it) nothing else can lead or start:

* the controller lease key at its old place is taken forever (a "tombstone" with no TTL
  held by ``buckets-grow``), so a standby controller still configured with the old layout can
  never lead again; controllers started afterwards find the lease at its new place;
* ``{P}:meta`` records ``grow_to`` before the first key moves, and every process refuses to
  open the store while it is there (GrowInProgressError).

The move cannot be one script (old and new bucket may be on different masters of a cluster),
so it is a sequence of idempotent steps, safe to repeat after a kill -9 at any point:

1. the controller fence (``ctl`` of every bucket) is read once, before any old ``ctl`` key is
   deleted; its maximum is recorded in meta (``grow_fence``) and written to every new bucket,
   so a paused ex-leader's epoch stays refused after the growth;
2. every key under an old bucket tag (a SCAN of every master) is moved: a per-id key (a run's
   hash, ledger, output, an event, a schedule, ...) by DUMP, RESTORE REPLACE under the new tag
   (keeping its TTL), then DEL; a per-bucket index (listings, due sets, ``own:`` sets, ...) by
   adding each member, rewritten where it embeds key names, to the index of the member's new
   bucket, then DEL. A kill between the copy and the DEL leaves the old key, which the rerun
   copies again, unchanged; members are set-like, so adding one twice is adding it once;
3. when a SCAN finds no old key left, meta records the new count and layout 2 in one script.

Progress is what is left under the old tags (and ``grow_moved`` in meta, a count for humans).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import ConfigError, MarblesError
from .connection import Client
from .keys import LAYOUT_V2, MAX_BUCKETS, Keyspace
from .replies import as_text
from .scripts import Scripts

GROW_TOKEN = "buckets-grow"
CONTROLLER_LEASE = "controller"  # controller/loop.py LEASE_NAME (not imported: no cycle)

# Key families under a bucket tag, after ``<tag>:``. A family this module does not know stops
# the growth (nothing is moved blindly: a rerun by a marbles-rq that knows it finishes).
PER_ID = {"rec", "run", "steps", "out", "asks", "sig", "reports", "eff", "effidx", "fence", "ws",
          "wsidx", "lease", "epoch", "since", "evt", "mon", "sched", "occ", "lock",
          "pub", "evin", "art",
          "ses", "sesmsg", "seskey", "sesown", "runses"}  # sessions (marbles_rq/sessions/)
RUN_MEMBERS = {"leases", "dispatch", "finished", "waits", "evidx", "evpending", "evoffer", "mondue",
               "sched_idx", "sched_due", "occ_open"}  # members are (hold) the routing ids
PIPED_MEMBERS = {"feed", "reportidx"}  # members are ``<run id>|<key>``
# Resend markers (60 s, offline now); fences (step 1); the dashboard's per-minute rollups
# (derived, per lane: a new leader recomputes the last hour, older minutes are not kept).
DROPPED = {"req", "ctl", "roll", "rollmin"}
BATCH = 200  # keys per batch: three round trips (read, copy, delete) each


class GrowError(MarblesError):
    """The growth cannot start or continue; the message says why and what to do."""

    code = "grow"


@dataclass(frozen=True)
class GrowState:
    buckets: int
    layout: int
    lanes: int
    grow_to: int | None
    moved: int


def read_state(client: Client, prefix: str) -> GrowState | None:
    raw = client.hmget(Keyspace(prefix, 1).meta,
                       ["buckets", "layout", "lanes", "grow_to", "grow_moved"])
    buckets, layout, lanes, grow_to, moved = (as_text(v) if v is not None else "" for v in raw)
    if not buckets:
        return None
    return GrowState(int(buckets), int(layout or "1"), int(lanes or "1"),
                     int(grow_to) if grow_to else None, int(moved or "0"))


class Grower:
    def __init__(self, client: Client, prefix: str, to: int, *,
                 progress: Callable[[str], None] = print, progress_every: int = 1000) -> None:
        self.client, self.prefix, self.to = client, prefix, to
        self.scripts = Scripts(client)
        self.progress, self.progress_every = progress, progress_every
        state = read_state(client, prefix)
        if state is None:
            raise GrowError(f"no deployment with prefix {prefix!r} here: nothing to grow")
        self.state = state
        self.old = Keyspace(prefix, state.buckets, lanes=state.lanes, layout=state.layout)
        if state.grow_to is not None and state.grow_to != to:
            raise GrowError(f"a growth from {state.buckets} to {state.grow_to} buckets is "
                            f"under way: finish it with --to {state.grow_to}")
        if state.grow_to is None and not state.buckets < to <= MAX_BUCKETS:
            raise ConfigError(f"cannot grow from {state.buckets} to {to} buckets: expected "
                            f"{state.buckets + 1}..{MAX_BUCKETS} (the count only grows)")
        self.new = Keyspace(prefix, to, lanes=state.lanes, layout=LAYOUT_V2)
        self.old_tags = self.old.tags()
        self.tombstone_key = self.old.lease(CONTROLLER_LEASE)
        self.moved = state.moved

    # -- the steps -------------------------------------------------------------------------

    def run(self) -> int:
        """Grow (or finish a growth); returns how many keys were moved in all."""
        if self.state.grow_to is None:
            self._begin()
        else:
            self.progress(f"resuming the growth from {self.state.buckets} to {self.to} "
                          f"buckets ({self.moved} keys moved before)")
        self._fences()
        while self._move_pass():  # a pass that moved nothing proves nothing is left
            pass
        self.scripts.finish_grow(meta_key=self.new.meta, buckets=self.to, layout=LAYOUT_V2,
                                 moved=self.moved)
        self.progress(f"grown: {self.to} buckets (layout {LAYOUT_V2}), {self.moved} keys "
                      f"moved")
        return self.moved

    def _begin(self) -> None:
        holder = self.client.get(self.tombstone_key)
        if holder is not None and not as_text(holder).endswith("|" + GROW_TOKEN):
            raise GrowError(f"a controller leads ({as_text(holder)}): stop every controller and "
                            f"worker of this deployment before growing its buckets")
        epoch = self.client.get(self.old.lease_epoch(CONTROLLER_LEASE))
        # No TTL: controllers that still have the old layout must never lead again.
        tombstone = f"{as_text(epoch or '0')}|{GROW_TOKEN}"
        if not self.client.set(self.tombstone_key, tombstone, nx=True):
            holder = self.client.get(self.tombstone_key)
            if holder is None or not as_text(holder).endswith("|" + GROW_TOKEN):
                raise GrowError(f"a controller took the lease ({as_text(holder or '')}): stop "
                                f"every controller and worker before growing the buckets")
        reply = self.scripts.begin_grow(meta_key=self.new.meta, workers_key=self.new.workers,
                                        buckets=self.state.buckets, to=self.to)
        if reply[0] == "workers":
            self.client.delete(self.tombstone_key)  # nothing moved: leave as it was
            raise GrowError(f"{reply[1]} worker(s) of this deployment are alive (e.g. "
                            f"{reply[2]}): stop every worker and controller before growing")
        if reply[0] != "ok":
            raise GrowError(f"the deployment changed meanwhile ({reply[0]}): run the command "
                            f"again")
        self.progress(f"growing from {self.state.buckets} buckets (layout {self.old.layout}) "
                      f"to {self.to} (layout {LAYOUT_V2})")

    def _fences(self) -> None:
        meta = self.new.meta
        recorded = self.client.hget(meta, "grow_fence")
        if recorded is None:
            pipe = self.client.pipeline(transaction=False)
            for b in range(self.old.buckets):
                pipe.hget(self.old.controller_fence(b), "epoch")
            epochs = [int(as_text(v)) for v in pipe.execute() if v is not None]
            self.client.hset(meta, "grow_fence", str(max(epochs, default=0)))
            recorded = self.client.hget(meta, "grow_fence")
        fence = int(as_text(recorded))
        if fence:
            pipe = self.client.pipeline(transaction=False)
            for b in range(self.to):
                pipe.hset(self.new.controller_fence(b), "epoch", str(fence))
            pipe.execute()

    def _move_pass(self) -> int:
        moved, batch = 0, []
        size = min(BATCH, self.progress_every)
        for key in self._old_keys():
            if key != self.tombstone_key:
                batch.append(key)
            if len(batch) >= size:
                moved += self._move_batch(batch)
                batch = []
        if batch:
            moved += self._move_batch(batch)
        self.client.hset(self.new.meta, "grow_moved", str(self.moved))
        return moved

    def _old_keys(self) -> Iterator[str]:
        """Every key under an old bucket tag, on every master."""
        match = "{" + self.prefix + ":*"  # a prefix holds no glob characters (PREFIX_PATTERN)
        primaries = getattr(self.client, "get_primaries", None)
        nodes = ([self.client.get_redis_connection(n)  # type: ignore[union-attr]
                  for n in primaries()] if primaries is not None else [self.client])
        for node in nodes:
            for raw in node.scan_iter(match=match, count=1000):
                key = as_text(raw)
                end = key.find("}")
                if end > 0 and key[:end + 1] in self.old_tags:
                    yield key

    # -- a batch of keys -------------------------------------------------------------------

    def _move_batch(self, keys: list[str]) -> int:
        """Move `keys` in three round trips: read them all; write every copy; only then
        delete the originals (on a cluster a pipeline runs per node in parallel, so a DEL in
        the same pipeline as its copy could land first: a kill between would lose the key)."""
        plan = [self._classify(key) for key in keys]  # an unknown family raises: nothing moved
        docs = self._docs([key for key, (family, _) in zip(keys, plan, strict=True)
                           if family in ("eff", "ws")])
        pipe = self.client.pipeline(transaction=False)
        for key, (family, _) in zip(keys, plan, strict=True):
            if family in ("copy", "eff", "ws"):
                pipe.dump(key)
                pipe.pttl(key)
            elif family == "own" or family == "effidx":
                pipe.smembers(key)
            elif family != "drop":
                pipe.zrange(key, 0, -1, withscores=True)
        replies = iter(pipe.execute())
        writes = self.client.pipeline(transaction=False)
        for key, (family, route) in zip(keys, plan, strict=True):
            if family in ("copy", "eff", "ws"):
                dumped, pttl = next(replies), next(replies)
                if family != "copy":
                    route = docs.get(key)
                if dumped is None or pttl == -2 or route is None:
                    continue  # gone meanwhile (a TTL): nothing to keep
                writes.restore(self._renamed(key, route), max(int(pttl), 0), dumped,
                               replace=True)
            elif family == "effidx":
                members = [as_text(m) for m in next(replies)]
                tag = self.new.tag_of(route or "")
                if members:  # the scope's receipt keys, renamed to where they move
                    writes.sadd(self._renamed(key, route or ""),
                                *[tag + m[m.index("}") + 1:] for m in members])
            elif family == "own":
                groups: dict[str, list[str]] = defaultdict(list)
                for raw in next(replies):
                    target, member = self._own_member(key, as_text(raw))
                    groups[target].append(member)
                for target, members in groups.items():
                    writes.sadd(target, *members)
            elif family != "drop":
                zgroups: dict[str, dict[str, float]] = defaultdict(dict)
                rest = key[key.index("}") + 1:]
                for raw, score in next(replies):
                    member = as_text(raw)
                    zgroups[self.new.tag_of(_member_route(family, member)) + rest][member] = \
                        float(score)
                for target, rows in zgroups.items():
                    writes.zadd(target, rows)
        writes.execute()
        deletes = self.client.pipeline(transaction=False)
        for key in keys:
            deletes.delete(key)
        deletes.execute()
        before, self.moved = self.moved, self.moved + len(keys)
        if self.moved // self.progress_every > before // self.progress_every:
            self.client.hset(self.new.meta, "grow_moved", str(self.moved))
            self.progress(f"moved {self.moved} keys")
        return len(keys)

    def _classify(self, key: str) -> tuple[str, str | None]:
        """(how to move `key`, the id whose bucket it goes to when the name says so)."""
        rest = key[key.index("}") + 2:]
        family, _, tail = rest.partition(":")
        if family in DROPPED:
            return "drop", None
        if family in ("eff", "ws"):
            return family, None  # <scope>:<key>: ids may hold ':', the document says which
        if family == "effidx":
            return "effidx", tail
        if family in PER_ID:
            if family == "rec":
                return "copy", tail.split(":", 1)[1]  # rec:<kind>:<id>, kinds have no ':'
            if family == "occ":
                return "copy", tail.rsplit("@", 1)[0]  # occ:<schedule key>@<nominal ms>
            if family == "lock":
                return "copy", tail.split(":", 1)[1]  # lock:schedule:<key>
            return "copy", tail
        if family in RUN_MEMBERS or family in PIPED_MEMBERS or family == "idx":
            return family, None
        if family == "own":
            return "own", None
        raise GrowError(f"{key}: key family {family!r} is unknown to this marbles-rq; "
                        f"nothing of it was moved (finish with a marbles-rq that knows it)")

    def _docs(self, keys: list[str]) -> dict[str, str]:
        """Effect receipts and workspace entries: the scope or workspace their document
        names (their key names cannot say where the id ends)."""
        if not keys:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "doc")
        found = {}
        for key, doc in zip(keys, pipe.execute(), strict=True):
            if doc is not None:
                family = key[key.index("}") + 2:].partition(":")[0]
                found[key] = str(json.loads(doc)["scope" if family == "eff" else
                                                "workspace_id"])
        return found

    def _renamed(self, key: str, route: str) -> str:
        return self.new.tag_of(route) + key[key.index("}") + 1:]

    def _own_member(self, key: str, member: str) -> tuple[str, str]:
        """``<record key>|<listing key>|<id>``: the owner set, record and listing of the
        record's new bucket."""
        record, listing, ident = member.split("|", 2)
        family, _, tail = listing[listing.index("}") + 2:].partition(":")
        tag = self.new.tag_of(tail if family == "wsidx" else ident)
        record = tag + record[record.index("}") + 1:]
        listing = tag + listing[listing.index("}") + 1:]
        return tag + key[key.index("}") + 1:], f"{record}|{listing}|{ident}"


def _member_route(family: str, member: str) -> str:
    """The id whose bucket a per-bucket index member belongs to."""
    if family in PIPED_MEMBERS:
        return member.split("|", 1)[0]  # <run id>|<key>
    if family == "occ_open":
        return member.rsplit("@", 1)[0]  # <schedule key>@<nominal ms>
    return member
