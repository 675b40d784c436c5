"""The only place where Redis key names are spelled.

Every key carries a hash tag so the store runs unchanged on a Redis Cluster:

* records of one id live in that id's bucket tag ``{<prefix>:b0042}``, next to the
  per-bucket listings they appear in, so one script can write both atomically;
* the agent namespace (provisioning keys and agents) shares one tag, because a
  provisioning key and the agent id it maps to must be checked in one script;
* deployment metadata lives under ``{<prefix>}``.

The bucket of an id is ``crc32(id) % buckets``. How a bucket is spelled is the layout:

* layout 1 (deployments created before 1,024 buckets): ``{<prefix>:b0042}``; its CRC16 slot
  is wherever that string hashes, so a few masters get more buckets than others;
* layout 2 (the default): ``{<prefix>:b0042/1024.<4 letters>}``, the letters solved so the
  tag's slot is the middle of the b-th of B equal slot ranges. Masters that own contiguous
  equal slot ranges (what ``redis-cli --cluster create`` makes) then own equal bucket counts,
  the best the pigeonhole allows. The bucket count is in the tag so that tags of different
  bucket counts never collide: growing the count moves keys to names that did not exist.

The bucket count, layout and lane count are recorded in the metadata hash at first use and
adopted from there by every later process (see RedisStore).
"""

from __future__ import annotations

import re
import zlib
from binascii import crc_hqx
from dataclasses import dataclass
from functools import lru_cache

from ..errors import ConfigError

PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,32}")
DEFAULT_PREFIX = "mrq"
DEFAULT_BUCKETS = 1024
MAX_BUCKETS = 4096
MAX_LANES = 256
SLOTS = 16384  # Redis Cluster hash slots
LAYOUT_V1 = 1  # {<prefix>:bNNNN}, 64 buckets by default (deployments before layout 2)
LAYOUT_V2 = 2  # {<prefix>:bNNNN/B.<suffix>}: slot of bucket b in the b-th of B slot ranges
LAYOUT_VERSION = LAYOUT_V2  # what a new deployment is created with
LAYOUTS = (LAYOUT_V1, LAYOUT_V2)

# Layout 2 suffixes: four characters 0x40|n, n a nibble ('@' .. 'O': no '|', '}' or ':').
# CRC16 (XMODEM, init 0, what Redis Cluster hashes) is linear over GF(2) for strings of one
# length, so crc(base + suffix) = crc(base + '\0'*4) ^ crc('@@@@') ^ crc(nibbles), and the
# 16 nibble bits span all 14 slot bits: the suffix that lands on a wanted slot is solved
# exactly (microseconds), not searched for. A process computes each tag table once.
_SUFFIX_LEN = 4


