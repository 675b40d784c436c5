"""The only module that calls Lua: loads ``lua/*.lua`` and exposes one method per script.

Calls go out as EVALSHA; a NOSCRIPT answer (Redis restarted or failed over, so its script
cache is empty) is answered with EVAL of the same source. A dropped connection or a timeout
is retried with the *same* arguments until a short deadline: every write script carries a
request id or an owner token and answers a resend with the first send's outcome, so a retry
can never apply a write twice (README, "No silent duplicate writes").
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import redis
from redis.cluster import RedisCluster

from .. import metrics
from ..errors import ScriptReplyError
from .connection import Client
from .keys import RunKeys, ScheduleKeys
from .replies import as_text

T = TypeVar("T")
_RETRY_PAUSES_S = (0.05, 0.1, 0.2, 0.4, 0.8)
# A request marker outlives every resend (they stop after `retry_s`, 3 s by default).
MARKER_MS = 60_000
# claim_runs takes a chunk's records in one call while their bytes stay below this.
CHUNK_SCRIPT_BYTES = 8 << 20
# A started occurrence is kept 8 days (longer than a run's default retention), then expires.
OCCURRENCE_KEEP_MS = 8 * 86_400_000


def lua_dir() -> Path:
    """`lua/` inside the installed package (wheel) or at the top of a source checkout."""
    packaged = Path(str(resources.files("marbles_rq"))) / "lua"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "lua"


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str


def load_scripts(directory: Path | None = None) -> dict[str, Script]:
    directory = directory or lua_dir()
    scripts = {}
    for path in sorted(directory.glob("*.lua")):
        source = path.read_text()
        scripts[path.stem] = Script(path.stem, source, hashlib.sha1(source.encode()).hexdigest())
    if not scripts:
        raise FileNotFoundError(f"no Lua scripts found in {directory}")
    return scripts


_SCRIPTS: dict[str, Script] | None = None


def _scripts() -> dict[str, Script]:
    global _SCRIPTS
    if _SCRIPTS is None:
        _SCRIPTS = load_scripts()
    return _SCRIPTS


@dataclass(frozen=True)
class Claimed:
    won: bool
    doc: bytes | None  # the existing document when not won
    at_ms: int = 0


@dataclass(frozen=True)
class Provisioned:
    status: str  # created | exists | moved | taken
    doc: bytes | None = None
    agent_id: str | None = None


@dataclass(frozen=True)
class CasResult:
    ok: bool
    current: str | None  # the entry's updated_at on conflict; None when absent


@dataclass(frozen=True)
class EffectClaim:
    status: str  # ok | exists | stale_epoch
    doc: bytes | None = None
    epoch: int = 0


@dataclass(frozen=True)
class LeaseReply:
    held: bool  # True when the caller holds it now
    epoch: int
    holder: str | None = None
    ttl_ms: int = 0


@dataclass(frozen=True)
class JobPush:
    """A job hash to write and its id to push on a queue list: RQ's enqueue of one job, done
    by a script. The key names and the fields are RQ's, built by RQ in the transport
    (marbles_rq/transport/dispatch.py); the scripts only write them."""

    job_key: str
    queue_key: str
    queues_key: str  # RQ's set of queue keys, where the queue is registered
    job_id: str
    fields: tuple[str | bytes, ...]  # field, value, field, value, ...

    def keys(self) -> list[str]:
        return [self.job_key, self.queue_key, self.queues_key]

    def args(self) -> list[str | bytes | int]:
        return [self.job_id, len(self.fields) // 2, *self.fields]


@dataclass(frozen=True)
class Reply:
    """A run script's reply: its status word and the values after it (see each header)."""

    status: str
    values: list[Any]


class MetaReply(NamedTuple):
    """A deployment's recorded layout, as stored (strings; "" = not recorded)."""

    buckets: str
    layout: str
    lanes: str
    grow_to: str


