"""A call log: one JSON line per call that `prefixreg audit` reads as it is, holding hashes and
counts, never prompt or output text. The writer and the reader of the line both live here, so
a loop (`Session(calls=)`), a gateway or any other code writes the shape audit reads.

The line (`call_record`), keys in this order::

    {"format": "prefixreg-call", "version": 1,
     "system": {"sha256": <hex>|null, "bytes": <int>|null},
     "rest_bytes": <int>, "tools_sha256": <hex>|null,
     "head": {"sha256": <hex>, "kind": "prefix"|"frame", "bytes": <int>}|null,
     "chain": [<16 hex>, ...],
     "evidence": <CallEvidence.to_dict()>,
     "at": <UTC ISO time>|null}

- `system`: the sha256 and UTF-8 length of `messages[0].content` (null when it is not a
  string); `rest_bytes`: the text bytes of the messages after it (`prefix.rest_bytes`).
- `head`: the registered head the call sent whole (a frame's sha for a frame, with its
  head bytes: system and rendered tools), when the writer knows it and the body does not
  drift from it; else null (audit then judges the call against its system prompt).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from prefixreg.core.digest import is_full_sha, sha256_hex
from prefixreg.core.errors import CorruptRecordError, UsageError, check_type
from prefixreg.core.fields import strict_count
from prefixreg.core.frame import Frame, Head
from prefixreg.core.jsonio import JSONObject, dumps_canonical, dumps_ordered
from prefixreg.core.prefix import Prefix, text_bytes
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


def _head(head: Head | None, body: Mapping[str, Any]) -> JSONObject | None:
    if head is None:
        return None
    try:
        if head.drift(body):
            return None  # what was sent is not the head: judged by its own system prompt
    except UsageError:
        return None
    return {"sha256": head.sha256, "kind": head.kind, "bytes": head.head_bytes}


def call_record(
    body: Mapping[str, Any],
    evidence: CallEvidence,
    *,
    head: Head | None = None,
    at: str | None = None,
) -> JSONObject:
    """The call-log record of one call: the request `body` it sent (only hashed and counted),
    the server's `evidence`, and `head`, the registered head it sends (`Registry.head`) when
    known. Raises ArgumentTypeError (a UsageError and a TypeError) naming the argument: a
    body, evidence or head of the wrong type; UsageError: a body without messages."""
    check_type(body, Mapping, "call_record: body", "a request body (a mapping)")
    if not isinstance(body.get("messages"), list):
        raise UsageError("call_record: body has no messages list")
    check_type(evidence, CallEvidence, "call_record: evidence", "a CallEvidence")
    check_type(head, (Prefix, Frame, type(None)), "call_record: head", "a Prefix, a Frame or None")
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
        "head": _head(head, body),
        "chain": list(message_chain(body)),
        "evidence": evidence.to_dict(),
        "at": at,
    }


def call_line(
    body: Mapping[str, Any],
    evidence: CallEvidence,
    *,
    head: Head | None = None,
    at: str | None = None,
) -> bytes:
    """`call_record` as one JSON line (ends with a newline)."""
    record = call_record(body, evidence, head=head, at=at)
    return dumps_ordered(record).encode("utf-8") + b"\n"


@dataclass(frozen=True, slots=True)
class CallRead:
    """A call record read back: what audit needs of it."""

    evidence: CallEvidence
    sha256: str | None
    system_bytes: int | None
    rest_bytes: int | None
    chain: tuple[str, ...]
    frame: str | None = None  # the frame the call sent whole, when the writer knew it
    head_bytes: int | None = None  # the head's bytes (a frame's: system and tools)


def is_call_record(value: Mapping[str, object]) -> bool:
    return value.get("format") == CALL_FORMAT


def _hex_chain(value: object) -> tuple[str, ...] | None:
    if not isinstance(value, list):
        return None
    digits = set("0123456789abcdef")
    ok = all(isinstance(c, str) and len(c) == CHAIN_HEX and set(c) <= digits for c in value)
    return tuple(value) if ok else None


def read_call_record(value: Mapping[str, object]) -> CallRead | str:
    """A call record (`is_call_record`) read strictly; a string saying why when it is not one."""
    if value.get("version") != CALL_VERSION:
        return f"a {CALL_FORMAT} record of version {value.get('version')!r:.20}, not {CALL_VERSION}"
    try:
        evidence = CallEvidence.from_dict(value.get("evidence"))
    except CorruptRecordError as exc:
        return f"{CALL_FORMAT}: corrupt evidence: {exc}"
    system, rest, head = value.get("system"), value.get("rest_bytes"), value.get("head")
    if not isinstance(system, dict):
        return f"{CALL_FORMAT}: system is not an object"
    sha, size = system.get("sha256"), system.get("bytes")
    if sha is not None and not (isinstance(sha, str) and is_full_sha(sha)):
        return f"{CALL_FORMAT}: system.sha256 is not a sha256"
    if size is not None and strict_count(size) is None:
        return f"{CALL_FORMAT}: system.bytes is not a count"
    if rest is not None and strict_count(rest) is None:
        return f"{CALL_FORMAT}: rest_bytes is not a count"
    if (chain := _hex_chain(value.get("chain"))) is None:
        return f"{CALL_FORMAT}: chain is not a list of {CHAIN_HEX}-digit hashes"
    read = CallRead(evidence, sha, strict_count(size), strict_count(rest), chain)
    if head is None:
        return read
    hsha = head.get("sha256") if isinstance(head, dict) else None
    hbytes = strict_count(head.get("bytes")) if isinstance(head, dict) else None
    kind = head.get("kind") if isinstance(head, dict) else None
    if kind not in ("prefix", "frame") or not isinstance(hsha, str) or not is_full_sha(hsha):
        return f"{CALL_FORMAT}: head is not a head (sha256, kind, bytes)"
    if hbytes is None:
        return f"{CALL_FORMAT}: head.bytes is not a count"
    return replace(read, frame=hsha if kind == "frame" else None, head_bytes=hbytes)


def append_line(
    path: Path | str, line: bytes, check: Callable[[os.stat_result], None] | None = None
) -> None:
    """Append `line` (whole, or nothing) to the regular file `path`, created 0600; `check`
    (e.g. `userfiles.refuse_shared`) may refuse the file on the descriptor's status first.
    Raises UsageError: the path is not a regular file or cannot be written."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path}: not a regular file; refused")
        if st.st_nlink > 1:  # another name of it may be a registry's file (names.log)
            raise UsageError(
                f"{path}: has {st.st_nlink} hard links; refused (append to a file of its own)"
            )
        if check is not None:
            check(st)
        try:
            view = memoryview(line)
            while view:  # a reader takes only complete lines
                view = view[os.write(fd, view) :]
        except BaseException as exc:
            # A short write (a full disk): cut back to the size before it. A log has one
            # writer (a conversation, a gateway); a second appending one would share its fate.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, st.st_size)
            if isinstance(exc, OSError):
                raise UsageError(f"{path}: {exc.strerror or exc}; not written") from None
            raise
    finally:
        os.close(fd)
