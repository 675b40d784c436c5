"""The workflows a deployment's workers declare, readable by callers that do not import the
workflow code.

A worker writes, on start, one entry per workflow it serves: the defaults a run is recorded
with (queue, timeouts, retention, priority, its concurrency limit and key field), what an
omitted input means, and the version new runs start on (with every version it serves). A
client that knows a workflow only by name (another service, a script that must not import
the application) records its runs with these defaults, so they match what the worker would
have chosen; the input is sent as JSON, and the worker validates it. The last worker to start
wins: during a rolling deploy, an old worker restarted after the new ones makes such callers
stamp the old version until a new one starts.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..store.keys import Keyspace
from .authoring import Registry, UnknownWorkflowError, WorkflowDef


class Declared(msgspec.Struct, kw_only=True, frozen=True):
    """One catalog entry (the hash field's value)."""

    version: int = 1
    queue: str = "default"
    timeout_s: float = 0.0
    max_deliveries: int = 20
    retention_s: float = 7 * 86400.0
    concurrency: int = 0
    concurrency_key: str | None = None
    priority: int = 0
    takes_input: bool = True
    # The default as a JSON value (msgspec decodes no Raw inside a union with None: a
    # default of any other kind failed every caller without the source); `has_default`
    # tells a default of null from none.
    input_default: Any = None
    has_default: bool = False
    # The version new runs start on, and every version the declaring worker serves ("" and
    # [] in entries written before workflows had versions).
    workflow_version: str = ""
    versions: list[str] = msgspec.field(default_factory=list)
    # Its debounce, throttle or singleton (flow/gate_specs.py Gate.to_json); None: none.
    gate: dict[str, Any] | None = None
    # Its rate limit ("" none) and burst, and the key: an input field, "<function>", or "".
    rate_limit: str = ""
    rate_burst: int = 1
    rate_key: str = ""


def declared(definition: WorkflowDef, versions: list[str] | None = None) -> Declared:
    return Declared(workflow_version=definition.version,
                    versions=versions or [definition.version], queue=definition.queue,
                    timeout_s=definition.timeout_s,
                    max_deliveries=definition.max_deliveries,
                    retention_s=definition.retention_s, concurrency=definition.concurrency,
                    concurrency_key=definition.concurrency_key, priority=definition.priority,
                    takes_input=definition.input_param is not None,
                    input_default=None if definition.input_default is None
                    else msgspec.json.decode(definition.input_default),
                    has_default=definition.input_default is not None,
                    gate=None if definition.gate is None else definition.gate.to_json(),
                    rate_limit=definition.rate_limit.text if definition.rate_limit else "",
                    rate_burst=definition.rate_limit.burst if definition.rate_limit else 1,
                    rate_key=definition.rate_key if isinstance(definition.rate_key, str)
                    else "<function>" if definition.rate_key is not None else "")


def declare(client: Any, keys: Keyspace, registry: Registry) -> None:
    """Record the registry's workflows (one HSET; last writer wins, as the newest deploy
    should)."""
    if registry.workflows:
        served = registry.versions
        client.hset(keys.workflows, mapping={
            name: msgspec.json.encode(declared(d, sorted(served.get(name, {d.version: d}))))
            for name, d in registry.workflows.items()})


def _unavailable(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("a workflow known from the catalog has no body in this process")


def lookup(client: Any, keys: Keyspace, name: str) -> WorkflowDef:
    """A stand-in definition for `name` from the catalog: the defaults of its runs, its
    current version, an input taken as any JSON. UnknownWorkflowError when no worker has
    declared it."""
    raw = client.hget(keys.workflows, name)
    if raw is None:
        raise UnknownWorkflowError(
            f"unknown workflow {name!r}: no worker of this deployment has declared it "
            f"(start a worker with its source, or import the source in this process)")
    entry = msgspec.json.decode(raw, type=Declared)
    from ..flow.gate_specs import from_json

    found = WorkflowDef(name=name, fn=_unavailable,
                       input_param="input" if entry.takes_input else None,
                       queue=entry.queue, timeout_s=entry.timeout_s,
                       max_deliveries=entry.max_deliveries, retention_s=entry.retention_s,
                       _input_type=Any, concurrency=entry.concurrency,
                       concurrency_key=entry.concurrency_key, priority=entry.priority,
                       input_default=msgspec.json.encode(entry.input_default)
                       if entry.has_default or entry.input_default is not None else None,
                       _version=entry.workflow_version,
                       rate_limit=_rate(entry),
                       rate_key=(entry.rate_key or None) if entry.rate_key != "<function>"
                       else None)
    found.gate = from_json(entry.gate)
    return found


def _rate(entry: Declared) -> Any:
    """The declared rate limit (its key's value is checked at enqueue as the worker's)."""
    if not entry.rate_limit or entry.rate_key == "<function>":
        return None
    from ..flow.rate_specs import Rate, RateError

    try:
        return Rate(entry.rate_limit, entry.rate_burst)
    except RateError:
        return None
