"""The event triggers a deployment's workers declare, readable by senders that do not import
the workflow code.

A worker writes, on start, one entry per ``@mr.on_event`` trigger of its source: (source,
type or any type) -> the workflow it starts; `marbles-rq dev` does before it says ready. A
sender (a client, the HTTP API, `events send`, a webhook) that declares no trigger for an
event's source matches the event against these, so a service that never imports the
workflows still starts the run the deployment declares. The sender reads the entries before
the event's one journal script: the catalog lives under the deployment's tag and the event
in its own bucket, and no script spans two slots on a cluster.

Last writer wins per (source, type), as with the workflows' catalog (engine/catalog.py): the
newest deploy's trigger is the one used; a trigger removed from the code stays declared until
its entry is deleted (``HDEL <prefix>:event_triggers "<source> <type>"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from ..errors import CorruptRecordError
from ..store.keys import Keyspace

ANY_TYPE = "*"  # never a valid event type, so it cannot collide with one


class DeclaredTrigger(msgspec.Struct, kw_only=True, frozen=True):
    """One catalog entry (the hash field's value)."""

    version: int = 1
    workflow: str
    # How the trigger batches its events (triggers/batches.py Batch.describe); None: it
    # does not.
    batch: dict[str, Any] | None = None


def entry_field(source: str, type: str | None) -> str:
    # Neither a source nor a type may contain a space (triggers/events.py's patterns).
    return f"{source} {type or ANY_TYPE}"


def declare(client: Any, keys: Keyspace,
            triggers: Iterable[tuple[str, str | None, str]
                               | tuple[str, str | None, str, dict[str, Any] | None]]) -> None:
    """Record (source, type or None, workflow) triggers: one HSET, last writer wins. Declare
    the workflows first (engine/catalog.py): a sender that finds a trigger then finds the
    defaults of the run it records."""
    mapping = {entry_field(t[0], t[1]): msgspec.json.encode(DeclaredTrigger(
        workflow=t[2], batch=t[3] if len(t) > 3 else None))
        for t in triggers}
    if mapping:
        client.hset(keys.event_triggers, mapping=mapping)


def lookup(client: Any, keys: Keyspace, source: str,
           type: str) -> tuple[str | None, str] | None:
    """(the declared type, or None for any type; the workflow) of the trigger an event of
    `source` and `type` ('' = none) starts: the one declared for its type, else the one for
    its source with no type. None when no worker has declared one. One read."""
    found = find(client, keys, source, type)
    return None if found is None else (found[0], found[1].workflow)


def find(client: Any, keys: Keyspace, source: str,
         type: str) -> tuple[str | None, DeclaredTrigger] | None:
    """`lookup`, with the whole entry (how it batches)."""
    fields = ([entry_field(source, type)] if type else []) + [entry_field(source, None)]
    found = client.hmget(keys.event_triggers, fields)
    for field, raw in zip(fields, found, strict=True):
        if raw is None:
            continue
        try:
            entry = msgspec.json.decode(raw, type=DeclaredTrigger)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptRecordError(f"{keys.event_triggers} field {field!r}",
                                     str(exc)) from None
        return (type if field != entry_field(source, None) else None), entry
    return None
