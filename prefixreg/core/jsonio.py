"""The project's one JSON reader and writer (orjson). Pure: bytes in, bytes out; no files.

Canonical form = orjson with sorted keys, UTF-8, no whitespace. It is the hashing contract
for build ids and the on-disk form of every record.

Invariants (the project's number and shape rules, for everything it reads or writes):
- Nesting deeper than `MAX_DEPTH` (64) is refused; nothing here recurses, so no input can
  raise `RecursionError` anywhere downstream.
- Non-finite floats, integers beyond 64 bits, lone surrogates and non-string keys are
  refused on write (orjson would write `null` for NaN); NaN, Infinity, invalid escapes on read.
- `exact=True` also refuses integers outside the signed/unsigned 64-bit range (orjson would
  make them floats: the value sent would not be the value stored) and keeps the key order:
  for user JSON stored as exact bytes (a frame's tools).
- A failure is `CorruptRecordError` naming the path (callers reading user input turn it
  into a `UsageError`); no orjson or json exception leaves this module.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Final, TypeAlias

import orjson

from prefixreg.core.errors import CorruptRecordError

JSONValue: TypeAlias = "dict[str, JSONValue] | list[JSONValue] | str | int | float | bool | None"
JSONObject: TypeAlias = "dict[str, JSONValue]"

MAX_DEPTH: Final = 64
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1


def check_value(value: Any, *, max_depth: int = MAX_DEPTH) -> None:
    """Refuse (ValueError, TypeError) what is never read or written as JSON (the module's
    rules; deeper than `max_depth`). Iterative: any depth is safe to check."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > max_depth:
                raise ValueError(f"nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                for key, sub in item.items():
                    if not isinstance(key, str):
                        raise TypeError(f"keys must be strings, got {type(key).__name__}")
                    stack.append((key, depth))
                    stack.append((sub, depth + 1))
            else:
                stack.extend((sub, depth + 1) for sub in item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError("a non-finite number is not JSON")
        elif isinstance(item, int) and not _INT_MIN <= item <= _INT_MAX:  # a bool is in range
            raise ValueError("an integer beyond 64 bits")
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string with a lone surrogate") from None


def dumps_canonical(value: Any) -> bytes:
    """Sorted keys, compact, UTF-8."""
    check_value(value)
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def dumps_pretty(value: Any) -> bytes:
    """For people and `--json` output: sorted keys, indented, trailing newline."""
    check_value(value)
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def dumps_ordered(value: Any) -> str:
    """JSON text that keeps key order (tools render in the order they are written)."""
    check_value(value)
    return orjson.dumps(value).decode("utf-8")


def dumps_checked(value: Any) -> bytes:
    """`dumps_ordered`'s UTF-8 bytes of a value `check_value` already passed, not walked
    again: a request body checked at its door, serialised once when it is sent."""
    return orjson.dumps(value)


def _refuse_constant(name: str) -> object:  # NaN, Infinity
    raise ValueError(f"{name} is not a JSON value")


def _exact_int(text: str) -> int:
    number = int(text)
    if not _INT_MIN <= number <= _INT_MAX:
        raise ValueError(f"the integer {text[:24]} is beyond 64 bits")
    return number


def loads(
    data: bytes | str, *, path: Path | None = None, max_depth: int = MAX_DEPTH, exact: bool = False
) -> JSONValue:
    """Parse JSON by the project's rules. Raises CorruptRecordError: not JSON, or JSON the
    project refuses; names `path`."""
    where = f"{path}: " if path is not None else ""
    try:
        value: JSONValue = orjson.loads(data)
        check_value(value, max_depth=max_depth)
        if exact:  # depth is known to be small now: the recursive stdlib parser is safe
            import json  # only exact reads need it: a command's start-up does not pay for it

            text = data.decode("utf-8") if isinstance(data, bytes) else data
            value = json.loads(text, parse_int=_exact_int, parse_constant=_refuse_constant)
    except (orjson.JSONDecodeError, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptRecordError(f"{where}not valid JSON ({exc})", path=path) from None
    return value


def loads_flat(data: bytes) -> dict[str, JSONValue] | None:
    """The JSON object in `data` when it is flat: every value a string, an integer within
    64 bits or null; else None, and `loads` says what, if anything, is wrong. What this
    returns `loads` would return too (orjson refuses lone surrogates, NaN and infinities),
    without its walk over every value: the fast path of the small records read by the
    thousand (meta records, in `ls` and `verify`)."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if type(value) is not dict:
        return None
    for item in value.values():
        kind = type(item)
        if kind is int:
            if not _INT_MIN <= item <= _INT_MAX:
                return None
        elif kind is not str and item is not None:
            return None
    return value


def loads_object(data: bytes | str, *, path: Path | None = None, exact: bool = False) -> JSONObject:
    """Parse a JSON object; anything else (list, string, ...) is a `CorruptRecordError`."""
    value = loads(data, path=path, exact=exact)
    if not isinstance(value, dict):
        where = f"{path}: " if path is not None else ""
        raise CorruptRecordError(f"{where}expected a JSON object", path=path)
    return value
