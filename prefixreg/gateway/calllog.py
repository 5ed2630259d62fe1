"""The gateway's call log: one JSON line per call in the call-log record `audit` reads
(`server.calllog.call_record`: format `prefixreg-call`, hashes and counts only), with the
gateway's own view of the call beside it under `gateway`:

    {"call": <id>, "api": ..., "head": <sha>|null, "head_name": ..., "session": <hash>,
     "worker": <url>, "status": <int>, "streamed": <bool>, "verdict": ..., "reason": ...,
     "miss": ..., "judgement": {...}, "drift": {"part", "offset"}|null, "strips": <int>,
     "door_ms": <float>}

The record is written for the request as the chat API would carry it (`chat_body`): the
head's system text first, then the history, and the tools, so a Messages or Responses call
is hashed and counted as its chat twin would be, and its chain matches its session's.

Invariants: no prompt text, no output text, no key, no client header value is written; one
whole line per call or nothing (`server.calllog.append_line`); a write that fails is
logged and counted, never the loop's failure.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefixreg.core.errors import PrefixregError
from prefixreg.core.jsonio import JSONObject, dumps_ordered
from prefixreg.core.records import CallEvidence
from prefixreg.registry.userfiles import check_output_file
from prefixreg.server.calllog import append_line, call_record

log = logging.getLogger("prefixreg.gateway")


def chat_body(system: bytes | None, history: Sequence[Any], tools: object) -> dict[str, Any]:
    """The request as the chat API carries it: system message (when there is a head), the
    history, the tools."""
    messages: list[Any] = []
    if system is not None:
        messages.append({"role": "system", "content": system.decode("utf-8", "replace")})
    messages += list(history)
    body: dict[str, Any] = {"messages": messages}
    if tools is not None:
        body["tools"] = tools
    return body


def record(
    body: Mapping[str, Any], evidence: CallEvidence, gateway: Mapping[str, Any]
) -> JSONObject:
    """One call's line as a JSON object: audit's record, then the gateway's view."""
    at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    line = call_record(body, evidence, at=at)
    line["gateway"] = dict(gateway)
    return line


class CallLog:
    """Appends call lines to `path` (None: no log)."""

    def __init__(self, path: Path | None) -> None:
        # The one rule for a user's output (never inside a registry), at the gateway's door.
        self.path = None if path is None else check_output_file(path, "--call-log")
        self.failures = 0
        self.lines = 0

    def write(self, line_object: JSONObject) -> None:
        if self.path is None:
            return
        try:
            append_line(self.path, dumps_ordered(line_object).encode("utf-8") + b"\n")
            self.lines += 1
        except (PrefixregError, OSError, TypeError, ValueError) as exc:
            self.failures += 1
            log.warning("call log: line not written (%s)", type(exc).__name__)
