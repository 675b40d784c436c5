"""Published state: values a run body makes readable from outside while it runs (queries).

    ctx.publish("progress", {"done": 3, "of": 10})       # or mr.publish(...)

From outside, at any time (also after the run finished, until it is purged):

    get_published(runs, run_id, "progress")              # -> {"done": 3, "of": 10}
    published(runs, run_id)                              # -> {"progress": {...}, ...}
    wait_published(runs, run_id, "progress", timeout_s=30)

A publish is a recorded call: its ledger entry (at the call's position) and the value are
written by one script (lua/publish_state.lua), so a replay finds the entry and publishes
nothing again, and a process killed right after the publish loses nothing. Last write wins
per key. The script also appends a "published" entry to the run's output stream, which is
what `wait_published` blocks on (XREAD BLOCK: no polling).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import MarblesError
from ..payloads.codec import decode_payload, encode_payload
from ..payloads.fields import run_holder
from ..store.ids import check_id
from ..store.records import StepRecord
from .authoring import InputError
from .context import check_branch, check_not_in_foreign_thread, now_ms
from .execution import RunNotFoundError, stamp, step_doc
from .json_values import changed_by_json

if TYPE_CHECKING:
    from .context import Run
    from .runs import RunStore

MAX_KEY = 128
# A blocking read is cut into slices shorter than any sane socket timeout.
_BLOCK_SLICE_MS = 2_000
_SETTLED_EVENTS = ("final",)


class NotPublishedError(MarblesError):
    """The run exists but has not published that key (yet)."""

    code = "not_published"


class PublishedWaitTimeoutError(MarblesError):
    """`wait_published` ran out of time before the key was published."""

    code = "published_wait_timeout"


class PublishError(InputError):
    """A key or value `publish` refuses (bad key, not JSON, over the payload limit)."""

    code = "invalid_publish"


def check_key(key: str) -> str:
    """1..128 printable characters."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.isprintable():
        raise PublishError(f"invalid published key {key!r}: 1 to {MAX_KEY} printable "
                           f"characters")
    return key


def _encode_value(key: str, value: Any) -> bytes:
    from .ops import max_payload

    try:
        encoded = msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise PublishError(f"the value published as {key!r} is not JSON: {exc}") from None
    if changed_by_json(value, encoded):
        raise PublishError(f"the value published as {key!r} is not JSON: it holds NaN or "
                           f"an infinity")
    limit = max_payload()
    if len(encoded) > limit:
        raise PublishError(f"the value published as {key!r} is {len(encoded):,} bytes, over "
                           f"the limit of {limit:,} (MARBLES_MAX_PAYLOAD); nothing was "
                           f"published")
    return encoded


# -- in a run body -------------------------------------------------------------------------

def publish(run: Run, key: str, value: Any) -> None:
    """Publish `value` (JSON) under `key` for the run executing; last write wins. Recorded
    at the call's position: a replay of this call publishes nothing again."""
    check_not_in_foreign_thread("publish")
    check_branch()
    check_key(key)
    encoded = _encode_value(key, value)
    ledger_key, seq = run.position("|publish")
    if run.ex.ledger.get(ledger_key) is not None:
        return
    record = StepRecord(version=1, key=ledger_key, name="|publish", status="published",
                        attempts=0, result=msgspec.Raw(msgspec.json.encode({"key": key})),
                        at_ms=now_ms(), seq=seq)
    if getattr(run.runs, "scripts", None) is None:
        # Runs in memory (engine/memory_store.py: a dry run, the test kit): the entry's
        # event carries the value, which the memory store keeps for `get`.
        run.commit_entry(record, "published", {"key": key, "step": ledger_key,
                                               "value": msgspec.Raw(encoded)})
        return
    status = run.call_store(_publish, run.runs, run.ex, record, key, encoded)
    if status in ("ok", "cancelled", "paused"):
        run.ex.ledger[ledger_key] = record
    run.check_reply(status)


