"""Server-sent events, read by the WHATWG event-stream rules. Pure: no I/O.

An OpenAI-compatible stream is events whose `data` is one JSON document each, ended by
`data: [DONE]`. The spec, as code:
- Lines end with CRLF, LF or CR (a CRLF may be cut between pieces); a leading BOM is dropped.
  Bytes are split into lines before decoding (CR and LF never occur inside UTF-8), so a
  character cut between pieces is whole again in its line.
- `field: value` (one space after the colon dropped; no colon: an empty value). An event's
  `data` lines are joined with "\\n"; a blank line ends it. Comments, `id`, `retry` (no
  reconnection here) and unknown fields are ignored.
- `event: error` fails the call whatever its data (its text is not kept); other events are
  judged by their data. An event still open at the end of the body is discarded: `[DONE]`
  without its dispatching blank line did not end the stream properly.

Invariants: each byte is scanned a bounded number of times (an unfinished line's pieces are
joined once: a long line fed byte by byte stays linear); a line not UTF-8 or an event's
data not JSON (`core.jsonio`'s rules) marks the stream `malformed`, never a guess; after
`[DONE]` nothing more is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.core.jsonio import loads

_LINE_END: Final = re.compile(rb"\r\n|\r|\n")
_BOM: Final = b"\xef\xbb\xbf"


@dataclass(slots=True)
class SSEStream:
    """One stream's events: `chunks`, their JSON values in order (a non-object is judged later;
    none kept with `keep=False`); `done` once `[DONE]` arrived; `malformed`, the first why."""

    chunks: list[object] = field(default_factory=list)
    done: bool = False
    malformed: str | None = None


class SSEParser:
    """Incremental reader: `feed` it the body's bytes as they arrive, it returns the JSON values
    of the events they completed (with `keep=False` not also kept: no per-frame memory)."""

    def __init__(self, *, keep: bool = True) -> None:
        self._keep = keep is True
        self._pending: list[bytes] = []  # pieces of the line not yet ended
        self._skip_lf = False  # the last piece ended with CR: a leading LF ends nothing
        self._started = False  # the BOM check is done
        self._data: list[str] = []
        self._event = ""
        self.stream = SSEStream()

    def feed(self, data: bytes | bytearray) -> list[object]:
        given: object = data  # callers outside the type checker pass anything
        if not isinstance(given, bytes | bytearray):
            raise UsageError(f"an event stream is fed bytes, not {type(data).__name__}")
        if self._skip_lf and data:
            self._skip_lf = False
            data = data[1:] if data[:1] == b"\n" else data
        if not data or self.stream.done:
            return []
        if b"\n" not in data and b"\r" not in data:
            # Join once the line ends: re-scanning a growing buffer would be quadratic.
            self._pending.append(bytes(data))
            return []
        lines = _LINE_END.split(data)
        rest = lines.pop()
        self._skip_lf = rest == b"" and data[-1:] == b"\r"
        lines[0] = b"".join([*self._pending, lines[0]])
        self._pending = [bytes(rest)] if rest else []
        frames = [self._line(line) for line in lines]  # lines after [DONE] give None
        return [frame for frame in frames if frame is not None]

    def finish(self) -> SSEStream:
        """End of body: an unended line is read, an undispatched event is discarded."""
        if self._pending:
            self._line(b"".join(self._pending))
        self._pending, self._data, self._event = [], [], ""
        return self.stream

    def _line(self, line: bytes) -> object | None:
        """Take one line (without its line ending); the frame it completed, if any."""
        if self.stream.done:
            return None
        if not self._started:
            self._started = True
            line = line.removeprefix(_BOM)
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            self.stream.malformed = self.stream.malformed or "the stream is not UTF-8"
            return None
        if not text:
            return self._dispatch()
        if text[0] == ":":
            return None  # a comment: `: keepalive`
        name, colon, value = text.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None  # `id`, `retry` and unknown fields: read and ignored

    def _dispatch(self) -> object | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        payload = "\n".join(data)
        if not data or (event != "error" and not payload.strip()):
            return None  # no data, or `data:` with nothing in it: no claim either way
        if event == "error":
            frame: object = {"error": {"event": "error"}}  # no server text is kept
        elif payload.strip() == "[DONE]":
            self.stream.done = True
            return None
        else:
            try:
                frame = loads(payload)
            except CorruptRecordError:
                self.stream.malformed = self.stream.malformed or "a data: line is not JSON"
                return None
        if self._keep:
            self.stream.chunks.append(frame)
        return frame


def parse_sse(data: bytes | bytearray | str) -> SSEStream:
    """Decode a whole SSE body (bytes, or text); `UsageError` for anything else."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")  # a lone surrogate is not UTF-8
    parser = SSEParser()
    parser.feed(data)
    return parser.finish()
