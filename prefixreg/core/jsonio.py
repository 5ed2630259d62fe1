"""Canonical JSON via orjson. Pure: bytes in, bytes out; no files.

Canonical form = orjson with sorted keys, UTF-8, no whitespace. It is the hashing contract
for build ids and the on-disk form of every record. Non-finite floats are refused (orjson
would silently write `null`), non-string keys are refused, and a decode failure becomes
`CorruptRecordError` so callers never see an orjson exception.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

import orjson

from prefixreg.core.errors import CorruptRecordError

__all__ = ["JSONObject", "JSONValue", "dumps_canonical", "dumps_pretty", "loads", "loads_object"]

JSONValue: TypeAlias = "dict[str, JSONValue] | list[JSONValue] | str | int | float | bool | None"
JSONObject: TypeAlias = "dict[str, JSONValue]"


def _check_finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("non-finite float in a record")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"record keys must be strings, got {type(key).__name__}")
            _check_finite(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_finite(item)


def dumps_canonical(value: Any) -> bytes:
    """Serialise `value` canonically (sorted keys, compact, UTF-8)."""
    _check_finite(value)
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def dumps_pretty(value: Any) -> bytes:
    """Serialise for people and `--json` output: sorted keys, indented, trailing newline."""
    _check_finite(value)
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def loads(data: bytes | str, *, path: Path | None = None) -> JSONValue:
    """Parse JSON; a decode error becomes `CorruptRecordError` naming `path`."""
    try:
        value: JSONValue = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        where = f"{path}: " if path is not None else ""
        raise CorruptRecordError(f"{where}not valid JSON ({exc})", path=path) from exc
    return value


def loads_object(data: bytes | str, *, path: Path | None = None) -> JSONObject:
    """Parse a JSON object; anything else (list, string, ...) is a `CorruptRecordError`."""
    value = loads(data, path=path)
    if not isinstance(value, dict):
        where = f"{path}: " if path is not None else ""
        raise CorruptRecordError(f"{where}expected a JSON object", path=path)
    return value
