"""Strict field readers for records read from disk or a server. Pure: no I/O.

Invariants: a count is valid only as an exact non-negative `int` (never bool, float or
string); every reader either returns a value of the promised type or raises
`CorruptRecordError` naming the record and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.jsonio import JSONObject

__all__ = ["obj", "opt_float", "opt_int", "opt_str", "req_sha", "req_str", "strict_count"]


def strict_count(value: object) -> int | None:
    """A count is valid only if its type is exactly int and it is >= 0 (bool is refused)."""
    if type(value) is int and value >= 0:
        return value
    return None


def req_str(data: Mapping[str, object], key: str, what: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise CorruptRecordError(f"{what}: field {key!r} must be a string")
    return value


def opt_str(data: Mapping[str, object], key: str, what: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise CorruptRecordError(f"{what}: field {key!r} must be a string or null")
    return value


def req_sha(data: Mapping[str, object], key: str, what: str) -> str:
    value = req_str(data, key, what)
    if not is_full_sha(value):
        raise CorruptRecordError(f"{what}: field {key!r} is not a sha256")
    return value


def opt_int(data: Mapping[str, object], key: str, what: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    count = strict_count(value)
    if count is None:
        raise CorruptRecordError(f"{what}: field {key!r} must be a non-negative integer")
    return count


def opt_float(data: Mapping[str, object], key: str, what: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if type(value) not in (int, float):
        raise CorruptRecordError(f"{what}: field {key!r} must be a number")
    return float(cast(float, value))


def obj(value: object, what: str) -> JSONObject:
    if not isinstance(value, dict):
        raise CorruptRecordError(f"{what}: expected a JSON object")
    return cast(JSONObject, value)
