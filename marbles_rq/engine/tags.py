"""Search tags: short `key=value` text on a run, indexed so runs can be listed and acted on
by tag (`runs --tag`, `cancel --tag`, `Client.runs(tag=...)`).

A run gets tags from its workflow's declaration (`@mr.workflow(tags={...})`, recorded when
the run is started and again when it first executes) and from its body (`ctx.tag(k=v)`).
Each (key, value) has a per-bucket index, ``{P:bNNNN}:idx:tag:<key>=<value>``, a sorted set
of run ids scored by creation time like the listing of every run, so a tag filter pages
through only the runs that carry the tag (engine/paging.py). Tags are bounded: at most
MAX_TAGS per run, keys of MAX_KEY and values of MAX_VALUE characters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ..errors import InvalidIdError
from .execution import RunNotFoundError

MAX_TAGS = 16
MAX_KEY = 64
MAX_VALUE = 128
_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # MAX_KEY
# A tag write reads the run's tags again when another writer changed them meanwhile.
_RETRIES = 5


class TagError(InvalidIdError):
    """A tag refused: a key or value outside its pattern, or too many on one run. Nothing
    was written. (Bad input: exit 2, HTTP 400; not an InputError, which lives in
    engine/authoring.py, which checks declared tags with this module.)"""

    code = "invalid_tag"


def check_tag(key: Any, value: Any) -> tuple[str, str]:
    """One tag checked: the key letters, digits, `_ . -` (1 to 64), the value printable text
    (1 to 128 characters; it may hold `=`: a key never does)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise TagError(f"invalid tag key {key!r}: 1 to {MAX_KEY} letters, digits, '_', '.' "
                       f"or '-'")
    if isinstance(value, int | float):  # bool too: true, false
        value = str(value).lower() if isinstance(value, bool) else str(value)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_VALUE or not value.isprintable():
        raise TagError(f"invalid value of tag {key!r}: 1 to {MAX_VALUE} printable characters, "
                       f"not {value!r}"[:300])
    return key, value


def check_tags(tags: Mapping[str, Any] | None) -> dict[str, str]:
    """A mapping of tags checked (numbers and booleans become their text)."""
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise TagError(f"tags are a mapping of key to value, not {type(tags).__name__}")
    checked = dict(check_tag(k, v) for k, v in tags.items())
    if len(checked) > MAX_TAGS:
        raise TagError(f"{len(checked)} tags given; a run carries at most {MAX_TAGS}")
    return checked


def parse_tag(text: str) -> tuple[str, str]:
    """`key=value` (the CLI's --tag, the API's tag=) as a checked pair."""
    key, sep, value = text.partition("=")
    if not sep:
        raise TagError(f"invalid tag filter {text!r}: expected key=value")
    return check_tag(key, value)


def parse_tags(texts: Iterable[str]) -> tuple[tuple[str, str], ...]:
    return tuple(parse_tag(t) for t in texts)


def tag_run(runs: Any, run_id: str, tags: Mapping[str, Any]) -> int:
    """Merge `tags` into the run's and index it under each; the run's tag count after.
    TagError (nothing written) past MAX_TAGS; RunNotFoundError."""
    new = check_tags(tags)
    if not new:
        return 0
    keys = runs.keys
    bucket = keys.bucket_of(run_id)
    run_key = keys.run(run_id)
    for _ in range(_RETRIES):
        seen = runs.client.hget(run_key, "tags") or b""
        try:
            old = msgspec.json.decode(seen, type=dict[str, str]) if seen else {}
        except (msgspec.DecodeError, msgspec.ValidationError):
            old = {}
        replaced = [keys.tag_index(k, v, bucket) for k, v in old.items()
                    if k in new and new[k] != v]
        reply = runs.scripts.tag_run(
            run_key=run_key, run_id=run_id, tags=msgspec.json.encode(new),
            indexes=[keys.tag_index(k, v, bucket) for k, v in new.items()],
            old_indexes=replaced, max_tags=MAX_TAGS, seen=seen)
        if reply.status == "ok":
            return int(reply.values[0])
        if reply.status == "too_many":
            raise TagError(f"run {run_id} would carry {int(reply.values[0])} tags; at most "
                           f"{MAX_TAGS}")
        if reply.status == "missing":
            raise RunNotFoundError(f"no run with id {run_id!r}")
    raise TagError(f"the tags of run {run_id} kept changing while they were written; try "
                   f"again")