def _nibble_basis() -> list[tuple[int, int]]:
    """Echelon basis of the slot bits each nibble bit flips: (slot vector, nibble mask)."""
    basis: list[tuple[int, int]] = []
    for bit in range(4 * _SUFFIX_LEN):
        raw = bytearray(_SUFFIX_LEN)
        raw[bit // 4] = 1 << (bit % 4)
        vec, mask = crc_hqx(bytes(raw), 0) & (SLOTS - 1), 1 << bit
        for bvec, bmask in basis:
            if vec ^ bvec < vec:
                vec, mask = vec ^ bvec, mask ^ bmask
        if vec:
            basis.append((vec, mask))
            basis.sort(reverse=True)
    return basis


_BASIS = _nibble_basis()
_AT = crc_hqx(b"@" * _SUFFIX_LEN, 0)
assert len(_BASIS) == 14, "nibble suffixes must reach every slot"


def tag_on_slot(base: str, slot: int) -> str:
    """`base` + a 4-character suffix such that the string's CRC16 slot is `slot`."""
    want = (slot ^ crc_hqx(base.encode() + b"\0" * _SUFFIX_LEN, 0) ^ _AT) & (SLOTS - 1)
    mask = 0
    for vec, bmask in _BASIS:
        if want ^ vec < want:
            want, mask = want ^ vec, mask ^ bmask
    assert want == 0
    suffix = "".join(chr(0x40 | (mask >> (4 * i)) & 0xF) for i in range(_SUFFIX_LEN))
    return base + suffix


def slot_range(bucket: int, buckets: int) -> range:
    """The b-th of B equal (to one slot) ranges of the 16,384 slots."""
    return range(-(-bucket * SLOTS // buckets), -(-(bucket + 1) * SLOTS // buckets))


def _middle(slots: range) -> int:
    return slots.start + (len(slots) - 1) // 2


@lru_cache(maxsize=16)
def _v2_tags(prefix: str, buckets: int) -> tuple[str, ...]:
    """Layout 2 bucket tags of one deployment (computed once per process: ~1 ms for 1,024)."""
    return tuple("{" + tag_on_slot(f"{prefix}:b{b:04d}/{buckets}.",
                                   _middle(slot_range(b, buckets))) + "}"
                 for b in range(buckets))

# The controller's lease. With one lane it is the only lease; with several it is lane 0's,
# so a controller of an earlier version (which knows only this lease) waits while lane 0 is
# led, as it waited for a leader before.
CONTROLLER_LEASE = "controller"
_LANE_LEASE = re.compile(r"controller\.lane(\d{3})")


@dataclass(frozen=True)
class RunKeys:
    run: str
    steps: str
    output: str
    listing: str
    leases: str
    dispatch: str
    fence: str
    finished: str
    effects: str
    waits: str
    asks: str
    feed: str
    reports: str
    report_index: str
    redeliveries: str
    published: str = ""
    event_inbox: str = ""
    signals: str = ""
    notices: str = ""


@dataclass(frozen=True)
class ScheduleKeys:
    state: str
    index: str
    due: str
    open: str
    fence: str
    lock: str


@dataclass(frozen=True)
class Keyspace:
    prefix: str = DEFAULT_PREFIX
    buckets: int = DEFAULT_BUCKETS
    # Lanes: each lane is one RQ keyspace (its queues and deliveries) and one shard of the
    # controller's work. A bucket belongs to one lane, contiguously: lane k holds buckets
    # [ceil(k*B/L), ceil((k+1)*B/L)). A run's lane is recorded with the run.
    lanes: int = 1
    layout: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not PREFIX_PATTERN.fullmatch(self.prefix):
            raise ConfigError(
                f"invalid key prefix {self.prefix!r}: expected [A-Za-z0-9_.-]{{1,32}}")
        if not 1 <= self.buckets <= MAX_BUCKETS:
            raise ConfigError(f"invalid bucket count {self.buckets}: expected 1..{MAX_BUCKETS}")
        if not 1 <= self.lanes <= min(self.buckets, MAX_LANES):
            raise ConfigError(f"invalid lane count {self.lanes}: expected 1.."
                              f"{min(self.buckets, MAX_LANES)} (at most one per bucket)")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"unknown key layout {self.layout}: this marbles-rq knows "
                              f"{', '.join(map(str, LAYOUTS))}")
        if self.layout == LAYOUT_V2:
            # Resolved now, so the hot path (tag of a bucket) is one tuple index.
            object.__setattr__(self, "_tags", _v2_tags(self.prefix, self.buckets))

    # -- lanes ------------------------------------------------------------------------------

    def lane_of_bucket(self, bucket: int) -> int:
        return bucket * self.lanes // self.buckets

    def lane_of(self, ident: str) -> int:
        return self.lane_of_bucket(self.bucket_of(ident))

    def lane_buckets(self, lane: int) -> range:
        """The buckets of `lane` (contiguous)."""
        b, n = self.buckets, self.lanes
        return range(-(-lane * b // n), -(-(lane + 1) * b // n))

    def lane_lease(self, lane: int) -> str:
        """The name of the controller lease of `lane`: ``controller`` for lane 0 (the lease
        of every earlier version), ``controller.laneNNN`` for the others, kept in the tag of
        the lane's first bucket (see `lease`)."""
        return CONTROLLER_LEASE if lane == 0 else f"{CONTROLLER_LEASE}.lane{lane:03d}"

    @property
    def controllers(self) -> str:
        """Sorted set: controller token -> when it is gone unless it beats again (server
        ms): who shares the lanes."""
        return f"{{{self.prefix}}}:controllers"

    def lane_rq_prefix(self, lane: int) -> str | None:
        """The RQ keyspace (what RQ_KEY_PREFIX would be) of `lane`; None for a deployment of
        one lane, which uses RQ's own keyspace (RQ_KEY_PREFIX, `rq` by default)."""
        if self.lanes == 1:
            return None
        if self.layout == LAYOUT_V1:
            return f"{{{self.prefix}:lane{lane:03d}}}"
        # Layout 2: a slot in the middle of the lane's buckets' slots, so with one lane per
        # master (contiguous equal slot ranges) the lane's RQ keys sit on its buckets' master.
        first = self.lane_buckets(lane)
        slots = range(slot_range(first.start, self.buckets).start,
                      slot_range(first.stop - 1, self.buckets).stop)
        return "{" + tag_on_slot(f"{self.prefix}:lane{lane:03d}.", _middle(slots)) + "}"

    # -- tags -------------------------------------------------------------------------

    def bucket_of(self, ident: str) -> int:
        return zlib.crc32(ident.encode()) % self.buckets

    def tag(self, bucket: int) -> str:
        if self.layout == LAYOUT_V2:
            return self._tags[bucket]  # type: ignore[attr-defined,no-any-return]
        return f"{{{self.prefix}:b{bucket:04d}}}"

    def tags(self) -> dict[str, int]:
        """Every bucket tag of this keyspace -> its bucket (to recognise keys when growing)."""
        return {self.tag(b): b for b in range(self.buckets)}

    def tag_of(self, ident: str) -> str:
        # The keys of one id are usually spelled together (run_keys spells nine): the last
        # id's tag is kept, one tuple swapped whole, so threads sharing a keyspace are safe.
        last = self.__dict__.get("_last_tag")
        if last is not None and last[0] == ident:
            return last[1]  # type: ignore[no-any-return]
        tag = self.tag(self.bucket_of(ident))
        object.__setattr__(self, "_last_tag", (ident, tag))
        return tag

    @property
    def meta(self) -> str:
        """Hash: deployment metadata (bucket count, layout version, lanes, a growth under
        way)."""
        return f"{{{self.prefix}}}:meta"

    @property
    def workers(self) -> str:
        """Sorted set: worker name -> when it is lost (server ms) unless it beats again."""
        return f"{{{self.prefix}}}:workers"

    @property
    def workflows(self) -> str:
        """Hash: workflow name -> the defaults its runs are recorded with (engine/catalog.py),
        written by each worker that serves it."""
        return f"{{{self.prefix}}}:workflows"

    @property
    def event_triggers(self) -> str:
        """Hash: ``<source> <type>`` (``*``: any type) -> the workflow the trigger starts
        (triggers/event_catalog.py), written by each worker whose source declares it."""
        return f"{{{self.prefix}}}:event_triggers"

    @property
    def worker_lanes(self) -> str:
        """Hash: worker name -> the lanes it serves ("0,2"), written with its liveness beat."""
        return f"{{{self.prefix}}}:worker_lanes"

    @property
    def worker_versions(self) -> str:
        """Hash: worker name -> the workflow versions it serves (JSON: workflow -> versions),
        written with its first liveness beat, removed with its `worker_lanes` entry."""
        return f"{{{self.prefix}}}:worker_versions"

    # -- claimed records (kind + id) -----------------------------------------------------

    def record(self, kind: str, rid: str) -> str:
        """Hash {doc, req, own, at}: one claimed record."""
        return f"{self.tag_of(rid)}:rec:{kind}:{rid}"

    def listing(self, kind: str, bucket: int) -> str:
        """Sorted set of ids of one kind in one bucket, scored by creation time (ms)."""
        return f"{self.tag(bucket)}:idx:{kind}"

    def tag_index(self, key: str, value: str, bucket: int) -> str:
        """Sorted set: ids of the bucket's runs tagged ``key=value`` -> creation time (ms)."""
        return f"{self.tag(bucket)}:idx:tag:{key}={value}"

    def claim_keys(self, kind: str, rid: str, owner: str) -> tuple[str, str, str]:
        """record, listing and owner-set keys of one claim (the hot path: one crc32)."""
        tag = self.tag_of(rid)
        return f"{tag}:rec:{kind}:{rid}", f"{tag}:idx:{kind}", f"{tag}:own:{owner}"

    def request_marker(self, ident: str, request_id: str) -> str:
        """String with a short TTL: a write applied for `request_id`, in `ident`'s bucket, so a
        resend is answered with the first send's outcome."""
        return f"{self.tag_of(ident)}:req:{request_id}"

    def owned(self, owner: str, bucket: int) -> str:
        """Set of ``record key|listing key|member`` for everything `owner` has in a bucket."""
        return f"{self.tag(bucket)}:own:{owner}"

    # -- workspace entries (compare-and-set), bucketed by workspace --------------------

    def entry(self, workspace: str, key: str) -> str:
        return f"{self.tag_of(workspace)}:ws:{workspace}:{key}"

    def entries(self, workspace: str) -> str:
        return f"{self.tag_of(workspace)}:wsidx:{workspace}"

    # -- effect receipts, in the bucket of their scope (a run id) -----------------------

    def effect(self, scope: str, key: str) -> str:
        return f"{self.tag_of(scope)}:eff:{scope}:{key}"

    def effect_index(self, scope: str) -> str:
        """Set: the receipt keys claimed in `scope` (pruned with it)."""
        return f"{self.tag_of(scope)}:effidx:{scope}"

    def scope_fence(self, scope: str) -> str:
        """Hash whose `epoch` field fences writes made on behalf of `scope`."""
        return f"{self.tag_of(scope)}:fence:{scope}"

    # -- runs: every key of one run, and its bucket's indexes, share the run's tag ----------

    def run(self, run_id: str) -> str:
        """Hash: the run's document and the fields its scripts test (status, attempt, epoch)."""
        return f"{self.tag_of(run_id)}:run:{run_id}"

    def steps(self, run_id: str) -> str:
        """Hash: the ledger, step key ``<path>#<position>`` -> StepRecord JSON."""
        return f"{self.tag_of(run_id)}:steps:{run_id}"

    def output(self, run_id: str) -> str:
        """Stream: the run's output journal (lifecycle, stream.write, logs, final record)."""
        return f"{self.tag_of(run_id)}:out:{run_id}"

    def run_leases(self, bucket: int) -> str:
        """Sorted set: run id -> lease expiry (server ms) of executing runs in the bucket."""
        return f"{self.tag(bucket)}:leases"

    def run_dispatch(self, bucket: int) -> str:
        """Sorted set: run id -> when the controller checks that its delivery was enqueued."""
        return f"{self.tag(bucket)}:dispatch"

    def run_finished(self, bucket: int) -> str:
        """Sorted set: run id -> when the finished run may be pruned (server ms)."""
        return f"{self.tag(bucket)}:finished"

    def controller_fence(self, bucket: int) -> str:
        """Hash {epoch}: the newest controller epoch that wrote to this bucket."""
        return f"{self.tag(bucket)}:ctl"

    def run_waits(self, bucket: int) -> str:
        """Sorted set: waiting run id -> when the controller looks at it (a timer's due time,
        a question's timeout, the next check of the children it waits for; server ms)."""
        return f"{self.tag(bucket)}:waits"

    def asks(self, run_id: str) -> str:
        """Hash: the run's questions. ``<key>`` -> AskRecord JSON (never rewritten), and
        ``<key>|state`` (open | answered | timed_out | cancelled), ``<key>|rev``,
        ``<key>|answer`` (JSON), ``<key>|answered_ms``, ``<key>|timeout_at``, ``<key>|req``."""
        return f"{self.tag_of(run_id)}:asks:{run_id}"

    def signals(self, run_id: str) -> str:
        """Hash: signals sent to the run, per name: ``<name>|n`` (sent so far, the last
        sequence number), ``<name>|c`` (taken into the ledger), and for each signal not taken
        yet ``<name>|<seq>`` (its payload, JSON) and ``<name>|<seq>|at`` (sent, server ms)."""
        return f"{self.tag_of(run_id)}:sig:{run_id}"

    def feed(self, bucket: int) -> str:
        """Sorted set: open questions ``<run id>|<key>`` in the bucket -> when asked (ms)."""
        return f"{self.tag(bucket)}:feed"

    def notices(self, bucket: int) -> str:
        """Sorted set: pause notifications to POST to MARBLES_NOTIFY_URL (JSON) -> when the
        next try is due (server ms); the controller drains it (controller/notices.py)."""
        return f"{self.tag(bucket)}:notices"

    def reports(self, run_id: str) -> str:
        """Hash: the run's reports, key (``milestone:<n>``, ``result:<n>`` or given) ->
        ReportRecord JSON."""
        return f"{self.tag_of(run_id)}:reports:{run_id}"

    def redeliveries(self, bucket: int) -> str:
        """Sorted set: ``<run id>#a<attempt>`` -> when the controller redelivered that run as
        that attempt (server ms); entries older than an hour are trimmed by the scripts that
        add them (reap_run, redispatch_run). The dashboard counts them."""
        return f"{self.tag(bucket)}:redelivered"

    def report_index(self, bucket: int) -> str:
        """Sorted set: reports ``<run id>|<key>`` in the bucket -> when reported (ms)."""
        return f"{self.tag(bucket)}:reportidx"

    def published(self, run_id: str) -> str:
        """Hash: the run's published state, key -> JSON value (last write wins)."""
        return f"{self.tag_of(run_id)}:pub:{run_id}"

    def event_inbox(self, run_id: str) -> str:
        """Hash: the run's waits for events. ``<wait key>`` -> the StepRecord JSON that ended
        the wait (an event received, or its timeout), ``<wait key>|since`` and
        ``<wait key>|due`` (server ms: opened, times out; 0 = never), and ``seen|<event key>``
        for every event the run consumed (each at most once)."""
        return f"{self.tag_of(run_id)}:evin:{run_id}"

    def event_waits_tag(self) -> str:
        """The one tag of the index of runs waiting for events and of recent events by
        source, type and field (one slot of a cluster: a script on it touches it alone)."""
        return f"{{{self.prefix}:evwait}}"

    def run_keys(self, run_id: str) -> RunKeys:
        bucket = self.bucket_of(run_id)
        return RunKeys(run=self.run(run_id), steps=self.steps(run_id),
                       output=self.output(run_id), listing=self.listing("run", bucket),
                       leases=self.run_leases(bucket), dispatch=self.run_dispatch(bucket),
                       fence=self.controller_fence(bucket),
                       finished=self.run_finished(bucket), effects=self.effect_index(run_id),
                       waits=self.run_waits(bucket), asks=self.asks(run_id),
                       feed=self.feed(bucket), reports=self.reports(run_id),
                       report_index=self.report_index(bucket),
                       redeliveries=self.redeliveries(bucket),
                       published=self.published(run_id),
                       event_inbox=self.event_inbox(run_id), signals=self.signals(run_id),
                       notices=self.notices(bucket))

    # -- artifacts: an artifact's hash and its bucket's listing share its name's tag -----------

    def artifact(self, name: str) -> str:
        """Hash: an artifact's versions (``v:<n>``), counters, idempotency tokens and blob
        reference counts (lua/put_artifact.lua documents its fields)."""
        return f"{self.tag_of(name)}:art:{name}"

    def artifact_listing(self, bucket: int) -> str:
        """Sorted set: artifact names in the bucket -> when first declared or written (ms)."""
        return f"{self.tag(bucket)}:idx:art"

    # -- events: an inbound event's hash and its bucket's indexes share the event's tag --------

    def event(self, event_key: str) -> str:
        """Hash: an inbound event: `doc` (EventRecord JSON), `state` (pending | started |
        unmatched | failed), `workflow`, `run`, `received_ms`, `note`."""
        return f"{self.tag_of(event_key)}:evt:{event_key}"

    def event_listing(self, bucket: int) -> str:
        """Sorted set: event keys in the bucket by time received (server ms)."""
        return f"{self.tag(bucket)}:evidx"

    def event_offer(self, bucket: int) -> str:
        """Sorted set: journaled event keys -> when the controller delivers them to waiting
        runs (engine/event_waits.py) if their sender has not (it died in between)."""
        return f"{self.tag(bucket)}:evoffer"

    def event_pending(self, bucket: int) -> str:
        """Sorted set: pending event keys -> when the controller turns them into runs."""
        return f"{self.tag(bucket)}:evpending"

    # -- event batches: a batch group's keys and its bucket's indexes share the group's tag --

    def batch_group(self, group: str) -> str:
        """Hash: a batch group (one trigger and key value): `seq` (its open batch), `n`,
        `bytes`, `opened_ms`, `due_ms` of the open batch, `workflow`, `trigger`, `key`."""
        return f"{self.tag_of(group)}:bgrp:{group}"

    def batch(self, group: str, batch_id: str) -> str:
        """Hash: a sealed batch (its id is its run's): `n`, `opened_ms`, `sealed_ms`,
        `sealed_by` (size | bytes | time), `state` (sealed | started | failed), ..."""
        return f"{self.tag_of(group)}:batch:{batch_id}"

    def batch_items(self, group: str, batch_id: str) -> str:
        """List: the Event JSON of each event in a batch, in the order appended."""
        return f"{self.tag_of(group)}:bitems:{batch_id}"

    def batch_member(self, group: str, event_key: str) -> str:
        """String: the batch an event was appended to (an append is idempotent on it)."""
        return f"{self.tag_of(group)}:bmem:{event_key}"

    def batch_due(self, bucket: int) -> str:
        """Sorted set: groups with an open batch -> when it seals by time (server ms)."""
        return f"{self.tag(bucket)}:bdue"

    def batch_sealed(self, bucket: int) -> str:
        """Sorted set: sealed batch ids -> when the controller starts their run if their
        sealer has not."""
        return f"{self.tag(bucket)}:bsealed"

    # -- monitors: a monitor's state hash and its bucket's due index share its tag ---------

    def monitor(self, monitor_key: str) -> str:
        """Hash: a monitor's state: `rev`, `obs`, `pending`, `pending_run`, `seq`, `next_ms`,
        `last_poll_ms`, `last_change_ms`, `last_error`."""
        return f"{self.tag_of(monitor_key)}:mon:{monitor_key}"

    def monitor_due(self, bucket: int) -> str:
        """Sorted set: monitor keys in the bucket -> when they are polled next (server ms)."""
        return f"{self.tag(bucket)}:mondue"

    # -- schedules: a schedule's state, occurrences and lock share its key's tag ----------

    def schedule(self, key: str) -> str:
        """Hash: a registered schedule's cursor, history and pause flag."""
        return f"{self.tag_of(key)}:sched:{key}"

    def schedule_index(self, bucket: int) -> str:
        """Sorted set: schedule keys registered in the bucket -> registration time (ms)."""
        return f"{self.tag(bucket)}:sched_idx"

    def schedule_due(self, bucket: int) -> str:
        """Sorted set: schedule key -> when the controller looks at it next (server ms)."""
        return f"{self.tag(bucket)}:sched_due"

    def occurrence(self, key: str, occurrence_id: str) -> str:
        """Hash: one claimed occurrence ``<key>@<nominal ms>`` of schedule `key`."""
        return f"{self.tag_of(key)}:occ:{occurrence_id}"

    def occurrences_open(self, bucket: int) -> str:
        """Sorted set: occurrence ids claimed but not yet started -> claim time (ms)."""
        return f"{self.tag(bucket)}:occ_open"

    def schedule_lock(self, key: str) -> str:
        """String ``<holder>`` with a TTL: one tick of schedule `key` at a time."""
        return f"{self.tag_of(key)}:lock:schedule:{key}"

    def schedule_keys(self, key: str) -> ScheduleKeys:
        bucket = self.bucket_of(key)
        return ScheduleKeys(state=self.schedule(key), index=self.schedule_index(bucket),
                            due=self.schedule_due(bucket), open=self.occurrences_open(bucket),
                            fence=self.controller_fence(bucket), lock=self.schedule_lock(key))

    # -- the dashboard's per-minute rollups: one pair per lane, in the tag of the lane's first
    # bucket (with its fence), written by the lane's leader (controller/rollups.py) ----------

    def rollups(self, lane: int) -> str:
        """Hash: minute (epoch minutes) -> MinuteRollup JSON of the lane's runs that minute."""
        return f"{self.tag(self.lane_buckets(lane).start)}:roll:{lane}"

    def rollup_minutes(self, lane: int) -> str:
        """Sorted set: the minutes `rollups(lane)` holds, scored by themselves (to trim)."""
        return f"{self.tag(self.lane_buckets(lane).start)}:rollmin:{lane}"

    # -- the blob store (payloads/blobs.py): each blob under a tag of its own sha prefix,
    # its holders beside it; the index the garbage collection walks under {<prefix>:blobs} --

    def blob_tag(self, sha: str) -> str:
        return f"{{{self.prefix}:blob:{sha[:4]}}}"

    def blob(self, sha: str) -> str:
        """String: a blob's bytes (the Redis backend only)."""
        return f"{self.blob_tag(sha)}:{sha}"

    def blob_holders(self, sha: str) -> str:
        """Hash: holder (``run:<id>``, ``art:<name>``, ``ses:<id>``) -> when it last put the
        blob (server ms); ``$del`` -> when a collection began deleting it (other backends)."""
        return f"{self.blob_tag(sha)}:holders:{sha}"

    @property
    def blobs_index(self) -> str:
        """Sorted set: sha -> when the collection looks at the blob next (server ms)."""
        return f"{{{self.prefix}:blobs}}:index"

    @property
    def blobs_sizes(self) -> str:
        """Hash: sha -> the blob's size in bytes (for the byte count)."""
        return f"{{{self.prefix}:blobs}}:sizes"

    @property
    def blobs_stats(self) -> str:
        """Hash: ``blobs``, ``bytes`` (indexed now), ``collected`` (blobs deleted, total)."""
        return f"{{{self.prefix}:blobs}}:stats"

    # -- leases ---------------------------------------------------------------------------

    def _lease_tag(self, name: str) -> str:
        # A lane's lease lives in the tag of the lane's first bucket: on a cluster it sits
        # with (some of) the buckets it governs, and lanes' leases spread over the masters.
        lane = _LANE_LEASE.fullmatch(name)
        if lane is not None and 0 < int(lane[1]) < self.lanes:
            return self.tag(self.lane_buckets(int(lane[1])).start)
        return self.tag_of(name)

    def lease(self, name: str) -> str:
        return f"{self._lease_tag(name)}:lease:{name}"

    def lease_epoch(self, name: str) -> str:
        return f"{self._lease_tag(name)}:epoch:{name}"

    def lease_since(self, name: str) -> str:
        """String ``<epoch>|<server ms>``: when the lease's current epoch was acquired."""
        return f"{self._lease_tag(name)}:since:{name}"

    # -- the agent namespace (one tag) ----------------------------------------------------

    @property
    def agents_tag(self) -> str:
        return f"{{{self.prefix}:agents}}"

    def provisioning(self, pkey: str) -> str:
        return f"{self.agents_tag}:prov:{pkey}"

    def agent(self, agent_id: str) -> str:
        return f"{self.agents_tag}:agent:{agent_id}"

    @property
    def agent_listing(self) -> str:
        return f"{self.agents_tag}:idx:agent"

    # -- flow control: a concurrency limit's slots, under a tag of their own -------------------

    def limit_slots(self, limit_id: str) -> str:
        """Sorted set: run ids holding a slot of concurrency limit `limit_id` -> when the
        slot expires (server ms; extended with the run's lease renewals). Its own tag: one
        limit is one slot of a cluster, whatever the buckets of its runs."""
        return f"{{{self.prefix}:lim:{limit_id}}}:slots"

    def limit_holders(self, limit_id: str) -> str:
        """Hash: run id -> the attempt (delivery) holding the run's slot of `limit_id`."""
        return f"{{{self.prefix}:lim:{limit_id}}}:holders"

    # -- debounce, throttle, singleton: under the bucket tag of their key's digest ------------
    # A gate's keys live in the bucket `bucket_of(digest)`, and the runs a debounce window or
    # a singleton makes get ids of that bucket too (flow/enqueue_gates.py), so one script
    # sees the gate and the run it points to, on a server or a cluster.

    def debounce_window(self, digest: str) -> str:
        """Hash: the open debounce window of one workflow and key value: run (its run id),
        doc (the RunRecord of the window's first enqueue), in (the input so far), n (the
        enqueues merged), first/until/max (server ms: opened, closes, closes at the latest),
        rev (bumped by every merge: a reducer's compare-and-set), req (the last merge's
        request id)."""
        return f"{self.tag_of(digest)}:deb:{digest}"

    def debounce_due(self, bucket: int) -> str:
        """Sorted set: run id of a debounce window -> when the controller closes it (server
        ms); a window closed but not yet recorded as a run stays, scored when it closed."""
        return f"{self.tag(bucket)}:deb_due"

    def debounce_runs(self, bucket: int) -> str:
        """Hash: run id of an unrecorded debounce window -> its key's digest."""
        return f"{self.tag(bucket)}:deb_runs"

    def debounce_closed(self, bucket: int) -> str:
        """Hash: windows closed and not yet recorded: <run id> -> doc, <run id>|in -> input,
        <run id>|n -> enqueues merged."""
        return f"{self.tag(bucket)}:deb_closed"

    def throttle_log(self, digest: str) -> str:
        """Sorted set: run ids a throttle let through -> when (server ms), the last period's."""
        return f"{self.tag_of(digest)}:thr:{digest}"

    def singleton_pointer(self, digest: str) -> str:
        """String: "<run id>|<set at ms>" of the unfinished run of a singleton key."""
        return f"{self.tag_of(digest)}:one:{digest}"
    # -- rate limits, each under a tag of its own (flow/rate_limits.py) -------------------

    def rate_state(self, rate_id: str) -> str:
        """A rate limit's GCRA state (flow/rate_limits.py), under the limit's own tag."""
        return f"{{{self.prefix}:rate:{rate_id}}}:state"

    def rate_queue(self, rate_id: str) -> str:
        """The runs a rate limit holds, in order of arrival."""
        return f"{{{self.prefix}:rate:{rate_id}}}:queue"

    def rate_admitted(self, rate_id: str) -> str:
        """A rate limit's recent admissions, by token (a resend takes nothing more)."""
        return f"{{{self.prefix}:rate:{rate_id}}}:admitted"

    @property
    def rate_names(self) -> str:
        """Every rate limit seen: name -> JSON (its family, the rate its source declares)."""
        return f"{{{self.prefix}}}:rate_names"

    @property
    def rate_overrides(self) -> str:
        """Rates set at run time (`limits set`): name -> "<rate>|<burst>"."""
        return f"{{{self.prefix}}}:rate_overrides"

    # -- durable mutexes, each under a tag of its own (flow/locks.py) -----------------------

    def lock_state(self, lock_id: str) -> str:
        """Hash: a lock's name, its holder (run, epoch, since, until) and its queue's
        bookkeeping (flow/locks.py), under the lock's own tag."""
        return f"{{{self.prefix}:lock:{lock_id}}}:state"

    def lock_queue(self, lock_id: str) -> str:
        """Sorted set: the runs waiting for a lock -> their arrival number (the FIFO)."""
        return f"{{{self.prefix}:lock:{lock_id}}}:queue"

    @property
    def lock_names(self) -> str:
        """Hash: every lock a run took or waited for: name -> its id (`locks` lists them)."""
        return f"{{{self.prefix}}}:lock_names"

    # -- sessions (conversation transcripts, marbles_rq/sessions/): every key of one session
    # shares the session id's bucket tag, so one script appends on a server or a cluster ------

    def session(self, session_id: str) -> str:
        """Hash: a session: doc (SessionRecord JSON), n (messages so far), created_ms,
        last_ms (server ms), keep ("1": created by a client, kept until deleted)."""
        return f"{self.tag_of(session_id)}:ses:{session_id}"

    def session_messages(self, session_id: str) -> str:
        """Stream: the session's messages, entry id ``0-<position>``; fields t (server ms),
        m (the stored message), k (its idempotency key)."""
        return f"{self.tag_of(session_id)}:sesmsg:{session_id}"

    def session_idem(self, session_id: str) -> str:
        """Hash: idempotency key -> position of the message appended with it (kept for the
        session's lifetime)."""
        return f"{self.tag_of(session_id)}:seskey:{session_id}"

    def session_owners(self, session_id: str) -> str:
        """Set: the run ids that opened the session; it goes when the last is pruned."""
        return f"{self.tag_of(session_id)}:sesown:{session_id}"

    def run_sessions(self, run_id: str) -> str:
        """Set, in the run's bucket: the session ids the run opened (released when it is
        pruned: controller/pruning.py)."""
        return f"{self.tag_of(run_id)}:runses:{run_id}"