class Scripts:
    """Typed calls, keyword arguments in ARGV order; each returns its reply as a value."""

    def __init__(self, client: Client, *, retry_s: float = 3.0) -> None:
        self.client = client
        self.retry_s = retry_s
        self.scripts = _scripts()

    def _resending(self, send: Callable[[], T]) -> T:
        """Run `send`, resending after a dropped connection or a timeout until a short
        deadline. Only for sends that are safe to repeat (request ids, tokens, sequences)."""
        deadline = 0.0  # set at the first failure: the happy path reads no clock
        for pause in (*_RETRY_PAUSES_S, None):
            try:
                return send()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                metrics.redis_error(exc)
                deadline = deadline or time.monotonic() + self.retry_s
                if pause is None or time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    @staticmethod
    def _checked(name: str, reply: Any) -> list[Any]:
        if not isinstance(reply, list) or not reply:
            raise ScriptReplyError(f"{name} replied {reply!r}")
        return reply

    def call(self, name: str, keys: list[str], args: list[str | bytes | int]) -> list[Any]:
        script = self.scripts[name]

        def send() -> Any:
            try:
                return self.client.evalsha(script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                return self.client.eval(script.source, len(keys), *keys, *args)

        try:
            reply = self._resending(send)
        except redis.RedisError as exc:  # refusals (OOM, READONLY ...) and script errors
            metrics.redis_error(exc)
            raise
        return self._checked(name, reply)

    def call_many(self, name: str, calls: list[tuple[list[str], list[str | bytes | int]]],
                  *, transaction: bool = False, errors: bool = False) -> list[Any]:
        """Many calls of one script in one round trip on a single server, and in one round
        trip per master on a cluster (redis-py's cluster pipeline refuses scripts, so the
        calls are grouped by the master of their slot and pipelined on that master's
        connection; per slot with `transaction`, since MULTI/EXEC on a cluster takes one
        slot). Each call must be safe to resend (request ids), because a failed pipeline is
        resent whole.

        Redis reads a long pipeline in chunks (16 KiB) and, with appendfsync always, fsyncs
        after each chunk that wrote. `transaction` wraps the calls in MULTI/EXEC: they run
        together at EXEC, with one fsync for all (as RQ's enqueue_many), and hold the server
        meanwhile; for batches that are written, not read, in a hurry.

        `errors`: a call that failed on its keys (a script error, a key of the wrong type)
        is returned in its place as the exception, so one bad call costs only itself; else
        the first one is raised."""
        replies: list[Any]
        if len(calls) < 2:
            replies = []
            for keys, args in calls:  # one call: no pipeline to group
                try:
                    replies.append(self.call(name, keys, args))
                except redis.ResponseError as exc:
                    if not errors:
                        raise
                    replies.append(exc)
            return replies
        if isinstance(self.client, RedisCluster):
            replies = self._call_per_node(name, calls, transaction=transaction)
        else:
            replies = self._pipelined(self.client, name, calls, transaction=transaction)
        out: list[Any] = []
        for reply in replies:
            if isinstance(reply, Exception):
                metrics.redis_error(reply)
                if not errors or not isinstance(reply, redis.ResponseError):
                    raise reply
                out.append(reply)
            else:
                out.append(self._checked(name, reply))
        return out

    def _pipelined(self, client: Any, name: str,
                   calls: list[tuple[list[str], list[str | bytes | int]]], *,
                   transaction: bool) -> list[Any]:
        script = self.scripts[name]

        def pipelined() -> list[Any]:
            pipe = client.pipeline(transaction=transaction)
            for keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return list(pipe.execute(raise_on_error=False))

        def send() -> list[Any]:
            replies = pipelined()
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
                client.script_load(script.source)  # cache was empty; all were refused
                replies = pipelined()
            return replies

        try:
            return self._resending(send)
        except redis.RedisError as exc:
            metrics.redis_error(exc)
            raise

    def _call_per_node(self, name: str, calls: list[tuple[list[str], list[str | bytes | int]]],
                       *, transaction: bool) -> list[Any]:
        """call_many on a cluster: one pipeline per master (per slot for a transaction). A
        call the master answers MOVED or ASK to (a slot being moved, a failover) is sent
        again alone through the cluster client, which follows the redirection."""
        cluster: Any = self.client  # redis-py's cluster routing calls are untyped
        groups: dict[Any, list[int]] = {}
        for i, (keys, _) in enumerate(calls):
            slot = cluster.keyslot(keys[0])
            node = cluster.get_node_from_key(keys[0])
            groups.setdefault((node.name, slot) if transaction else node.name, []).append(i)
        replies: list[Any] = [None] * len(calls)
        for indexes in groups.values():
            part = [calls[i] for i in indexes]
            node = cluster.get_node_from_key(part[0][0][0])
            try:
                got = self._pipelined(cluster.get_redis_connection(node), name, part,
                                      transaction=transaction)
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                got = [None] * len(part)  # that master failed or moved: one by one below
            for i, reply in zip(indexes, got, strict=True):
                if reply is None or (isinstance(reply, redis.ResponseError) and str(
                        reply).startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"))):
                    keys, args = calls[i]
                    try:
                        reply = self.call(name, keys, args)
                    except redis.ResponseError as exc:
                        reply = exc
                replies[i] = reply
        return replies

    def _unexpected(self, name: str, reply: list[Any]) -> ScriptReplyError:
        return ScriptReplyError(f"{name} replied {reply!r}")

    # -- records -----------------------------------------------------------------------

    def claim_record(self, *, record_key: str, listing_key: str, owned_key: str,
                     marker_key: str, record_id: str, doc: bytes, request_id: str,
                     owner: str) -> Claimed:
        reply = self.call("claim_record", [record_key, listing_key, owned_key, marker_key],
                          [record_id, doc, request_id, owner, MARKER_MS])
        status = as_text(reply[0])
        if status == "ok":
            return Claimed(True, None, int(reply[1]))
        if status == "exists":
            return Claimed(False, reply[1])
        raise self._unexpected("claim_record", reply)

    def provision_agent(self, *, provisioning_key: str, agent_key: str, listing_key: str,
                        agent_id: str, doc: bytes, request_id: str,
                        pkey: str) -> Provisioned:
        reply = self.call("provision_agent", [provisioning_key, agent_key, listing_key],
                          [agent_id, doc, request_id, pkey])
        status = as_text(reply[0])
        if status in ("created", "exists"):
            return Provisioned(status, reply[1])
        if status == "moved":
            return Provisioned(status, agent_id=as_text(reply[1]))
        if status == "taken":
            return Provisioned(status)
        raise self._unexpected("provision_agent", reply)

    def cas_entry(self, *, entry_key: str, listing_key: str, owned_key: str, marker_key: str,
                  expected: str, updated_at: str, doc: bytes, request_id: str, owner: str,
                  key: str) -> CasResult:
        reply = self.call("cas_entry", [entry_key, listing_key, owned_key, marker_key],
                          [expected, updated_at, doc, request_id, owner, key, MARKER_MS])
        status = as_text(reply[0])
        if status == "ok":
            return CasResult(True, updated_at)
        if status == "conflict":
            return CasResult(False, as_text(reply[1]) or None)
        raise self._unexpected("cas_entry", reply)

    def claim_effect(self, *, receipt_key: str, fence_key: str, index_key: str, doc: bytes,
                     request_id: str, epoch: int | None, required: bool = False,
                     lease: tuple[str, str] | None = None) -> EffectClaim:
        """`required`: the fence record must exist (a run's hash; missing: purged).
        `lease`: (leases zset, run id): the claimer's lease there must be live."""
        reply = self.call("claim_effect", [receipt_key, fence_key, index_key,
                                           *([lease[0]] if lease else [])],
                          [doc, request_id, "" if epoch is None else epoch,
                           "1" if required else "", lease[1] if lease else ""])
        status = as_text(reply[0])
        if status == "ok":
            return EffectClaim("ok")
        if status == "exists":
            return EffectClaim("exists", reply[1])
        if status == "stale_epoch":
            return EffectClaim("stale_epoch", epoch=int(reply[1]))
        raise self._unexpected("claim_effect", reply)

    def purge_owned(self, *, owned_key: str,
                    members: list[tuple[str, str, str]]) -> tuple[int, int]:
        """`members` are (raw member, record key, listing key); returns (removed, remaining)."""
        keys = [owned_key]
        for _, record_key, listing_key in members:
            keys += [record_key, listing_key]
        reply = self.call("purge_owned", keys, [m for m, _, _ in members])
        if as_text(reply[0]) != "ok":
            raise self._unexpected("purge_owned", reply)
        return int(reply[1]), int(reply[2])

    def purge_agent(self, *, provisioning_key: str, agent_key: str, listing_key: str,
                    agent_id: str) -> str:
        reply = self.call("purge_agent", [provisioning_key, agent_key, listing_key], [agent_id])
        status = as_text(reply[0])
        if status not in ("ok", "not_found", "moved"):
            raise self._unexpected("purge_agent", reply)
        return status

    # -- leases ------------------------------------------------------------------------

    def acquire_lease(self, *, lease_key: str, epoch_key: str, since_key: str, token: str,
                      ttl_ms: int, floor: int = 0) -> LeaseReply:
        reply = self.call("acquire_lease", [lease_key, epoch_key, since_key],
                          [token, ttl_ms, floor])
        status = as_text(reply[0])
        if status == "ok":
            return LeaseReply(True, int(reply[1]), token, int(reply[2]))
        if status == "held":
            return LeaseReply(False, int(reply[1]), as_text(reply[2]), int(reply[3]))
        raise self._unexpected("acquire_lease", reply)

    def renew_lease(self, *, lease_key: str, epoch: int, token: str, ttl_ms: int) -> bool:
        reply = self.call("renew_lease", [lease_key], [epoch, token, ttl_ms])
        status = as_text(reply[0])
        if status not in ("ok", "lost"):
            raise self._unexpected("renew_lease", reply)
        return status == "ok"

    def release_lease(self, *, lease_key: str, epoch: int, token: str) -> bool:
        reply = self.call("release_lease", [lease_key], [epoch, token])
        status = as_text(reply[0])
        if status not in ("ok", "not_held"):
            raise self._unexpected("release_lease", reply)
        return status == "ok"

    # -- runs: thin calls; runs.py interprets the replies ---------------------------------

    def _reply(self, name: str, keys: list[str], args: list[str | bytes | int],
               statuses: tuple[str, ...]) -> Reply:
        return self._parse(name, self.call(name, keys, args), statuses)

    def _parse(self, name: str, raw: Any, statuses: tuple[str, ...]) -> Reply:
        reply = self._checked(name, raw)
        status = as_text(reply[0])
        if status not in statuses:
            raise self._unexpected(name, reply)
        return Reply(status, reply[1:])

    @staticmethod
    def _claim_run_call(keys: RunKeys, run_id: str, doc: bytes, request_id: str, queue: str,
                        timeout_ms: int, max_deliveries: int, grace_ms: int,
                        event: bytes, retention_ms: int, lane: int = 0,
                        push: JobPush | None = None, limit: str = ""
                        ) -> tuple[list[str], list[str | bytes | int]]:
        """`push`: also enqueue the run's first delivery, in the same call (the store and
        RQ share one standalone Redis). `limit`: the run's concurrency limit (flow control),
        last, after the push."""
        call_keys = [keys.run, keys.listing, keys.dispatch, keys.output]
        args: list[str | bytes | int] = [run_id, doc, request_id, queue, timeout_ms,
                                         max_deliveries, grace_ms, event, retention_ms, lane]
        if push is not None:
            call_keys += push.keys()
            args += push.args()
        if limit:
            args.append(limit)
        return call_keys, args

    def claim_run(self, *, keys: RunKeys, run_id: str, doc: bytes, request_id: str, queue: str,
                  timeout_ms: int, max_deliveries: int, grace_ms: int, event: bytes,
                  retention_ms: int, lane: int = 0, push: JobPush | None = None,
                  limit: str = "") -> Reply:
        """{"ok", created_ms, enqueued} | {"exists", doc, status} | {"corrupt", reason}."""
        return self._reply("claim_run", *self._claim_run_call(
            keys, run_id, doc, request_id, queue, timeout_ms, max_deliveries, grace_ms, event,
            retention_ms, lane, push, limit), ("ok", "exists", "corrupt"))

    def claim_runs(self, calls: list[dict[str, Any]]) -> list[Reply]:
        """claim_run for many runs in one round trip and one fsync (see call_many); on one
        standalone server, runs that all enqueue their delivery go in one script call."""
        return self.claim_runs_later(calls)()

    def claim_runs_later(self, calls: list[dict[str, Any]]) -> Callable[[], list[Reply]]:
        """`claim_runs` in two halves: the arguments are built now, and the returned call
        sends them (a batch builds the next chunk while the server writes this one)."""
        chunk = self._claim_chunk(calls)
        if chunk is not None:
            keys, args = chunk
            return lambda: self._claim_replies(self.call("claim_runs", keys, args))
        many = [self._claim_run_call(**c) for c in calls]
        return lambda: self._claim_replies(self.call_many("claim_run", many, transaction=True))

    def _claim_replies(self, replies: list[Any]) -> list[Reply]:
        out = []
        for reply in replies:
            status = as_text(reply[0])
            if status not in ("ok", "exists", "corrupt"):
                raise self._unexpected("claim_run", reply)
            out.append(Reply(status, reply[1:]))
        return out

    def _claim_chunk(self, calls: list[dict[str, Any]]
                     ) -> tuple[list[str], list[str | bytes | int]] | None:
        """claim_runs.lua's KEYS and ARGV for `calls`, or None when they do not fit it: a
        cluster, fewer than two, a call without a push, job hashes whose fields differ in
        name or order, or records larger than CHUNK_SCRIPT_BYTES in all (the script holds
        all of them at once; one claim_run at a time holds one). Each is then written as
        claim_run writes it."""
        if len(calls) < 2 or type(self.client) is not redis.Redis:
            return None
        if sum(len(call["doc"]) for call in calls) > CHUNK_SCRIPT_BYTES:
            return None
        pushes: list[JobPush | None] = [c.get("push") for c in calls]
        if any(push is None for push in pushes):
            return None
        jobs = [push.fields for push in pushes if push is not None]
        names = jobs[0][0::2]
        if any(fields[0::2] != names for fields in jobs):
            return None
        shared: list[str | bytes] = []
        own: list[int] = []  # positions of the values that differ between deliveries
        for i, name in enumerate(names):
            value = jobs[0][2 * i + 1]
            if all(fields[2 * i + 1] == value for fields in jobs):
                shared += [name, value]
            else:
                own.append(2 * i + 1)
        keys: list[str] = []
        args: list[str | bytes | int] = [len(calls), len(shared) // 2, len(own), *shared,
                                         *(jobs[0][i - 1] for i in own)]
        for call, push in zip(calls, pushes, strict=True):
            assert push is not None
            run_keys: RunKeys = call["keys"]
            keys += [run_keys.run, run_keys.listing, run_keys.dispatch, run_keys.output,
                     *push.keys()]
            args += [call["run_id"], call["doc"], call["request_id"], call["queue"],
                     call["timeout_ms"], call["max_deliveries"], call["grace_ms"],
                     call["event"], call["retention_ms"], call.get("lane", 0), push.job_id,
                     call.get("limit", ""), *(push.fields[i] for i in own)]
        return keys, args

    def seed_and_claim_run(self, *, seed: Sequence[tuple[str, bytes]],
                           claim: dict[str, Any]) -> tuple[Reply, Reply]:
        """seed_ledger then claim_run for one run, in one MULTI/EXEC on a single server:
        both land or neither. (On a cluster, where scripts cannot share a transaction, the
        seed is sent first: a crash in between leaves a ledger no run reads.) Both are safe
        to resend: the claim's request id answers "ok" again, and the seed writes nothing
        once the run exists."""
        keys: RunKeys = claim["keys"]
        seed_keys = [keys.run, keys.steps]
        seed_args: list[str | bytes | int] = [x for pair in seed for x in pair]
        claim_keys, claim_args = self._claim_run_call(**claim)
        if isinstance(self.client, RedisCluster):
            seeded = self.call("seed_ledger", seed_keys, seed_args)
            claimed = self.call("claim_run", claim_keys, claim_args)
        else:
            scripts = (self.scripts["seed_ledger"], self.scripts["claim_run"])

            def send() -> list[Any]:
                # EVAL with the sources, not EVALSHA: inside MULTI a script missing from
                # the server's cache fails alone at EXEC while the other one runs, and a
                # claim that landed without its seed would be a rerun without its ledger.
                pipe = self.client.pipeline(transaction=True)
                pipe.eval(scripts[0].source, len(seed_keys), *seed_keys, *seed_args)
                pipe.eval(scripts[1].source, len(claim_keys), *claim_keys, *claim_args)
                return list(pipe.execute(raise_on_error=False))

            replies = self._resending(send)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            seeded = self._checked("seed_ledger", replies[0])
            claimed = self._checked("claim_run", replies[1])
        if as_text(seeded[0]) not in ("ok", "exists", "corrupt"):
            raise self._unexpected("seed_ledger", seeded)
        if as_text(claimed[0]) not in ("ok", "exists", "corrupt"):
            raise self._unexpected("claim_run", claimed)
        return Reply(as_text(seeded[0]), seeded[1:]), Reply(as_text(claimed[0]), claimed[1:])

    def start_attempt(self, *, keys: RunKeys, run_id: str, attempt: int, ttl_ms: int,
                      worker: str, final_cancel: bytes, final_timeout: bytes,
                      token: str, slot: bool = False, slot_until: int = 0) -> Reply:
        """`slot`: the caller holds the run's concurrency slot; a run with a limit answers
        needs_slot without it (flow control). `slot_until`: that slot's expiry, where the
        lease is capped (0: none)."""
        return self._reply(
            "start_attempt",
            [keys.run, keys.steps, keys.leases, keys.dispatch, keys.output, keys.finished],
            [run_id, attempt, ttl_ms, worker, final_cancel, final_timeout, token,
             "1" if slot else "", slot_until],
            ("ok", "missing", "settled", "stale_attempt", "busy", "cancelled", "timed_out",
             "corrupt", "waiting", "paused", "needs_slot"))

    def start_step(self, *, keys: RunKeys, epoch: int, seq: int, late: bool,
                   starts: Sequence[tuple[str, bytes, bytes]]) -> Reply:
        """`starts`: (step key, running StepRecord JSON, step_started event) triples; one
        checked step (late=False), or any number already running (late=True)."""
        flat: list[str | bytes | int] = [x for start in starts for x in start]
        return self._reply("start_step", [keys.run, keys.steps, keys.output],
                           [epoch, seq, "late" if late else "check", *flat],
                           ("ok", "stale", "settled", "cancelled", "timed_out", "paused"))

    def note_child(self, *, keys: RunKeys, epoch: int, seq: int, step_key: str,
                   record: bytes) -> Reply:
        """The parent's ledger names the child before the child is recorded."""
        return self._reply("note_child", [keys.run, keys.steps], [epoch, seq, step_key, record],
                           ("ok", "stale", "settled", "cancelled", "paused", "timed_out"))

    def commit_step(self, *, keys: RunKeys, epoch: int, step_key: str, record: bytes,
                    event_type: str, event: bytes, run_id: str, ttl_ms: int,
                    seq: int, starts: Sequence[tuple[str, bytes, bytes]] = ()) -> Reply:
        """`starts`: deferred starts written before the outcome, as in start_step."""
        flat: list[str | bytes | int] = [x for start in starts for x in start]
        return self._reply("commit_step", [keys.run, keys.steps, keys.leases, keys.output],
                           [epoch, step_key, record, event_type, event, run_id, ttl_ms, seq,
                            *flat],
                           ("ok", "cancelled", "timed_out", "stale", "settled", "paused"))

    def append_output(self, *, keys: RunKeys, epoch: int, type: str, data: bytes, seq: int,
                      max_entries: int, max_bytes: int, frame: str = "", index: int = 0
                      ) -> Reply:
        """`frame`, `index`: the write's position in the body ("" for none): a position
        written before answers replayed, writing nothing."""
        return self._reply("append_output", [keys.run, keys.output],
                           [epoch, type, data, seq, max_entries, max_bytes, frame, index],
                           ("ok", "replayed", "capped", "stale", "settled"))

    def renew_attempt(self, *, keys: RunKeys, epoch: int, ttl_ms: int, run_id: str,
                      cap_ms: int = 0) -> Reply:
        return self._reply("renew_attempt", [keys.run, keys.leases],
                           [epoch, ttl_ms, run_id, cap_ms],
                           ("ok", "stale", "settled", "cancelled", "timed_out", "expired"))

    def renew_attempts(self, items: Sequence[tuple[RunKeys, int, int, str]]
                       ) -> list[str | None]:
        """renew_attempt for many executions (keys, epoch, ttl_ms, run id; no slot cap) in
        one pipeline per master: each status, None for a call that failed on its keys."""
        replies = self.call_many("renew_attempt", [
            ([keys.run, keys.leases], [epoch, ttl_ms, run_id, 0])
            for keys, epoch, ttl_ms, run_id in items], errors=True)
        return [None if isinstance(r, Exception) else as_text(r[0]) for r in replies]

    def settle_run(self, *, keys: RunKeys, epoch: int, status: str, result: bytes,
                   error: bytes, event: bytes, run_id: str) -> Reply:
        return self._reply("settle_run", *self._settle_call(keys, epoch, status, result,
                                                            error, event, run_id),
                           ("ok", "settled", "stale", "timed_out", "compensate"))

    @staticmethod
    def _settle_call(keys: RunKeys, epoch: int, status: str, result: bytes, error: bytes,
                     event: bytes, run_id: str, after_seq: int | None = None
                     ) -> tuple[list[str], list[str | bytes | int]]:
        args: list[str | bytes | int] = [epoch, status, result, error, event, run_id]
        if after_seq is not None:
            args.append(after_seq)
        return ([keys.run, keys.leases, keys.dispatch, keys.output, keys.finished], args)

    def commit_step_and_settle(self, commit: dict[str, Any], settle: dict[str, Any]) -> Reply:
        """commit_step, then settle_run, of one run in one round trip (its keys share a
        slot: one pipeline to its master; Redis appends both before one fsync). Both are
        safe to resend (the write number; a settled run answers its first record). The
        settle's reply; a refused commit is refused by the settle too (same fence)."""
        starts = commit["starts"]
        keys = commit["keys"]
        flat: list[str | bytes | int] = [x for start in starts for x in start]
        calls = [("commit_step", [keys.run, keys.steps, keys.leases, keys.output],
                  [commit["epoch"], commit["step_key"], commit["record"],
                   commit["event_type"], commit["event"], commit["run_id"], commit["ttl_ms"],
                   commit["seq"], *flat]),
                 ("settle_run", *self._settle_call(**settle, after_seq=commit["seq"]))]
        client: Any = self.client  # redis-py's cluster routing calls are untyped
        if isinstance(self.client, RedisCluster):
            client = client.get_redis_connection(client.get_node_from_key(keys.run))

        def pipelined() -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, call_keys, args in calls:
                pipe.evalsha(self.scripts[name].sha, len(call_keys), *call_keys, *args)
            return list(pipe.execute(raise_on_error=False))

        def send() -> list[Any]:
            replies = pipelined()
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
                # The cache was emptied (a restart): load, resend. A settle that ran after
                # a refused commit answered "behind" and wrote nothing.
                for name, _, _ in calls:
                    client.script_load(self.scripts[name].source)
                replies = pipelined()
            return replies

        try:
            replies = self._resending(send)
        except redis.RedisError as exc:
            metrics.redis_error(exc)
            raise
        moved = [r for r in replies if isinstance(r, redis.ResponseError)
                 and str(r).startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"))]
        if moved:  # a slot moving, a failover: one by one through the cluster client
            self.commit_step(**commit)
            return self.settle_run(**settle)
        for reply in replies:
            if isinstance(reply, Exception):
                metrics.redis_error(reply)
                raise reply
        self._parse("commit_step", replies[0],
                    ("ok", "cancelled", "timed_out", "stale", "settled", "paused"))
        return self._parse("settle_run", replies[1],
                           ("ok", "settled", "stale", "timed_out", "compensate"))


    def cancel_run(self, *, keys: RunKeys, run_id: str, event: bytes, request_id: str) -> Reply:
        return self._reply("cancel_run",
                           [keys.run, keys.leases, keys.dispatch, keys.output, keys.finished,
                            keys.waits, keys.asks, keys.feed],
                           [run_id, event, request_id],
                           ("cancelled", "requested", "settled", "missing", "corrupt"))

    def cancel_compensate(self, *, keys: RunKeys, run_id: str, marker: bytes, event: bytes,
                          request_id: str, grace_ms: int) -> Reply:
        """Cancel a run and run its compensations (engine/compensation.py)."""
        return self._reply("cancel_compensate",
                           [keys.run, keys.steps, keys.leases, keys.dispatch, keys.output,
                            keys.finished, keys.waits, keys.asks, keys.feed],
                           [run_id, marker, event, request_id, grace_ms],
                           ("requested", "woken", "queued", "cancelled", "settled", "missing",
                            "corrupt", "compensating"))

    def hand_over_compensation(self, *, keys: RunKeys, epoch: int, run_id: str,
                               grace_ms: int, event: bytes) -> Reply:
        """An execution stopped by a cancel that asked for compensation: queue the run
        again to compensate."""
        return self._reply("hand_over_compensation",
                           [keys.run, keys.steps, keys.leases, keys.dispatch, keys.output],
                           [epoch, run_id, grace_ms, event],
                           ("ok", "plain", "stale", "settled"))

    def reap_run(self, *, keys: RunKeys, run_id: str, ctl_epoch: int, grace_ms: int,
                 final_cancel: bytes, final_gave_up: bytes, worker: str = "") -> Reply:
        """worker: "" to reap an expired lease; a lost worker's name to reap its run."""
        return self._reply(
            "reap_run", self._reap_keys(keys),
            [run_id, ctl_epoch, grace_ms, final_cancel, final_gave_up, worker],
            ("redelivered", "cancelled", "gave_up", "not_expired", "gone", "fenced", "corrupt"))

    @staticmethod
    def _reap_keys(keys: RunKeys) -> list[str]:
        """reap_run's KEYS (one list for the single and the batched call)."""
        return [keys.run, keys.leases, keys.dispatch, keys.output, keys.fence, keys.finished,
                keys.redeliveries]

    def reap_runs(self, calls: list[tuple[RunKeys, str, int, int, bytes, bytes, str]]
                  ) -> list[Reply | redis.ResponseError]:
        """reap_run for many (keys, run id, ctl epoch, grace ms, final cancel, final gave up,
        worker), pipelined (per master on a cluster); a call that failed on its keys is
        returned as its error, so one broken run costs only itself."""
        statuses = ("redelivered", "cancelled", "gave_up", "not_expired", "gone", "fenced",
                    "corrupt")
        replies = self.call_many("reap_run", [
            (self._reap_keys(k), [rid, epoch, grace, cancel, gave_up, worker])
            for k, rid, epoch, grace, cancel, gave_up, worker in calls], errors=True)
        out: list[Reply | redis.ResponseError] = []
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                out.append(reply)
                continue
            if as_text(reply[0]) not in statuses:
                raise self._unexpected("reap_run", reply)
            out.append(Reply(as_text(reply[0]), reply[1:]))
        return out

    def redispatch_run(self, *, keys: RunKeys, run_id: str, attempt: int, ctl_epoch: int,
                       grace_ms: int, final_gave_up: bytes) -> Reply:
        return self._reply("redispatch_run",
                           [keys.run, keys.dispatch, keys.output, keys.fence, keys.finished,
                            keys.redeliveries],
                           [run_id, attempt, ctl_epoch, grace_ms, final_gave_up],
                           ("redelivered", "gave_up", "moved", "fenced", "corrupt"))

    def raise_fences(self, fence_keys: list[str], ctl_epoch: int) -> list[tuple[str, int]]:
        """raise_fence on each bucket fence, pipelined (per node on a cluster): ("ok", the
        epoch the fence held before) or ("fenced", the newer epoch it holds) for each."""
        replies = self.call_many("raise_fence", [([k], [ctl_epoch]) for k in fence_keys])
        return [(as_text(r[0]), int(r[1]) if len(r) > 1 else 0) for r in replies]

    def put_rollup(self, *, rollups_key: str, minutes_key: str, fence_key: str,
                   ctl_epoch: int, keep_from: int, keep_ms: int,
                   minutes: list[tuple[int, bytes]]) -> Reply:
        """The dashboard's per-minute rollups of one lane (controller/rollups.py)."""
        flat: list[str | bytes | int] = []
        for minute, doc in minutes:
            flat += [minute, doc]
        return self._reply("put_rollup", [rollups_key, minutes_key, fence_key],
                           [ctl_epoch, keep_from, keep_ms, len(minutes), *flat],
                           ("ok", "fenced"))

    def fail_corrupt(self, *, keys: RunKeys, run_id: str, error: bytes, event: bytes,
                     retention_ms: int) -> Reply:
        return self._reply("fail_corrupt",
                           [keys.run, keys.leases, keys.dispatch, keys.output, keys.finished,
                            keys.listing],
                           [run_id, error, event, retention_ms],
                           ("failed", "settled", "unindexed"))

    def defer_run(self, *, keys: RunKeys, epoch: int, run_id: str, delay_ms: int, note: str,
                  event: bytes) -> Reply:
        return self._reply("defer_run", [keys.run, keys.leases, keys.dispatch, keys.output],
                           [epoch, run_id, delay_ms, note, event], ("ok", "stale", "settled"))

    # -- flow control (marbles_rq/flow/limits.py) ------------------------------------

    def acquire_slot(self, *, slots_key: str, holders_key: str, run_id: str, attempt: int,
                     token: str, limit: int, ttl_ms: int) -> Reply:
        """{"ok", held, until} | {"full", held} | {"stale", attempt}; safe to resend
        (re-entrant)."""
        return self._reply("acquire_slot", [slots_key, holders_key],
                           [run_id, attempt, token, limit, ttl_ms], ("ok", "full", "stale"))

    def renew_slot(self, *, slots_key: str, holders_key: str, run_id: str, attempt: int,
                   token: str, ttl_ms: int, limit: int) -> Reply:
        """{"ok", retaken, until} | {"lost", held} | {"stale", attempt}; safe to resend."""
        return self._reply("renew_slot", [slots_key, holders_key],
                           [run_id, attempt, token, ttl_ms, limit], ("ok", "lost", "stale"))

    def release_slot(self, *, slots_key: str, holders_key: str, run_id: str,
                     holder: str) -> str:
        """ok | not_held (a resend after a release answers not_held: nothing twice).
        `holder`: "<attempt>|<token>", or "<attempt>|*" for any execution of that delivery."""
        return self._reply("release_slot", [slots_key, holders_key], [run_id, holder],
                           ("ok", "not_held")).status

    def acquire_lock(self, *, state_key: str, queue_key: str, run_id: str, epoch: int,
                     ttl_ms: int, stale_ms: int, name: str) -> Reply:
        """{"ok", until, since} | {"queued", position, queued, holder, until} |
        {"stale", epoch}; safe to resend (a holder takes its own hold again, a queued run
        keeps its place)."""
        return self._reply("acquire_lock", [state_key, queue_key],
                           [run_id, epoch, ttl_ms, stale_ms, name], ("ok", "queued", "stale"))

    def renew_lock(self, *, state_key: str, run_id: str, epoch: int, ttl_ms: int) -> Reply:
        """{"ok", until} | {"lost", holder} | {"stale", epoch}; safe to resend."""
        return self._reply("renew_lock", [state_key], [run_id, epoch, ttl_ms],
                           ("ok", "lost", "stale"))

    def release_lock(self, *, state_key: str, queue_key: str, run_id: str, epoch: str,
                     drop: str = "") -> Reply:
        """{"ok", head} | {"not_held", head}: `epoch` is the holder's, or "<= N" for any
        execution of the run up to N; `drop` a run id taken off the queue first. A resend
        after a release answers not_held: nothing twice."""
        return self._reply("release_lock", [state_key, queue_key], [run_id, epoch, drop],
                           ("ok", "not_held"))

    def take_rate(self, *, state_key: str, queue_key: str, admitted_key: str, token: str,
                  interval_us: int, burst: int, stale_ms: int, keep_ms: int,
                  lookahead_us: int) -> Reply:
        """{"admitted", at_ms, fresh, token...} | {"held", turn_ms, position, queued, near};
        safe to resend (an admitted token answers admitted again, releasing nobody twice;
        a queued one keeps its place)."""
        return self._reply("take_rate", [state_key, queue_key, admitted_key],
                           [token, interval_us, burst, stale_ms, keep_ms, lookahead_us],
                           ("admitted", "held"))

    def hold_run(self, *, keys: RunKeys, run_id: str, attempt: int, base_ms: int, cap_ms: int,
                 jitter: float, note: str, event: bytes) -> Reply:
        """{"ok", attempt, delay_ms} | {"moved", status}. A resend finds the run under the
        next attempt and answers moved: the hold is applied once."""
        return self._reply("hold_run", [keys.run, keys.dispatch, keys.output],
                           [run_id, attempt, base_ms, cap_ms, f"{jitter:.4f}", note, event],
                           ("ok", "moved"))

    def dispatch_done(self, calls: list[tuple[str, str, str, str]]) -> list[str]:
        """For (run key, dispatch key, run id, attempt seen): drop the run's dispatch entry;
        pipelined. (Two keys, not RunKeys: a recovery makes 100,000s of these calls, and
        spelling every key of each run cost a tenth of its CPU.)"""
        replies = self.call_many("dispatch_done", [([run, dispatch], [rid, attempt])
                                                   for run, dispatch, rid, attempt in calls])
        return [as_text(r[0]) for r in replies]

    def purge_run(self, *, keys: RunKeys, run_id: str, receipts: list[str],
                  tag_indexes: Sequence[str] = (), tags: bytes = b"") -> Reply:
        """`tags`: the run's tags field as read; `tag_indexes`: the index key of each."""
        return self._reply("purge_run", [keys.run, keys.steps, keys.output, keys.listing,
                                         keys.finished, keys.effects, keys.asks, keys.reports,
                                         keys.feed, keys.report_index, keys.waits,
                                         keys.published, keys.event_inbox, keys.signals,
                                         *receipts, *tag_indexes],
                           [run_id, len(receipts), tags], ("ok", "not_due", "retry"))

    def tag_run(self, *, run_key: str, run_id: str, tags: bytes, indexes: list[str],
                old_indexes: list[str], max_tags: int, seen: bytes) -> Reply:
        return self._reply("tag_run", [run_key, *indexes, *old_indexes],
                           [run_id, tags, max_tags, seen], ("ok", "too_many", "retry",
                                                             "missing"))

    def hold_finished(self, *, keys: RunKeys, run_id: str, hold_ms: int) -> Reply:
        return self._reply("hold_finished", [keys.finished], [run_id, hold_ms],
                           ("ok", "not_due"))

    # -- runs that wait ----------------------------------------------------------------

    def park_run(self, *, keys: RunKeys, epoch: int, run_id: str, reason: str, wake_at_ms: int,
                 wait_for: bytes, grace_ms: int, event: bytes,
                 ledger: list[tuple[str, bytes]], asks: list[tuple[str, bytes, int]],
                 notice: bytes = b"") -> Reply:
        flat: list[str | bytes | int] = []
        for key, record in ledger:
            flat += [key, record]
        for key, doc, timeout_ms in asks:
            flat += [key, doc, timeout_ms]
        return self._reply("park_run", [keys.run, keys.leases, keys.dispatch, keys.output,
                                        keys.waits, keys.steps, keys.asks, keys.feed,
                                        keys.signals, keys.notices],
                           [epoch, run_id, reason, wake_at_ms, wait_for, grace_ms, event,
                            len(ledger), len(asks), notice, *flat],
                           ("ok", "requeued", "cancelled", "stale", "settled"))

    def wake_run(self, *, keys: RunKeys, run_id: str, ctl_epoch: int | None, cause: str,
                 grace_ms: int, event: bytes) -> Reply:
        return self._reply("wake_run", [keys.run, keys.waits, keys.dispatch, keys.output,
                                        keys.fence, keys.asks, keys.feed],
                           [run_id, "" if ctl_epoch is None else ctl_epoch, cause, grace_ms,
                            event],
                           ("woken", "not_due", "pending", "paused", "idle", "fenced"))

    def wake_runs(self, calls: list[tuple[RunKeys, str, int, str, int, bytes]]) -> list[Reply]:
        """wake_run for many (keys, run id, ctl epoch, cause, grace ms, event), pipelined."""
        replies = self.call_many("wake_run", [
            ([k.run, k.waits, k.dispatch, k.output, k.fence, k.asks, k.feed],
             [rid, epoch, cause, grace, ev]) for k, rid, epoch, cause, grace, ev in calls])
        out = []
        for reply in replies:
            status = as_text(reply[0])
            if status not in ("woken", "not_due", "pending", "paused", "idle", "fenced"):
                raise self._unexpected("wake_run", reply)
            out.append(Reply(status, reply[1:]))
        return out

    def recheck_waits(self, calls: list[tuple[RunKeys, str, int, str, int]]) -> list[str]:
        """recheck_wait for many (keys, run id, ctl epoch, run epoch read, at ms), pipelined:
        ok | moved_on | fenced for each (a failed call counts as moved_on: the index entry
        is only when the controller looks again)."""
        replies = self.call_many("recheck_wait", [
            ([k.run, k.waits, k.fence], [rid, ctl_epoch, epoch, at])
            for k, rid, ctl_epoch, epoch, at in calls], errors=True)
        return ["moved_on" if isinstance(r, Exception) else as_text(r[0]) for r in replies]

    def answer_ask(self, *, keys: RunKeys, run_id: str, key: str, rev: str, answer: bytes,
                   event: bytes, grace_ms: int, request_id: str) -> Reply:
        return self._reply("answer_ask", [keys.run, keys.asks, keys.feed, keys.waits,
                                          keys.dispatch, keys.output],
                           [run_id, key, rev, answer, event, grace_ms, request_id],
                           ("ok", "missing", "unknown_key", "closed", "conflict", "settled"))

    # -- signals -------------------------------------------------------------------------

    def send_signal(self, *, keys: RunKeys, marker: str, run_id: str, name: str,
                    payload: bytes, event_head: bytes, grace_ms: int,
                    max_buffered: int) -> Reply:
        """`marker`: the request marker key of this send (Keyspace.request_marker)."""
        return self._reply("send_signal", [keys.run, keys.signals, keys.waits, keys.dispatch,
                                           keys.output, marker],
                           [run_id, name, payload, event_head, grace_ms, MARKER_MS,
                            max_buffered], ("ok", "missing", "settled", "full"))

    def take_signal(self, *, keys: RunKeys, epoch: int, run_id: str, name: str, taken: int,
                    count: int, step_key: str, record: bytes, event: bytes, seq: int) -> Reply:
        return self._reply("take_signal", [keys.run, keys.signals, keys.steps, keys.leases,
                                           keys.output],
                           [epoch, run_id, name, taken, count, step_key, record, event, seq],
                           ("ok", "conflict", "cancelled", "paused", "stale", "settled"))

    def start_signal(self, *, claim: dict[str, Any], marker: str, name: str, payload: bytes,
                     event_head: bytes, max_buffered: int) -> Reply:
        """Signal-with-start: `claim` is what claim_run takes (RunStore._claim_args, with its
        optional push), the run recorded if new and the signal appended in one call."""
        keys: RunKeys = claim["keys"]
        push: JobPush | None = claim.get("push")
        call_keys = [keys.run, keys.listing, keys.dispatch, keys.output, keys.signals,
                     keys.waits, marker]
        args: list[str | bytes | int] = [
            claim["run_id"], claim["doc"], claim["request_id"], claim["queue"],
            claim["timeout_ms"], claim["max_deliveries"], claim["grace_ms"], claim["event"],
            claim["retention_ms"], claim.get("lane", 0), claim.get("limit", ""), name, payload,
            event_head, MARKER_MS, max_buffered]
        if push is not None:
            call_keys += push.keys()
            args += push.args()
        return self._reply("start_signal", call_keys, args,
                           ("created", "exists", "settled", "full", "corrupt"))

    def pause_run(self, *, keys: RunKeys, event: bytes) -> Reply:
        return self._reply("pause_run", [keys.run, keys.output], [event],
                           ("paused", "requested", "already", "settled", "missing"))

    def resume_run(self, *, keys: RunKeys, run_id: str, event: bytes, grace_ms: int) -> Reply:
        return self._reply("resume_run", [keys.run, keys.output, keys.waits, keys.dispatch],
                           [run_id, event, grace_ms],
                           ("woken", "resumed", "not_paused", "settled", "missing"))

    def resolve_step(self, *, keys: RunKeys, run_id: str, action: str, key: str,
                     expected: bytes, entry: bytes, epoch: int, event: bytes,
                     grace_ms: int) -> Reply:
        return self._reply("resolve_step", [keys.run, keys.steps, keys.output, keys.waits,
                                            keys.dispatch, keys.feed],
                           [run_id, action, key, expected, entry, epoch, event, grace_ms],
                           ("woken", "conflict", "not_waiting", "settled", "missing"))

    def settle_notice(self, *, notices: str, fence: str, ctl_epoch: int, member: str,
                      next: str, due_ms: int) -> Reply:
        return self._reply("settle_notice", [notices, fence], [ctl_epoch, member, next, due_ms],
                           ("ok", "gone", "fenced"))

    def add_report(self, *, keys: RunKeys, epoch: int, run_id: str, key: str, doc: bytes,
                   event: bytes) -> Reply:
        return self._reply("add_report", [keys.run, keys.reports, keys.report_index,
                                          keys.output],
                           [epoch, run_id, key, doc, event],
                           ("ok", "exists", "stale", "settled"))

    def abandon_attempt(self, *, keys: RunKeys, run_id: str, attempt: int,
                        worker: str) -> Reply:
        return self._reply("abandon_attempt", [keys.run, keys.leases], [run_id, attempt, worker],
                           ("ok", "ignored"))

    # -- worker liveness ---------------------------------------------------------------

    def beat_worker(self, *, workers_key: str, worker: str, ttl_ms: int,
                    lanes_key: str | None = None, lanes: str = "",
                    versions_key: str | None = None, versions: str = "") -> int:
        """The worker is alive for ttl_ms more (and serves `lanes`, and the workflow
        `versions`, JSON); returns until when (server ms)."""
        keys = [workers_key] if lanes_key is None else [workers_key, lanes_key]
        args: list[Any] = [worker, ttl_ms, lanes]
        if lanes_key is not None and versions_key is not None:
            keys.append(versions_key)
            args.append(versions)
        reply = self.call("beat_worker", keys, args)
        if as_text(reply[0]) != "ok":
            raise self._unexpected("beat_worker", reply)
        return int(reply[1])

    def forget_workers(self, *, workers_key: str, workers: Sequence[str],
                       cutoff_ms: int | None, lanes_key: str | None = None,
                       versions_key: str | None = None) -> list[str]:
        """forget_worker for each (pipelined): ok | kept for each. cutoff_ms None removes
        them whatever their time."""
        cutoff = "" if cutoff_ms is None else cutoff_ms
        keys = [workers_key] if lanes_key is None else [workers_key, lanes_key]
        if lanes_key is not None and versions_key is not None:
            keys.append(versions_key)
        replies = self.call_many("forget_worker", [(keys, [w, cutoff]) for w in workers])
        return [as_text(r[0]) for r in replies]

    # -- the transport ----------------------------------------------------------------

    def enqueue_delivery(self, push: JobPush) -> bool:
        """RQ's unique enqueue of one job in one round trip: False if RQ holds its id."""
        return self._reply("enqueue_delivery", push.keys(), push.args(),
                           ("ok", "exists")).status == "ok"

    def enqueue_deliveries(self, pushes: list[JobPush]) -> list[bool]:
        """enqueue_delivery for many jobs in one round trip and one fsync (see call_many)."""
        replies = self.call_many("enqueue_delivery", [(p.keys(), p.args()) for p in pushes],
                                 transaction=True)
        out = []
        for reply in replies:
            if as_text(reply[0]) not in ("ok", "exists"):
                raise self._unexpected("enqueue_delivery", reply)
            out.append(as_text(reply[0]) == "ok")
        return out

    # -- events ------------------------------------------------------------------------

    def claim_event(self, *, event_key: str, event_hash: str, listing_key: str,
                    pending_key: str, offer_key: str, doc: bytes, request_id: str,
                    workflow: str, run_id: str, grace_ms: int, batch: bytes = b"") -> Reply:
        """{"ok", received_ms} or {"exists", doc, state, workflow, run} (lua/claim_event.lua)."""
        return self._reply("claim_event", [event_hash, listing_key, pending_key, offer_key],
                           [event_key, doc, request_id, workflow, run_id, grace_ms, batch],
                           ("ok", "exists"))

    def mark_event(self, *, event_key: str, event_hash: str, pending_key: str, fence_key: str,
                   ctl_epoch: int, state: str, note: str = "", retry_ms: int = 0,
                   run: str = "") -> Reply:
        """state: started | batched | failed | retry; ctl_epoch 0 = the sender (not fenced)."""
        return self._reply("mark_event", [event_hash, pending_key, fence_key],
                           [event_key, ctl_epoch, state, note, retry_ms, run],
                           ("ok", "not_pending", "missing", "fenced"))

    # -- event batches -------------------------------------------------------------------

    def append_batch(self, *, group_key: str, items_key: str, member_key: str,
                     batch_key: str, due_key: str, sealed_key: str, group: str, seq: int,
                     event_key: str, item: bytes, max_size: int, max_wait_ms: int,
                     max_bytes: int, grace_ms: int, keep_ms: int, workflow: str,
                     trigger: str, key: str) -> Reply:
        """{"added"|"sealed", batch_id, n}, {"exists", batch_id}, {"moved", seq[, sealed]}."""
        return self._reply("append_batch", [group_key, items_key, member_key, batch_key,
                                            due_key, sealed_key],
                           [group, seq, event_key, item, max_size, max_wait_ms, max_bytes,
                            grace_ms, keep_ms, workflow, trigger, key],
                           ("added", "sealed", "exists", "moved"))

    def seal_batch(self, *, group_key: str, batch_key: str, due_key: str, sealed_key: str,
                   fence_key: str, group: str, seq: int, ctl_epoch: int,
                   grace_ms: int) -> Reply:
        return self._reply("seal_batch", [group_key, batch_key, due_key, sealed_key, fence_key],
                           [group, seq, ctl_epoch, grace_ms],
                           ("sealed", "not_due", "gone", "fenced"))

    def close_batch(self, *, batch_key: str, items_key: str, sealed_key: str, fence_key: str,
                    batch_id: str, ctl_epoch: int, state: str, note: str, keep_ms: int,
                    retry_ms: int = 0) -> Reply:
        """state: started | failed | retry; ctl_epoch 0 = the sealer (not fenced)."""
        return self._reply("close_batch", [batch_key, items_key, sealed_key, fence_key],
                           [batch_id, ctl_epoch, state, note, keep_ms, retry_ms],
                           ("ok", "closed", "missing", "fenced"))

    def prune_event(self, *, event_key: str, event_hash: str, listing_key: str,
                    fence_key: str, ctl_epoch: int, cutoff_ms: int) -> Reply:
        return self._reply("prune_event", [event_hash, listing_key, fence_key],
                           [event_key, ctl_epoch, cutoff_ms], ("ok", "kept", "fenced"))

    # -- monitors ----------------------------------------------------------------------

    def arm_monitor(self, *, monitor_key: str, monitor_hash: str, due_key: str,
                    fence_key: str, ctl_epoch: int, mode: str) -> Reply:
        """mode: arm | disarm."""
        return self._reply("arm_monitor", [monitor_hash, due_key, fence_key],
                           [monitor_key, ctl_epoch, mode], ("ok", "fenced"))

    def observe_monitor(self, *, monitor_key: str, monitor_hash: str, due_key: str,
                        fence_key: str, ctl_epoch: int, expected_rev: str, obs: bytes,
                        launch: bytes, launch_run: str, seq: int, interval_ms: int,
                        error: str) -> Reply:
        return self._reply("observe_monitor", [monitor_hash, due_key, fence_key],
                           [monitor_key, ctl_epoch, expected_rev, obs, launch, launch_run, seq,
                            interval_ms, error], ("ok", "conflict", "fenced"))

    def ack_monitor(self, *, monitor_hash: str, fence_key: str, ctl_epoch: int,
                    launch_run: str, error: str) -> Reply:
        return self._reply("ack_monitor", [monitor_hash, fence_key],
                           [ctl_epoch, launch_run, error], ("ok", "gone", "fenced"))

    # -- schedules ---------------------------------------------------------------------

    @staticmethod
    def _claim_occurrence_call(keys: ScheduleKeys, occurrence_key: str, key: str,
                               ctl_epoch: int | None, expected: str, nominal_ms: int,
                               occurrence_id: str, run_id: str, cursor: str, due_ms: str,
                               holder: str = "", from_buffer: bool = False,
                               finish: tuple[str, int, str] | None = None
                               ) -> tuple[list[str], list[str | bytes | int]]:
        fin_run, fin_ms, fin_status = finish or ("", 0, "")
        return ([keys.state, keys.due, occurrence_key, keys.open, keys.fence, keys.lock],
                [key, "" if ctl_epoch is None else ctl_epoch, expected, nominal_ms,
                 occurrence_id, run_id, cursor, due_ms, holder, "1" if from_buffer else "",
                 fin_run, fin_ms, fin_status])

    def claim_occurrences(self, calls: list[dict[str, Any]]) -> list[Reply]:
        """claim_occurrence for many occurrences in one round trip (see call_many); each is
        safe to resend: a claim of the same occurrence for the same run answers "ok"."""
        replies = self.call_many("claim_occurrence",
                                 [self._claim_occurrence_call(**c) for c in calls])
        statuses = ("ok", "exists", "moved", "paused", "locked", "missing", "fenced")
        out = []
        for reply in replies:
            if as_text(reply[0]) not in statuses:
                raise self._unexpected("claim_occurrence", reply)
            out.append(Reply(as_text(reply[0]), reply[1:]))
        return out

    def move_schedules(self, calls: list[tuple[ScheduleKeys, str, int, str, int, int, str,
                                               bool, tuple[str, int, str] | None]]
                       ) -> list[Reply]:
        """For (keys, key, ctl epoch, expected cursor, new cursor, due ms, buffered, skipped,
        finished run (id, ms, status)): move_schedule, pipelined. Safe to resend: a resend
        after the first send applied answers "moved"."""
        batch: list[tuple[list[str], list[str | bytes | int]]] = []
        for keys, key, epoch, expected, cursor, due_ms, buffered, skipped, finish in calls:
            fin_run, fin_ms, fin_status = finish or ("", 0, "")
            batch.append(([keys.state, keys.due, keys.fence],
                          [key, epoch, expected, cursor, due_ms, buffered,
                           "1" if skipped else "", fin_run, fin_ms, fin_status]))
        replies = self.call_many("move_schedule", batch)
        out = []
        for reply in replies:
            if as_text(reply[0]) not in ("ok", "moved", "paused", "missing", "fenced"):
                raise self._unexpected("move_schedule", reply)
            out.append(Reply(as_text(reply[0]), reply[1:]))
        return out

    def start_occurrences(self, calls: Sequence[tuple[ScheduleKeys, str, str, int | None]]
                          ) -> list[Reply]:
        """For (keys, occurrence key, occurrence id, ctl epoch or None for a roll):
        start_occurrence, pipelined; idempotent."""
        replies = self.call_many("start_occurrence", [
            ([occ_key, keys.open, keys.fence], [occ_id, "" if epoch is None else epoch,
                                                OCCURRENCE_KEEP_MS])
            for keys, occ_key, occ_id, epoch in calls])
        out = []
        for reply in replies:
            if as_text(reply[0]) not in ("ok", "gone", "fenced"):
                raise self._unexpected("start_occurrence", reply)
            out.append(Reply(as_text(reply[0]), reply[1:]))
        return out

    def register_schedule(self, *, keys: ScheduleKeys, key: str, ctl_epoch: int,
                          fingerprint: str, kind: str, label: str, workflow: str, cursor: int,
                          every_ms: int) -> Reply:
        return self._reply("register_schedule", [keys.state, keys.index, keys.due, keys.fence],
                           [key, ctl_epoch, fingerprint, kind, label, workflow, cursor,
                            every_ms], ("created", "updated", "same", "fenced"))

    def retire_schedule(self, *, keys: ScheduleKeys, key: str, ctl_epoch: int) -> Reply:
        return self._reply("retire_schedule", [keys.due, keys.fence], [key, ctl_epoch],
                           ("ok", "fenced"))

    def pause_schedule(self, *, keys: ScheduleKeys, key: str, paused: bool,
                       declared: bool) -> Reply:
        return self._reply("pause_schedule", [keys.state, keys.index, keys.due],
                           [key, "1" if paused else "0", "1" if declared else "0"],
                           ("ok", "unknown"))

    def lock_schedule(self, *, keys: ScheduleKeys, holder: str, ttl_ms: int) -> Reply:
        """ttl_ms > 0 takes the schedule's lock; 0 releases it if `holder` has it."""
        return self._reply("lock_schedule", [keys.lock], [holder, ttl_ms], ("ok", "held"))

    # -- published state and waits for events ----------------------------------------

    def publish_state(self, *, keys: RunKeys, epoch: int, run_id: str, seq: int,
                      step_key: str, record: bytes, key: str, value: bytes,
                      event: bytes) -> Reply:
        return self._reply("publish_state", [keys.run, keys.steps, keys.leases, keys.output,
                                             keys.published],
                           [epoch, run_id, seq, step_key, record, key, value, event],
                           ("ok", "cancelled", "paused", "stale", "settled"))

    def open_event_wait(self, *, keys: RunKeys, epoch: int, wait_key: str, timeout_ms: int,
                        timeout_record: bytes, event: bytes) -> Reply:
        return self._reply("open_event_wait", [keys.run, keys.steps, keys.event_inbox,
                                               keys.output],
                           [epoch, wait_key, timeout_ms, timeout_record, event],
                           ("open", "done", "timed_out", "stale", "settled"))

    def deliver_event(self, *, keys: RunKeys, run_id: str, wait_key: str, record: bytes,
                      event_key: str, epoch: int | None, grace_ms: int, event: bytes,
                      woken: bytes) -> Reply:
        return self._reply("deliver_event", [keys.run, keys.steps, keys.event_inbox,
                                             keys.output, keys.waits, keys.dispatch],
                           [run_id, wait_key, record, event_key,
                            "" if epoch is None else epoch, grace_ms, event, woken],
                           ("woken", "pending", "paused", "taken_now", "taken", "consumed",
                            "not_open", "stale", "idle"))

    def add_event_wait(self, *, term_key: str, spec_key: str, member: str,
                       spec: bytes) -> None:
        self._reply("add_event_wait", [term_key, spec_key], [member, spec], ("ok",))

    def drop_event_wait(self, *, term_key: str, spec_key: str, member: str) -> bool:
        return bool(int(self._reply("drop_event_wait", [term_key, spec_key], [member],
                                    ("ok",)).values[0]))

    def note_event(self, *, spec_key: str, term_keys: list[tuple[str, str]], event_key: str,
                   keep_ms: int, received_ms: int | None = None) -> Reply:
        """{"ok", received_ms, member, spec, ...}: the waits indexed under the event's terms."""
        flat = [k for pair in term_keys for k in pair]
        return self._reply("note_event", [spec_key, *flat],
                           [event_key, keep_ms, "" if received_ms is None else received_ms],
                           ("ok",))

    # -- deployment --------------------------------------------------------------------

    def ensure_meta(self, *, meta_key: str, buckets: int, layout: int,
                    lanes: int) -> MetaReply:
        reply = self.call("ensure_meta", [meta_key], [buckets, layout, lanes])
        if len(reply) != 4 or not reply[0]:
            raise self._unexpected("ensure_meta", reply)
        return MetaReply(*(as_text(v) for v in reply))

    def begin_grow(self, *, meta_key: str, workers_key: str, buckets: int,
                   to: int) -> list[str]:
        reply = [as_text(v)
                 for v in self.call("begin_grow", [meta_key, workers_key], [buckets, to])]
        if reply[0] not in ("ok", "workers", "changed"):
            raise self._unexpected("begin_grow", reply)
        return reply

    def finish_grow(self, *, meta_key: str, buckets: int, layout: int, moved: int) -> None:
        reply = [as_text(v) for v in self.call("finish_grow", [meta_key], [buckets, layout, moved])]
        if reply[0] not in ("ok", "done"):
            raise self._unexpected("finish_grow", reply)

    # -- debounce, throttle, singleton (flow/enqueue_gates.py) -------------------------------

    def debounce_enqueue(self, *, window: str, due: str, runs: str, closed: str, run_id: str,
                         doc: bytes, input: bytes, merged: bytes, expect: str,
                         window_ms: int, max_ms: int, digest: str, request_id: str) -> Reply:
        """{"started"|"merged", run_id, n, until, max} | {"conflict", run_id, rev, input};
        a resend of the last call answers as the first send did."""
        return self._reply("debounce_enqueue", [window, due, runs, closed],
                           [run_id, doc, input, merged, expect, window_ms, max_ms, digest,
                            request_id], ("started", "merged", "conflict"))

    def close_debounce(self, *, window: str, due: str, runs: str, closed: str,
                       run_id: str) -> Reply:
        """{"closed", doc, input, n, cancelled} | {"open", until} | {"gone"}; safe to
        resend."""
        return self._reply("close_debounce", [window, due, runs, closed], [run_id],
                           ("closed", "open", "gone"))

    def cancel_debounce(self, *, window: str, due: str, closed: str, run_id: str) -> str:
        """cancelled | missing; safe to resend."""
        return self._reply("cancel_debounce", [window, due, closed], [run_id],
                           ("cancelled", "missing")).status

    def forget_debounce(self, *, due: str, runs: str, closed: str, run_id: str) -> None:
        self._reply("forget_debounce", [due, runs, closed], [run_id], ("ok",))

    def throttle_enqueue(self, *, log: str, run_id: str, limit: int, period_ms: int) -> Reply:
        """{"started", count} | {"dropped", retry_at, count}; a resend (same run id)
        answers started again."""
        return self._reply("throttle_enqueue", [log], [run_id, limit, period_ms],
                           ("started", "dropped"))

    def singleton_enqueue(self, *, pointer: str, run: str, expect: str, run_id: str,
                          mode: str, grace_ms: int) -> Reply:
        """{"started", ""} | {"cancelled_running", old} | {"skipped", old} |
        {"retry", current}; a resend answers as the first send did."""
        return self._reply("singleton_enqueue", [pointer, run],
                           [expect, run_id, mode, grace_ms],
                           ("started", "cancelled_running", "skipped", "retry"))

    def clear_singleton(self, *, pointer: str, run_id: str) -> str:
        """cleared | kept (the pointer is another run's, or none)."""
        return self._reply("clear_singleton", [pointer], [run_id], ("cleared", "kept")).status

    # -- sessions (marbles_rq/sessions/): every script on one session's tag -----------------

    def open_session(self, *, session: str, owners: str, listing: str, session_id: str,
                     doc: bytes, owner: str, keep: bool) -> Reply:
        """{"created", doc, 0} | {"exists", doc, n} | {"corrupt"}; safe to resend (the
        second send finds it created)."""
        return self._reply("open_session", [session, owners, listing],
                           [session_id, doc, owner, "1" if keep else "0"],
                           ("created", "exists", "corrupt"))

    def append_session(self, *, session: str, messages: str, idem: str, owners: str,
                       marker: str, message: bytes, key: str, owner: str,
                       request_id: str) -> Reply:
        """{"ok", position, at_ms} | {"duplicate", position, at_ms} | {"missing"} |
        {"corrupt"}; a resend (same key, or same request id) answers duplicate."""
        return self._reply("append_session", [session, messages, idem, owners, marker],
                           [message, key, owner, request_id, MARKER_MS],
                           ("ok", "duplicate", "missing", "corrupt"))

    def release_session(self, *, session: str, messages: str, idem: str, owners: str,
                        listing: str, session_id: str, owner: str) -> str:
        """kept | deleted | missing; idempotent."""
        return self._reply("release_session", [session, messages, idem, owners, listing],
                           [session_id, owner], ("kept", "deleted", "missing")).status

    def delete_session(self, *, session: str, messages: str, idem: str, owners: str,
                       listing: str, session_id: str) -> Reply:
        """{"deleted", messages} | {"missing"}; idempotent."""
        return self._reply("delete_session", [session, messages, idem, owners, listing],
                           [session_id], ("deleted", "missing"))

    def note_session(self, *, keys: RunKeys, sessions: str, epoch: int, run_id: str,
                     seq: int, step_key: str, record: bytes, session_id: str) -> Reply:
        return self._reply("note_session", [keys.run, keys.steps, keys.leases, sessions],
                           [epoch, run_id, seq, step_key, record, session_id],
                           ("ok", "cancelled", "paused", "stale", "settled"))
    # -- artifacts (artifacts/store.py) ---------------------------------------------------

    def put_artifact(self, *, artifact: str, listing: str, name: str, token: str,
                     expect: int | None, doc: bytes, blob: str, keep: int) -> Reply:
        """{"ok", n, dropped...} | {"exists", n} | {"conflict", latest}; a resend (same
        token) answers exists with the first send's version."""
        return self._reply("put_artifact", [artifact, listing],
                           [name, token, "" if expect is None else expect, doc, blob, keep],
                           ("ok", "exists", "conflict"))

    def delete_artifact(self, *, artifact: str, version: int | None) -> Reply:
        """{"ok", v...} | {"unknown"} | {"no_version", latest}."""
        return self._reply("delete_artifact", [artifact],
                           ["" if version is None else version],
                           ("ok", "unknown", "no_version"))

    def declare_artifact(self, *, artifact: str, listing: str, name: str,
                         media_type: str) -> None:
        self._reply("declare_artifact", [artifact, listing], [name, media_type], ("ok",))
    # -- the blob store (payloads/blobs.py) and its collection (controller/blob_gc.py) -----

    def index_blob(self, *, index: str, sizes: str, stats: str, sha: str, size: int,
                   look_ms: int) -> str:
        """new | known; safe to resend (a resend answers known)."""
        return self._reply("index_blob", [index, sizes, stats], [sha, size, look_ms],
                           ("new", "known")).status

    def hold_blob(self, *, holders: str, holder: str, stale_ms: int, blob: str | None = None,
                  data: bytes = b"") -> Reply:
        """{"new"} | {"known"} | {"deleting", since_ms}; with `blob` (the Redis backend) the
        bytes are written by the same call. Safe to resend (HSET and SET NX)."""
        keys = [holders] if blob is None else [holders, blob]
        return self._reply("hold_blob", keys, [holder, stale_ms, data],
                           ("new", "known", "deleting"))

    def collect_blob(self, *, holders: str, blob: str | None,
                     dead: Sequence[tuple[str, bytes]]) -> Reply:
        """{"kept", n} | {"deleted"} | {"delete"}; idempotent."""
        keys = [holders] if blob is None else [holders, blob]
        return self._reply("collect_blob", keys, [x for pair in dead for x in pair],
                           ("kept", "deleted", "delete"))

    def finish_blob(self, *, holders: str) -> str:
        """ok | gone; idempotent."""
        return self._reply("finish_blob", [holders], [], ("ok", "gone")).status

    def reindex_blob(self, *, index: str, sizes: str, stats: str, sha: str, seen: int,
                     next_ms: int) -> str:
        """kept | removed | moved; a resend of a removal answers moved."""
        return self._reply("reindex_blob", [index, sizes, stats], [sha, seen, next_ms],
                           ("kept", "removed", "moved")).status
