"""Strict reading of records, from their dataclass fields. Pure: no I/O.

`decode(cls, data, what)` builds a frozen record dataclass from a JSON object, each field
read by its annotation; `encode(record)` gives the object back: one codec for every record.

Invariants:
- A count is valid only as an exact non-negative `int` (never bool, float or string); a
  float field takes an int or a float, never a bool; a `bool` field only `true`/`false`.
- A field annotated `X | None` may be missing or null; any other field must be present.
- A `Literal[...]` field takes only its listed values; `dict` fields only JSON objects; a
  field whose type is another record is read by that record's own `from_dict`.
- Anything else raises `CorruptRecordError` naming the record and the field: a record read
  from disk is either well-formed or refused.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, Literal, TypeVar, cast

from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.jsonio import JSONObject

T = TypeVar("T")


def strict_count(value: object) -> int | None:
    """A count is valid only if its type is exactly int and it is >= 0 (bool is refused)."""
    return value if type(value) is int and value >= 0 else None


def strict_number(value: object) -> float | None:
    """A finite number >= 0 as a float, else None (a bool or a numeric string is no number)."""
    if type(value) is not int and type(value) is not float:
        return None
    try:
        number = float(cast(float, value))
    except OverflowError:  # an int beyond any float
        return None
    return number if math.isfinite(number) and number >= 0 else None


def obj(value: object, what: str) -> JSONObject:
    if not isinstance(value, dict):
        raise CorruptRecordError(f"{what}: expected a JSON object")
    return cast(JSONObject, value)


def _read(kind: Any, value: object) -> tuple[bool, object]:
    """(ok, value) for one JSON value against one annotation (no None handling)."""
    if typing.get_origin(kind) is Literal:
        return value in typing.get_args(kind), value
    if kind is int:
        count = strict_count(value)
        return count is not None, count
    if kind is float:
        ok = type(value) in (int, float)
        return ok, float(cast(float, value)) if ok else value
    if kind is bool:
        return isinstance(value, bool), value
    if kind is str:
        return isinstance(value, str), value
    if typing.get_origin(kind) is dict or kind is dict:
        return isinstance(value, dict), value
    if dataclasses.is_dataclass(kind):  # a nested record reads itself (and raises itself)
        return True, cast(Any, kind).from_dict(value)
    return False, value


@cache
def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, annotation without None, optional) per init field of a record dataclass."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind, optional = hints[f.name], False
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            optional = len(args) < len(typing.get_args(kind))
            kind = args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
        out.append((f.name, kind, optional))
    return tuple(out)


def decode(cls: type[T], data: object, what: str, *, keys: Mapping[str, str] | None = None) -> T:
    """A `cls` record from a JSON object read strictly; `keys`: field name -> JSON key."""
    d = obj(data, what)
    values: dict[str, object] = {}
    for name, kind, optional in _fields(cast(type, cls)):
        key = (keys or {}).get(name, name)
        value = d.get(key)
        if value is None:
            if not optional:
                raise CorruptRecordError(f"{what}: field {key!r} is missing")
            values[name] = None
            continue
        ok, read = _read(kind, value)
        if not ok:
            raise CorruptRecordError(f"{what}: field {key!r} is not a valid {_name(kind)}")
        values[name] = read
    return cls(**values)


def encode(record: object, *, keys: Mapping[str, str] | None = None) -> JSONObject:
    """The JSON object of a record dataclass: every init field, by its JSON key."""
    return {
        (keys or {}).get(f.name, f.name): getattr(record, f.name)
        for f in dataclasses.fields(cast(Any, record))
        if f.init
    }


def _name(kind: Any) -> str:
    if typing.get_origin(kind) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(kind))
    names = {int: "non-negative integer", float: "number", bool: "boolean", str: "string"}
    return names.get(kind, "JSON object")
