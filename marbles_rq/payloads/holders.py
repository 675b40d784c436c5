"""Who references blobs: the registry the controller's blob collection asks
(controller/blob_gc.py). A holder is ``<kind>:<ident>`` (``run:<run id>``,
``art:<artifact name>``, ``ses:<session id>``); each kind registers one function
``fn(store, ident, sha) -> bool``: True while `ident` may still reference blob `sha`.

A function must answer True when unsure (a record it cannot read): a blob is deleted only
when every holder said False. A holder of a kind nobody registered in the controller's
process is never judged (its blobs are kept, with a warning), so a kind must be registered
by a module the controller imports (this one registers `run`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HolderCheck = Callable[[Any, str, str], bool]

_KINDS: dict[str, HolderCheck] = {}
HOLDER_KINDS = _KINDS  # the registry by kind, as artifacts23's tests read it


def register_holder_kind(kind: str, fn: HolderCheck) -> None:
    """Register (or replace) the check of holders ``<kind>:<ident>``."""
    if not kind or ":" in kind:
        raise ValueError(f"a holder kind is a word without ':', not {kind!r}")
    _KINDS[kind] = fn


def holder_kind(holder: str) -> tuple[str, str]:
    kind, _, ident = holder.partition(":")
    return kind, ident


def references(store: Any, holder: str, sha: str) -> bool | None:
    """Whether `holder` may still reference blob `sha`; None for a kind not registered."""
    kind, ident = holder_kind(holder)
    fn = _KINDS.get(kind)
    return None if fn is None else bool(fn(store, ident, sha))


def _run_holds(store: Any, run_id: str, sha: str) -> bool:
    # A run references its blobs (input, result, step results, answers, signals) for as
    # long as its record exists; pruning purges the record once its retention ends, and
    # then it references nothing. The sha is not looked for: keeping a blob a run no
    # longer needs until the run goes costs little, and reading every payload would not.
    return bool(store.client.exists(store.keys.run(run_id)))


register_holder_kind("run", _run_holds)
