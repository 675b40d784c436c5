"""Sessions as holders of offloaded blobs (payloads/holders.py, the blob store's garbage
collection): a message offloaded by the codec references its blob as ``ses:<session id>``,
and the collector asks whether the session still references a sha before removing it.

The answer is read from the session's messages (their stored text names the sha of an
offloaded payload), a page at a time; a session that is gone references nothing."""

from __future__ import annotations

from typing import Any

PAGE = 1000


def session_references(store: Any, session_id: str, sha: str) -> bool:
    """Whether session `session_id` still holds a message whose stored text names `sha`."""
    keys, client = store.keys, store.client
    if not client.exists(keys.session(session_id)):
        return False
    needle = sha.encode()
    key, after = keys.session_messages(session_id), "-"
    while True:
        rows = client.xrange(key, min=after, count=PAGE)
        for _, fields in rows:
            if needle in fields.get(b"m", b""):
                return True
        if len(rows) < PAGE:
            return False
        last = rows[-1][0]
        after = "(" + (last.decode() if isinstance(last, bytes) else str(last))


def register() -> bool:
    """Register the ``ses`` holder kind with the blob store's collector, when this build has
    one (payloads/holders.py); False when it does not."""
    import importlib

    try:  # by name: the module is another part's, and may not be in this build yet
        holders = importlib.import_module("marbles_rq.payloads.holders")
    except ImportError:
        return False
    register_kind: Any = getattr(holders, "register_holder_kind", None)
    if register_kind is None:
        return False
    register_kind("ses", session_references)
    return True


register()
