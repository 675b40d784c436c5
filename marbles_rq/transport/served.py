"""Which workflow versions the live workers serve.

Each worker says, with its first liveness beat, which versions of which workflows its source
declares (``{P}:worker_versions``: worker name -> JSON ``{workflow: [version, ...]}``); the
entry goes with the worker's entry in the liveness index (``forget_worker``), and a worker the
controller forgot while it was frozen writes it again with its next beat. A reader filters the
entries by the live-workers index, so a worker killed a moment ago no longer counts once its
beats have lapsed, whether or not the controller has cleaned up after it yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..engine.authoring import Registry
from ..engine.runs import RunStore
from ..store.replies import as_text, server_ms


def served_text(registry: Registry) -> str:
    """What a worker with `registry` serves, as its entry says it."""
    return msgspec.json.encode({name: sorted(versions) for name, versions
                                in sorted(registry.versions.items())}).decode()


@dataclass(frozen=True)
class LiveVersions:
    """Workflow -> version -> the live workers serving it; `silent`: live workers that do
    not say (started by an earlier marbles-rq)."""

    served: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    silent: list[str] = field(default_factory=list)
    workers: int = 0

    def serves(self, workflow: str, version: str) -> bool:
        """Whether a live worker executes a run of `workflow` recorded with `version` ("":
        recorded before versions, served by any worker that knows the workflow)."""
        versions = self.served.get(workflow, {})
        return bool(versions) if not version else version in versions


def live_versions(runs: RunStore, client: Any = None) -> LiveVersions:
    """The versions the live workers serve (one round trip)."""
    client = runs.store.client if client is None else client
    now_ms = server_ms(client)
    pipe = client.pipeline(transaction=False)  # one slot: {<prefix>}
    pipe.zrangebyscore(runs.keys.workers, now_ms, "+inf")
    pipe.hgetall(runs.keys.worker_versions)
    alive, entries = pipe.execute()
    by_worker = {as_text(k): v for k, v in entries.items()}
    served: dict[str, dict[str, list[str]]] = {}
    silent = []
    for name in map(as_text, alive):
        raw = by_worker.get(name)
        try:
            declared = msgspec.json.decode(raw, type=dict[str, list[str]]) if raw else None
        except msgspec.DecodeError:
            declared = None
        if declared is None:
            silent.append(name)
            continue
        for workflow, versions in declared.items():
            for version in versions:
                served.setdefault(workflow, {}).setdefault(version, []).append(name)
    return LiveVersions(served, sorted(silent), len(alive))
