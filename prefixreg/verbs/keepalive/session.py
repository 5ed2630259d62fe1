"""A loop's session for the keeper: the latest full request the loop sent on a kept head (head
and history), told in process (`KeepAlive.track(body)`) or across processes (`--session FILE`,
one JSON request body per line, appended by the loop after each call).

Invariants:
- A body is a session of a head only when the head's drift check finds nothing (its system
  message, a frame's tools and settings, byte for byte) and, for a bare prefix, it sends no
  tools or template settings (`beyond_prefix`: the keeper could not re-send them, so it
  would keep warm a prompt the loop never sends); its history is copied.
- A session file is read through `open_user_file` (a regular file, never a FIFO, capped),
  on from the last complete line (a long loop's file is never read whole again), each body
  through `core.jsonio`; only complete lines count (a half-written last line waits), and a
  last line that is not a request body reads as None, never a crash.
- A session file is used only if no other local user could have written it: owned by this
  user (root too) and neither group- nor world-writable (`userfiles.refuse_shared`), checked at
  every read (a later chmod counts), else UsageError; its lines go out with the user's key.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from prefixreg.core.errors import PrefixregError, UsageError
from prefixreg.core.frame import Head, beyond_prefix, not_a_prefix_call
from prefixreg.core.jsonio import loads
from prefixreg.core.prefix import check_history
from prefixreg.registry.userfiles import (
    MAX_INPUT_BYTES,
    open_user_file,
    read_open,
    refuse_shared,
)


def _sent(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A request as the worker reads it: openai kwargs' `extra_body` merged in."""
    extra = body.get("extra_body")
    return {**body, **extra} if isinstance(extra, Mapping) else body


def session_of(head: Head, body: object) -> list[dict[str, Any]] | None:
    """The history of `body` (a request as sent: `Frame.body`, or openai kwargs with
    `extra_body`) when it sends `head` unchanged and nothing the head cannot re-send
    (`beyond_prefix`); None when it is not a request of `head`."""
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list):
        return None
    sent = _sent(body)
    if head.drift(sent) or beyond_prefix(head, sent):
        return None
    try:
        return check_history(sent["messages"][1:])
    except UsageError:  # a message without a role: no request the keeper could re-send
        return None


def why_not_kept(heads: Iterable[Head], body: Mapping[str, Any]) -> str:
    """Why `body` is a session of none of `heads`, said for a person: the head it sends
    unchanged but with tools or settings a bare prefix cannot re-send, else drift."""
    for head in heads:
        sent = _sent(body)
        if (extra := beyond_prefix(head, sent)) and not head.drift(sent):
            return not_a_prefix_call(
                head, extra, "the keeper would warm a prompt the loop never sends"
            )
    return "the body sends none of the kept heads unchanged"


class SessionFile:
    """The JSON-lines file a loop appends its request bodies to (one per call)."""

    def __init__(self, path: Path | str) -> None:
        """Raises UsageError: `path` exists and is not a regular file (a FIFO, a directory),
        or another local user could have written it (`refuse_shared`)."""
        self.path = Path(path)
        if (opened := self._open()) is not None:  # None: the loop has not called yet
            os.close(opened[0])
        self._seen: tuple[int, int] | None = None  # (size, mtime) at the last read
        self._offset = 0  # the end of the last complete line read: a long loop's file is
        # read on from there, never whole again (its size bounds no memory, only a line does)

    def _open(self) -> tuple[int, os.stat_result] | None:
        """The file opened and its status from the descriptor (what is checked is what is
        read); None: missing. Raises UsageError: not a regular file, unreadable, or another
        local user could have written it (each line is sent with the user's key)."""
        try:
            fd, st = open_user_file(self.path)
        except FileNotFoundError:
            return None
        except UsageError as exc:
            raise UsageError(f"--session {exc}") from None
        try:
            refuse_shared(st, f"--session {self.path}")
        except UsageError:
            os.close(fd)
            raise
        return fd, st

    def read(self) -> tuple[int, object]:
        """(requests appended since the last read, the latest body or None). A missing file
        is a loop that has not called yet; a truncated one starts over. Raises UsageError: not
        a regular file (a FIFO, a directory), unreadable, too large, or writable by another
        local user."""
        if (opened := self._open()) is None:
            return 0, None
        fd, st = opened
        if self._seen == (st.st_size, st.st_mtime_ns):
            os.close(fd)
            return 0, None
        if st.st_size < self._offset:  # truncated by the loop: start over
            self._offset = 0
        start = max(self._offset, st.st_size - MAX_INPUT_BYTES)  # only the latest line counts:
        data = read_open(fd, self.path, offset=start)  # a keeper started on a long loop's
        if start > self._offset:  # file reads its last 64 MiB, from the first line there
            cut = data.find(b"\n") + 1
            data, start = data[cut:], start + cut
        self._seen = (st.st_size, st.st_mtime_ns)
        end = data.rfind(b"\n") + 1
        self._offset = start + end
        lines = [line for line in data[:end].split(b"\n") if line.strip()]
        if not lines:
            return 0, None
        try:
            return len(lines), loads(lines[-1], path=self.path)
        except PrefixregError:  # not a request body: counted, its body None
            return len(lines), None
