"""Who may reference a blob: one function per holder kind (the part of a holder before its
':': ``run``, ``ses``, ``art``), asked by the controller's blob collection "does holder
<kind>:<id> still reference blob <sha>?". A kind registers itself when its module is
imported (artifacts: marbles_rq/artifacts/store.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (store, holder id, blob sha256) -> whether the holder still references the blob.
HolderCheck = Callable[[Any, str, str], bool]

HOLDER_KINDS: dict[str, HolderCheck] = {}


def register_holder_kind(kind: str, fn: HolderCheck) -> None:
    HOLDER_KINDS[kind] = fn
