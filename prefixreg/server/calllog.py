"""A call log: one JSON line per call that `prefixreg audit` reads as it is, holding hashes and
counts, never prompt or output text. The writer and the reader of the line both live here, so
a loop (`Session(calls=)`), a gateway or any other code writes the shape audit reads.

The line (`call_record`), keys in this order::

    {"format": "prefixreg-call", "version": 1,
     "system": {"sha256": <hex>|null, "bytes": <int>|null},
     "rest_bytes": <int>, "tools_sha256": <hex>|null,
     "chain": [<16 hex>, ...],
     "evidence": <CallEvidence.to_dict()>,
     "at": <UTC ISO time>|null}

- `system`: the sha256 and UTF-8 length of `messages[0].content` (null when it is not a
  string); `rest_bytes`: the text bytes of the messages after it (`prefix.rest_bytes`).
- `chain`: `message_chain(body)`: for each message i, the first 16 hex digits of a sha256 over
  the request's tools and messages[0..i], so a later call whose chain holds an earlier call's
  last entry sent that call's whole prompt first: the calls of one session, matched without text.
- `evidence`: the server's counts for the call, as `evidence_from_response` read them.

Invariants: `message_chain` and `call_record` are pure and never raise on a body a worker
reads; `read_call_record` never raises (it returns why a line is not a call record);
`append_line` appends one whole line or nothing (a short write is cut back) to a regular file
and refuses anything else. The caller checks the path first (`check_output_file`): this layer
does not know the registry.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prefixreg.core.digest import is_full_sha, sha256_hex
from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.core.fields import strict_count
from prefixreg.core.jsonio import JSONObject, dumps_canonical, dumps_ordered
from prefixreg.core.prefix import text_bytes
from prefixreg.core.records import CallEvidence

CALL_FORMAT: Final = "prefixreg-call"
CALL_VERSION: Final = 1
CHAIN_HEX: Final = 16  # 64 bits a boundary: no two prompts of one batch share one by chance


def message_chain(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The session chain of a request body (the module's `chain`); () when it has no messages
    or holds what JSON cannot carry."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ()
    try:
        h = hashlib.sha256(dumps_canonical(body.get("tools")))
        out = []
        for message in messages:
            part = dumps_canonical(message)
            h.update(len(part).to_bytes(8, "big") + part)  # framed: no two splits hash alike
            out.append(h.copy().hexdigest()[:CHAIN_HEX])
    except (TypeError, ValueError):  # not JSON (a lone surrogate, a float NaN): no chain
        return ()
    return tuple(out)


def _system(body: Mapping[str, Any]) -> JSONObject:
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    content = first.get("content") if isinstance(first, dict) else None
    try:
        data = content.encode("utf-8") if isinstance(content, str) else None
    except UnicodeEncodeError:
        data = None
    return {
        "sha256": None if data is None else sha256_hex(data),
        "bytes": None if data is None else len(data),
    }


def call_record(
    body: Mapping[str, Any], evidence: CallEvidence, *, at: str | None = None
) -> JSONObject:
    """The call-log record of one call: the request `body` it sent (only hashed and counted)
    and the server's `evidence`. Raises UsageError: not a body with messages, or no evidence."""
    given: object = body  # callers outside the type checker pass anything
    if not isinstance(given, Mapping) or not isinstance(given.get("messages"), list):
        raise UsageError(
            f"call_record takes a request body with messages, not {type(given).__name__}"
        )
    if not isinstance(evidence, CallEvidence):
        raise UsageError(f"call_record takes a CallEvidence, not {type(evidence).__name__}")
    tools = body.get("tools")
    tools_sha = None
    with contextlib.suppress(TypeError, ValueError):
        tools_sha = None if tools is None else sha256_hex(dumps_canonical(tools))
    return {
        "format": CALL_FORMAT,
        "version": CALL_VERSION,
        "system": _system(body),
        "rest_bytes": text_bytes(body["messages"][1:]),
        "tools_sha256": tools_sha,
        "chain": list(message_chain(body)),
        "evidence": evidence.to_dict(),
        "at": at,
    }


def call_line(body: Mapping[str, Any], evidence: CallEvidence, *, at: str | None = None) -> bytes:
    """`call_record` as one JSON line (ends with a newline)."""
    return dumps_ordered(call_record(body, evidence, at=at)).encode("utf-8") + b"\n"


@dataclass(frozen=True, slots=True)
class CallRead:
    """A call record read back: what audit needs of it."""

    evidence: CallEvidence
    sha256: str | None
    system_bytes: int | None
    rest_bytes: int | None
    chain: tuple[str, ...]


def is_call_record(value: Mapping[str, object]) -> bool:
    return value.get("format") == CALL_FORMAT


def read_call_record(value: Mapping[str, object]) -> CallRead | str:
    """A call record (`is_call_record`) read strictly; a string saying why when it is not one."""
    if value.get("version") != CALL_VERSION:
        return f"a {CALL_FORMAT} record of version {value.get('version')!r:.20}, not {CALL_VERSION}"
    try:
        evidence = CallEvidence.from_dict(value.get("evidence"))
    except CorruptRecordError as exc:
        return f"{CALL_FORMAT}: corrupt evidence: {exc}"
    system = value.get("system")
    sha = system.get("sha256") if isinstance(system, dict) else None
    size = system.get("bytes") if isinstance(system, dict) else None
    chain = value.get("chain")
    if not isinstance(system, dict) or not (
        sha is None or (isinstance(sha, str) and is_full_sha(sha))
    ):
        return f"{CALL_FORMAT}: system.sha256 is not a sha256"
    if size is not None and strict_count(size) is None:
        return f"{CALL_FORMAT}: system.bytes is not a count"
    rest = value.get("rest_bytes")
    if rest is not None and strict_count(rest) is None:
        return f"{CALL_FORMAT}: rest_bytes is not a count"
    if not isinstance(chain, list) or not all(
        isinstance(c, str) and len(c) == CHAIN_HEX and all(ch in "0123456789abcdef" for ch in c)
        for c in chain
    ):
        return f"{CALL_FORMAT}: chain is not a list of {CHAIN_HEX}-digit hashes"
    return CallRead(evidence, sha, size, rest, tuple(chain))  # type: ignore[arg-type]


def append_line(path: Path | str, line: bytes) -> None:
    """Append `line` (whole, or nothing) to the regular file `path`, created 0600. Raises
    UsageError: the path is not a regular file or cannot be written."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path}: not a regular file; refused")
        try:
            view = memoryview(line)
            while view:  # a reader takes only complete lines
                view = view[os.write(fd, view) :]
        except BaseException as exc:
            with contextlib.suppress(OSError):  # a full disk: cut back to the size before it
                os.ftruncate(fd, st.st_size)
            if isinstance(exc, OSError):
                raise UsageError(f"{path}: {exc.strerror or exc}; not written") from None
            raise
    finally:
        os.close(fd)
