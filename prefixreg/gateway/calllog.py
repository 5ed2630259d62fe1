"""The gateway's call log: one JSON line per call, hashes and counts only, in the call-log
record shape `prefixreg audit` reads (format `prefixreg-call`, version 1):

    {"format": "prefixreg-call", "version": 1,
     "system": {"sha256": <hex>|null, "bytes": <int>|null},
     "rest_bytes": <int>|null, "tools_sha256": <hex>|null,
     "chain": [<16 hex>, ...],
     "evidence": <CallEvidence.to_dict()>,
     "at": <UTC ISO time>,
     "gateway": {"call": <id>, "api": ..., "head": <sha>|null, "head_name": ..., "session":
                 <hash>, "worker": <url>, "verdict": ..., "reason": ..., "miss": ...,
                 "drift": {"part", "offset"}|null, "strips": <int>, "status": <int>,
                 "streamed": <bool>, "added_ms": <float>}}

`system` is the head's system text (the chat system message, Anthropic `system`, Responses
`instructions`), `rest_bytes` the text bytes after it, `chain` the session chain over the
tools and the messages as the chat API would send them (system first): for each message i,
the first 16 hex digits of a sha256 over the tools and messages[0..i], each framed by its
length, so a call whose chain holds an earlier call's last entry continues that call.

Invariants: no prompt text, no output text, no key, no client header value is written;
one whole line per call or nothing (an `O_APPEND` write of the line, cut back on a short
write); the file is a regular file (checked at every open); a write failure is logged and
counted, never the loop's failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from prefixreg.core.jsonio import JSONObject, JSONValue, dumps_canonical, dumps_ordered
from prefixreg.core.records import CallEvidence

log = logging.getLogger("prefixreg.gateway")
CALL_FORMAT: Final = "prefixreg-call"
CALL_VERSION: Final = 1
CHAIN_HEX: Final = 16


def message_chain(tools: object, messages: Sequence[object]) -> list[str]:
    """The session chain (see the module docstring); [] when a part is not JSON."""
    try:
        h = hashlib.sha256(dumps_canonical(tools))
        out = []
        for message in messages:
            part = dumps_canonical(message)
            h.update(len(part).to_bytes(8, "big") + part)
            out.append(h.copy().hexdigest()[:CHAIN_HEX])
    except (TypeError, ValueError):
        return []
    return out


def record(
    *,
    system: bytes | None,
    rest_bytes: int | None,
    tools: object,
    messages: Sequence[object],
    evidence: CallEvidence,
    gateway: Mapping[str, Any],
) -> JSONObject:
    """One call's line as a JSON object."""
    tools_sha = None
    if tools is not None:
        with contextlib.suppress(TypeError, ValueError):
            tools_sha = hashlib.sha256(dumps_canonical(tools)).hexdigest()
    return {
        "format": CALL_FORMAT,
        "version": CALL_VERSION,
        "system": {
            "sha256": None if system is None else hashlib.sha256(system).hexdigest(),
            "bytes": None if system is None else len(system),
        },
        "rest_bytes": rest_bytes,
        "tools_sha256": tools_sha,
        "chain": list[JSONValue](message_chain(tools, messages)),
        "evidence": evidence.to_dict(),
        "at": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "gateway": dict(gateway),
    }


class CallLog:
    """Appends call lines to `path` (None: no log)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.failures = 0
        self.lines = 0

    def write(self, line_object: JSONObject) -> None:
        if self.path is None:
            return
        try:
            line = dumps_ordered(line_object).encode("utf-8") + b"\n"
            _append(self.path, line)
            self.lines += 1
        except (OSError, TypeError, ValueError) as exc:
            self.failures += 1
            log.warning("call log: line not written (%s)", type(exc).__name__)


def _append(path: Path, line: bytes) -> None:
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, st.st_size)
            raise
    finally:
        os.close(fd)
