"""Strict input for the command line: fields a workflow does not declare are refused (by
name), and an omitted input means `{}` for an input whose fields all have defaults.

msgspec drops unknown object fields unless a Struct says `forbid_unknown_fields=True`; a
typo in `--input` (`{"qyt": 2}`) would then run with the default and nobody would know.
The walk below follows the declared type through structs, dataclasses, TypedDicts,
unions, lists and dicts, on the decoded JSON, and names the first unknown field."""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi

_OBJECT_TYPES = (mi.StructType, mi.DataclassType, mi.TypedDictType)


_INFO: dict[Any, mi.Type | None] = {}


def _info(annotation: Any) -> mi.Type | None:
    """msgspec's description of a type, cached: it costs more than decoding the input."""
    try:
        return _INFO[annotation]
    except KeyError:
        pass
    except TypeError:  # not hashable: described each time
        return _describe(annotation)
    info = _INFO[annotation] = _describe(annotation)
    return info


def _describe(annotation: Any) -> mi.Type | None:
    try:
        return mi.type_info(annotation)
    except (TypeError, ValueError):  # a type msgspec cannot describe: nothing to check
        return None


def unknown_field(value: Any, annotation: Any) -> str | None:
    """The path (`a.b[2].c`) of the first field in `value` that `annotation` does not
    declare, or None. `value` is decoded JSON that already matched the type."""
    info = _info(annotation)
    return None if info is None else _walk(value, info, "", 0)


def _walk(value: Any, info: mi.Type, path: str, depth: int) -> str | None:
    if depth > 64:  # deeper input is refused before this (ops.MAX_DEPTH)
        return None
    if isinstance(info, _OBJECT_TYPES) and isinstance(value, dict):
        fields = {f.encode_name: f for f in info.fields}
        tag = getattr(info, "tag_field", None)
        for key, item in value.items():
            if key == tag:
                continue
            field = fields.get(key)
            where = f"{path}.{key}" if path else key
            if field is None:
                return where
            found = _walk(item, field.type, where, depth + 1)
            if found:
                return found
        return None
    if isinstance(info, mi.UnionType):
        # The member the value matched: the first object type for an object (a tagged
        # union's tag picks it), else a container type; others cannot hold fields.
        for member in info.types:
            if isinstance(value, dict) and isinstance(member, _OBJECT_TYPES):
                tag = getattr(member, "tag_field", None)
                if tag is None or value.get(tag) == getattr(member, "tag", None):
                    return _walk(value, member, path, depth)
            if isinstance(member, mi.DictType | mi.ListType | mi.SetType | mi.FrozenSetType
                          | mi.VarTupleType) and isinstance(value, dict | list):
                found = _walk(value, member, path, depth)
                if found:
                    return found
        return None
    if isinstance(info, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType) and (
            isinstance(value, list)):
        for i, item in enumerate(value):
            found = _walk(item, info.item_type, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(info, mi.TupleType) and isinstance(value, list):
        for i, (item, item_type) in enumerate(zip(value, info.item_types, strict=False)):
            found = _walk(item, item_type, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(info, mi.DictType) and isinstance(value, dict):
        for key, item in value.items():
            found = _walk(item, info.value_type, f"{path}[{key!r}]", depth + 1)
            if found:
                return found
    return None


def declared_fields(annotation: Any) -> list[str]:
    """The top-level fields an object input declares ([] for other inputs)."""
    info = _info(annotation)
    return [f.encode_name for f in info.fields] if isinstance(info, _OBJECT_TYPES) else []


def omitted_input(annotation: Any) -> tuple[bytes, list[str]]:
    """What an omitted input means: (`{}` for an object input, else `null`; the fields that
    have no default, which an omitted input cannot fill)."""
    info = _info(annotation)
    if isinstance(info, _OBJECT_TYPES):
        return b"{}", [f.encode_name for f in info.fields if f.required]
    return b"null", []
