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
from typing import Any

from ..errors import ConfigError, MarblesError
from .connection import Client
from .keys import LAYOUT_V2, MAX_BUCKETS, Keyspace
from .scripts import Scripts

GROW_TOKEN = "buckets-grow"
CONTROLLER_LEASE = "controller"  # controller/loop.py LEASE_NAME (not imported: no cycle)

# Key families under a bucket tag, after ``<tag>:``. A family this module does not know stops
# the growth (nothing is moved blindly: a rerun by a marbles-rq that knows it finishes).
PER_ID = {"rec", "run", "steps", "out", "asks", "reports", "eff", "effidx", "fence", "ws",
          "wsidx", "lease", "epoch", "since", "evt", "mon", "sched", "occ", "lock"}
RUN_MEMBERS = {"leases", "dispatch", "finished", "waits", "evidx", "evpending", "mondue",
               "sched_idx", "sched_due", "occ_open"}  # members are (hold) the routing ids
PIPED_MEMBERS = {"feed", "reportidx"}  # members are ``<run id>|<key>``
DROPPED = {"req", "ctl"}  # resend markers (60 s, offline now); fences (step 1)


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
    buckets, layout, lanes, grow_to, moved = (_s(v) if v is not None else "" for v in raw)
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
        if holder is not None and not _s(holder).endswith("|" + GROW_TOKEN):
            raise GrowError(f"a controller leads ({_s(holder)}): stop every controller and "
                            f"worker of this deployment before growing its buckets")
        epoch = self.client.get(self.old.lease_epoch(CONTROLLER_LEASE))
        # No TTL: controllers that still have the old layout must never lead again.
        if not self.client.set(self.tombstone_key, f"{_s(epoch or '0')}|{GROW_TOKEN}", nx=True):
            holder = self.client.get(self.tombstone_key)
            if holder is None or not _s(holder).endswith("|" + GROW_TOKEN):
                raise GrowError(f"a controller took the lease ({_s(holder or '')}): stop every "
                                f"controller and worker before growing the buckets")
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
            epochs = [int(_s(v)) for v in pipe.execute() if v is not None]
            self.client.hset(meta, "grow_fence", str(max(epochs, default=0)))
            recorded = self.client.hget(meta, "grow_fence")
        fence = int(_s(recorded))
        if fence:
            pipe = self.client.pipeline(transaction=False)
            for b in range(self.to):
                pipe.hset(self.new.controller_fence(b), "epoch", str(fence))
            pipe.execute()

    def _move_pass(self) -> int:
        moved = 0
        for key in self._old_keys():
            if key == self.tombstone_key:
                continue
            self._move(key)
            moved += 1
            self.moved += 1
            if self.moved % self.progress_every == 0:
                self.client.hset(self.new.meta, "grow_moved", str(self.moved))
                self.progress(f"moved {self.moved} keys")
        self.client.hset(self.new.meta, "grow_moved", str(self.moved))
        return moved

    def _old_keys(self) -> Iterator[str]:
        """Every key under an old bucket tag, on every master."""
        match = "{" + self.prefix.replace("[", "\\[") + ":*"
        primaries = getattr(self.client, "get_primaries", None)
        nodes = ([self.client.get_redis_connection(n)  # type: ignore[union-attr]
                  for n in primaries()] if primaries is not None else [self.client])
        for node in nodes:
            for raw in node.scan_iter(match=match, count=1000):
                key = _s(raw)
                end = key.find("}")
                if end > 0 and key[:end + 1] in self.old_tags:
                    yield key

    # -- one key ---------------------------------------------------------------------------

    def _move(self, key: str) -> None:
        rest = key[key.index("}") + 2:]
        family, _, tail = rest.partition(":")
        if family in DROPPED:
            self.client.delete(key)
        elif family == "effidx":
            self._move_effect_index(key, tail)
        elif family in PER_ID:
            route = self._route(key, family, tail)
            if route is not None:
                self._copy(key, self.new.tag_of(route) + key[key.index("}") + 1:])
            else:
                self.client.delete(key)  # vanished meanwhile (a TTL), nothing to keep
        elif family in RUN_MEMBERS or family in PIPED_MEMBERS or family in ("idx", "own"):
            self._split(key, family, rest)
        else:
            raise GrowError(f"{key}: key family {family!r} is unknown to this marbles-rq; "
                            f"nothing of it was moved (rerun with a marbles-rq that knows it)")

    def _route(self, key: str, family: str, tail: str) -> str | None:
        """The id whose bucket a per-id key lives in."""
        if family == "rec":
            return tail.split(":", 1)[1]
        if family in ("eff", "ws"):
            # <scope>:<key> / <workspace>:<key>: ids may hold ':', the document says which.
            doc = self.client.hget(key, "doc")
            if doc is None:
                return None
            return str(json.loads(doc)["scope" if family == "eff" else "workspace_id"])
        if family == "occ":
            return tail.rsplit("@", 1)[0]
        if family == "lock":
            return tail.split(":", 1)[1]  # lock:schedule:<key>
        return tail

    def _copy(self, old: str, new: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.dump(old)
        pipe.pttl(old)
        dumped, pttl = pipe.execute()
        if dumped is None:
            return
        if pttl == -2:
            return  # expired between the two reads
        self.client.restore(new, max(int(pttl), 0), dumped, replace=True)
        self.client.delete(old)

    def _move_effect_index(self, key: str, scope: str) -> None:
        """A scope's receipt keys, renamed to the scope's new bucket (where they move)."""
        tag = self.new.tag_of(scope)
        members = [_s(m) for m in self.client.smembers(key)]
        if members:
            self.client.sadd(tag + key[key.index("}") + 1:],
                             *[tag + m[m.index("}") + 1:] for m in members])
        self.client.delete(key)

    def _split(self, key: str, family: str, rest: str) -> None:
        """Move the members of a per-bucket index to the same index in their new buckets."""
        kind = _s(self.client.type(key))
        rows: Any
        if kind == "zset":
            rows = self.client.zrange(key, 0, -1, withscores=True)
            members: list[tuple[str, float]] = [(_s(m), float(s)) for m, s in rows]
        elif kind == "set":
            members = [(_s(m), 0.0) for m in self.client.smembers(key)]
        elif kind == "none":
            return
        else:
            raise GrowError(f"{key}: expected a set or sorted set, found a {kind}")
        groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for member, score in members:
            if family == "own":
                target, member = self._own_member(rest, member)
            else:
                route = member.split("|", 1)[0] if family in PIPED_MEMBERS else member
                if family == "occ_open":
                    route = member.rsplit("@", 1)[0]  # <schedule key>@<nominal ms>
                target = self.new.tag_of(route) + ":" + rest
            groups[target].append((member, score))
        pipe = self.client.pipeline(transaction=False)
        for target, rows in groups.items():
            if kind == "zset":
                pipe.zadd(target, {m: s for m, s in rows})
            else:
                pipe.sadd(target, *[m for m, _ in rows])
        pipe.execute()
        self.client.delete(key)

    def _own_member(self, rest: str, member: str) -> tuple[str, str]:
        """``<record key>|<listing key>|<id>``: the owner set, record and listing of the
        record's new bucket."""
        record, listing, ident = member.split("|", 2)
        listing_rest = listing[listing.index("}") + 2:]
        family, _, tail = listing_rest.partition(":")
        route = tail if family == "wsidx" else ident
        tag = self.new.tag_of(route)
        record = tag + record[record.index("}") + 1:]
        listing = tag + listing[listing.index("}") + 1:]
        return f"{tag}:{rest}", f"{record}|{listing}|{ident}"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

