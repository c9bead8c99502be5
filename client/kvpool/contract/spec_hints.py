"""What to say after msgspec's own words when a hand-written spec is refused: the fields or the
values accepted where the mistake is, and the nearest one (``num_kv_head`` -> ``num_kv_heads``;
``type = "gqa"`` -> ``mha`` or ``mla``)."""

from __future__ import annotations

import difflib
import enum
import re
import types
import typing
from typing import Any

import msgspec

# msgspec: "Object contains unknown field `x` - at `$.attention`", "Invalid value 'gqa' - at
# `$.attention.type`" (no "- at" part at the top level).
_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`(?: - at `(?P<path>[^`]+)`)?")
_INVALID = re.compile(r"Invalid (?:enum )?value '(?P<value>[^']*)'(?: - at `(?P<path>[^`]+)`)?")


def explain(exc: Exception, root: type[msgspec.Struct]) -> str:
    """``exc``'s message, plus what is accepted there and the nearest match, when it is an
    unknown field or an invalid value of a spec of type ``root``."""
    text = str(exc)
    if m := _UNKNOWN.search(text):
        names = sorted({f.encode_name for s in _structs_at(root, m["path"])
                        for f in msgspec.structs.fields(s)}
                       | {_tag_field(s) for s in _structs_at(root, m["path"])} - {""})
        return text + _hint(m["name"], names, "fields")
    if m := _INVALID.search(text):
        path = (m["path"] or "$").split(".")
        values = _values_at(root, ".".join(path[:-1]), path[-1])
        if values:
            return text + _hint(m["value"], values, "values")
    return text


def _hint(got: str, accepted: list[str], what: str) -> str:
    near = difflib.get_close_matches(got, accepted, n=1, cutoff=0.6)
    guess = f"; did you mean {near[0]!r}?" if near else ""
    return f"{guess} ({what} accepted here: {', '.join(accepted)})"


def _structs_at(root: type[msgspec.Struct], path: str | None) -> list[type[msgspec.Struct]]:
    """The Struct types a ``$.a.b`` path can hold (several for a tagged union)."""
    found = [root]
    for name in (path or "$").split(".")[1:]:
        name = name.split("[")[0]
        found = [t for s in found for f in msgspec.structs.fields(s) if f.encode_name == name
                 for t in _struct_types(f.type)]
    return found


def _values_at(root: type[msgspec.Struct], path: str, name: str) -> list[str]:
    """The values field ``name`` accepts in the Structs at ``path``: a tagged union's tags, an
    enum's values, a Literal's."""
    values: list[str] = []
    for s in _structs_at(root, path):
        if _tag_field(s) == name:
            values.append(str(s.__struct_config__.tag))
        for f in msgspec.structs.fields(s):
            if f.encode_name == name:
                values += _choices(f.type)
    return sorted(set(values))


def _tag_field(s: type[msgspec.Struct]) -> str:
    config = s.__struct_config__
    return str(config.tag_field) if config.tag is not None and config.tag_field else ""


def _args(t: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(t)
    if origin is typing.Annotated:
        return (typing.get_args(t)[0],)
    if origin in (typing.Union, types.UnionType, tuple, list):
        return tuple(a for a in typing.get_args(t) if a is not type(None) and a is not Ellipsis)
    return ()


def _struct_types(t: Any) -> list[type[msgspec.Struct]]:
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return [t]
    return [s for a in _args(t) for s in _struct_types(a)]


def _choices(t: Any) -> list[str]:
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return [str(m.value) for m in t]
    if typing.get_origin(t) is typing.Literal:
        return [str(a) for a in typing.get_args(t)]
    return [c for a in _args(t) for c in _choices(a)]