def _publish(runs: RunStore, ex: Any, record: StepRecord, key: str, encoded: bytes) -> str:
    runs.flush_starts(ex)  # the steps started before it come first in the output
    with ex.lock:
        ex.seq += 1
        return runs.scripts.publish_state(
            keys=ex.keys, epoch=ex.epoch, run_id=ex.run_id, seq=ex.seq,
            step_key=record.key, record=step_doc(runs.store, ex, stamp(record, ex)), key=key,
            value=encode_payload(runs.store, encoded, holder=run_holder(ex.run_id)),
            event=msgspec.json.encode({"key": key, "step": record.key})).status


# -- from outside ----------------------------------------------------------------------------

def published(runs: RunStore, run_id: str) -> dict[str, Any]:
    """Every value the run has published, by key (empty when it published none). Raises
    RunNotFoundError for a run that does not exist."""
    check_id(run_id, "run id")
    pipe = runs.client.pipeline(transaction=False)
    pipe.exists(runs.keys.run(run_id))
    pipe.hgetall(runs.keys.published(run_id))
    exists, fields = pipe.execute()
    if not exists:
        raise RunNotFoundError(f"no run with id {run_id!r}")
    return {(k.decode() if isinstance(k, bytes) else k):
            msgspec.json.decode(decode_payload(runs.store, v))
            for k, v in sorted(fields.items())}


def get_published(runs: RunStore, run_id: str, key: str) -> Any:
    """The value the run published last under `key`. Raises RunNotFoundError (code
    run_not_found) or NotPublishedError (code not_published)."""
    check_id(run_id, "run id")
    check_key(key)
    pipe = runs.client.pipeline(transaction=False)
    pipe.exists(runs.keys.run(run_id))
    pipe.hget(runs.keys.published(run_id), key)
    exists, raw = pipe.execute()
    if not exists:
        raise RunNotFoundError(f"no run with id {run_id!r}")
    if raw is None:
        raise NotPublishedError(f"run {run_id} has not published {key!r}")
    return msgspec.json.decode(decode_payload(runs.store, raw))


def wait_published(runs: RunStore, run_id: str, key: str, timeout_s: float) -> Any:
    """The value of `key` once the run has published it: at once if it has, else blocking
    on the run's output stream (no polling) for up to `timeout_s`. Raises RunNotFoundError,
    NotPublishedError when the run finishes without publishing it, and
    PublishedWaitTimeoutError when the time runs out."""
    check_id(run_id, "run id")
    check_key(key)
    # NaN or infinity would reach int() of the time left: a ValueError, not a refusal.
    if not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s) or (
            timeout_s < 0):
        raise InputError(f"timeout_s must be a finite number of seconds >= 0, not "
                         f"{timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    # The stream's last entry first, then the value: a publish between the two is an entry
    # after that id, which the blocking read sees.
    last: Any = runs.client.xrevrange(runs.keys.output(run_id), count=1)
    after = last[0][0].decode() if last else "0-0"
    try:
        return get_published(runs, run_id, key)
    except NotPublishedError:
        pass
    view = runs.get(run_id)
    if view is not None and view.status in ("succeeded", "failed", "cancelled"):
        raise NotPublishedError(f"run {run_id} finished ({view.status}) without publishing "
                                f"{key!r}")
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            raise PublishedWaitTimeoutError(
                f"run {run_id} did not publish {key!r} within {timeout_s:g} s")
        entries = runs.output(run_id, after=after, block_ms=min(left_ms, _BLOCK_SLICE_MS))
        for entry in entries:
            after = entry.id
            if entry.type == "published" and isinstance(entry.data, dict) and (
                    entry.data.get("key") == key):
                return get_published(runs, run_id, key)
            if entry.type in _SETTLED_EVENTS:
                try:
                    return get_published(runs, run_id, key)
                except NotPublishedError:
                    raise NotPublishedError(f"run {run_id} finished without publishing "
                                            f"{key!r}") from None
