"""HTTP transport for one worker: every call has a deadline and every reply a size cap.

What a hostile or broken server can do, and what stops it:

- Trickle (headers or body, a byte a second) or go silent: each call has one deadline that
  bounds it whole, from connect to last byte, streams included. httpx's own timeouts apply
  per read, so a `Deadline` also shuts the call's socket down when its time is up (the socket
  comes from httpcore's `connect_tcp` trace event; connections are not kept alive, so every
  call has its own), and the time left is checked between pieces. Past the deadline the call
  raises `WorkerTimeoutError`, within a fraction of a second.
- Send more than any real reply: bodies are streamed and counted (after content decoding,
  since memory is what the cap protects) and a reply over `max_bytes` raises
  `ReplyTooLargeError` as soon as the count passes the cap (or at once, from a
  `Content-Length` over it). `resp.content` of an unbounded body is never taken.
- Fail: connection refused -> `WorkerUnreachableError`; 503 `engine_busy` ->
  `EngineBusyError`; other 3xx/4xx/5xx -> `WorkerHTTPError` carrying the server's own message
  (first line, <= 200 characters, API key scrubbed); a body that is not the JSON promised ->
  `MalformedResponseError`. Messages name the method, the path and the URL without user info.

Invariants: the API key is sent as `Authorization: Bearer` and nowhere else; redirects are
not followed; proxies come from the environment only if the user set them.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from prefixreg.core.errors import (
    EngineBusyError,
    MalformedResponseError,
    ReplyTooLargeError,
    UsageError,
    WorkerHTTPError,
    WorkerTimeoutError,
    WorkerUnreachableError,
)
from prefixreg.core.jsonio import JSONObject, JSONValue

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAX_SECONDS",
    "Deadline",
    "ReplyTooLargeError",
    "Transport",
    "check_max_bytes",
    "check_seconds",
    "display_url",
    "one_line",
]

DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024  # far above any real reply (a /health is ~5 KiB)
MAX_BYTES_LIMIT: Final = 1 << 40
MAX_SECONDS: Final = 86_400.0  # one day: a cold prefill takes minutes, never days
_MESSAGE_MAX: Final = 200
_CONNECT_EVENTS: Final = frozenset(
    {"connection.connect_tcp.complete", "connection.connect_unix_socket.complete"}
)


def check_seconds(name: str, value: object) -> float:
    """A timeout given at the boundary: a finite number of seconds in (0, `MAX_SECONDS`]."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    number = float(value) if ok else math.nan  # type: ignore[arg-type]
    if not (math.isfinite(number) and 0 < number <= MAX_SECONDS):
        raise UsageError(
            f"{name} must be a number of seconds above 0 and at most {MAX_SECONDS:g}, not {value!r}"
        )
    return number


def check_max_bytes(value: object) -> int:
    """A reply cap given at the boundary: an int of bytes, at least 1 KiB."""
    if type(value) is not int or not 1024 <= value <= MAX_BYTES_LIMIT:
        raise UsageError(f"max_bytes must be an integer from 1024 to 2**40, not {value!r}")
    return value


def display_url(url: str) -> str:
    """The URL without user info, query or fragment: safe to print."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def one_line(text: str, limit: int = _MESSAGE_MAX) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: the call is over anyway


class _ExpiredError(Exception):
    """Internal: the deadline passed between two pieces."""


class Deadline:
    """One call's deadline; a context manager that arms a timer for it.

    `trace` is an httpcore trace hook: it learns the call's socket at connect, and the timer
    shuts that socket down when the time is up, which wakes a read blocked on it.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._timer.cancel()
        with self._lock:
            self._sockets.clear()

    def remaining(self) -> float:
        return max(0.001, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.expired or time.monotonic() >= self.at

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        if event not in _CONNECT_EVENTS:
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._sockets.append(sock)
            late = self.expired
        if late:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


class _Call:
    """An open call: its response headers, and its body read under the deadline and cap."""

    def __init__(self, resp: httpx.Response, deadline: Deadline, max_bytes: int) -> None:
        self.resp = resp
        self.deadline = deadline
        self.max_bytes = max_bytes
        self.received = 0

    @property
    def status(self) -> int:
        return self.resp.status_code

    @property
    def content_type(self) -> str:
        return str(self.resp.headers.get("content-type", ""))

    def pieces(self, *, drop_ok: bool = False) -> Iterator[bytes]:
        """The body as it arrives; raises past the deadline or the cap.

        `drop_ok`: a connection dropped mid-body ends the body quietly (the caller judges an
        incomplete body, as for a stream); without it the drop raises as unreachable.
        """
        length = self.resp.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise ReplyTooLargeError("")
        body = self.resp.iter_bytes()
        while True:
            try:
                piece = next(body, None)
            except httpx.TimeoutException:
                raise
            except httpx.TransportError:
                if not drop_ok or self.deadline.passed():
                    raise
                piece = None
            if self.deadline.passed():
                raise _ExpiredError  # the timer's shutdown can read as a clean end of body
            if piece is None:
                return
            self.received += len(piece)
            if self.received > self.max_bytes:
                raise ReplyTooLargeError("")
            yield piece

    def read(self) -> bytes:
        return b"".join(self.pieces())


class Transport:
    """The HTTP side of a `Worker`: calls with deadlines, capped bodies, mapped errors."""

    def __init__(
        self,
        base: str,
        *,
        key: str | None,
        max_bytes: int,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = display_url(base)
        self.max_bytes = max_bytes
        self._key = key
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        # No keep-alive: each call connects anew, so its deadline knows its socket.
        self._client = httpx.Client(
            base_url=base,
            headers=headers,
            transport=transport,
            follow_redirects=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self._client.close()

    def where(self, method: str, path: str) -> str:
        return f"{method} {path} on {self.url}"

    def scrub(self, text: str) -> str:
        """Remove the API key from text we did not write (a server echoing a header)."""
        return text.replace(self._key, "***") if self._key else text

    @contextmanager
    def call(
        self,
        method: str,
        path: str,
        *,
        seconds: float,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Iterator[_Call]:
        """Open one call bounded by `seconds` in all; errors come out as the error tree."""
        where = self.where(method, path)
        with Deadline(seconds) as deadline:
            try:
                with self._client.stream(
                    method,
                    path,
                    content=content,
                    headers=headers,
                    timeout=httpx.Timeout(deadline.remaining()),
                    extensions={"trace": deadline.trace},
                ) as resp:
                    yield _Call(resp, deadline, self.max_bytes)
            except (httpx.TimeoutException, _ExpiredError):
                raise self._timeout(where, seconds) from None
            except ReplyTooLargeError:
                raise ReplyTooLargeError(
                    f"{where}: the reply is larger than the {_size(self.max_bytes)} cap",
                    url=self.url,
                    hint="a real reply is far smaller; raise max_bytes only if this one is real",
                ) from None
            except httpx.DecodingError:
                raise MalformedResponseError(
                    f"{where}: the reply body could not be decoded", url=self.url
                ) from None
            except httpx.TransportError as exc:
                if deadline.passed():
                    raise self._timeout(where, seconds) from None
                detail = one_line(self.scrub(str(exc))) or type(exc).__name__
                raise WorkerUnreachableError(
                    f"{where}: cannot reach the worker ({detail})",
                    url=self.url,
                    hint="is the worker running, and is the URL right?",
                ) from None

    def _timeout(self, where: str, seconds: float) -> WorkerTimeoutError:
        return WorkerTimeoutError(
            f"{where}: timed out (no complete reply within {seconds:g} s)",
            url=self.url,
            hint="raise the timeout, or check that the worker is not stuck",
        )

    def raise_for_status(self, method: str, path: str, call: _Call) -> None:
        """Raise the error tree for a non-2xx answer (reading its body under the cap)."""
        if call.status < 300:
            return
        where = self.where(method, path)
        if call.status < 400:
            raise WorkerHTTPError(
                f"{where}: HTTP {call.status}: redirect not followed",
                status_code=call.status,
                url=self.url,
                hint="give the worker's final URL",
            )
        raw = call.read()
        message, code = "", None
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict):
                raw_msg, raw_code = err.get("message"), err.get("code")
                message = raw_msg if isinstance(raw_msg, str) else ""
                code = raw_code if isinstance(raw_code, str) else None
            elif isinstance(err, str):
                message = err
            elif isinstance(body.get("detail"), str):
                message = body["detail"]
        elif raw:
            message = raw.decode("utf-8", "replace")
        # The reason phrase is the server's text too: scrub it like the body.
        text = one_line(self.scrub(message or call.resp.reason_phrase or "")) or "no message"
        full = f"{where}: HTTP {call.status}: {text}"
        if call.status == 503 and code == "engine_busy":
            raise EngineBusyError(
                full,
                status_code=503,
                code=code,
                url=self.url,
                hint="the worker serves one request at a time; retry when it is idle",
            )
        raise WorkerHTTPError(full, status_code=call.status, code=code, url=self.url)

    def json_object(self, method: str, path: str, raw: bytes, ctype: str) -> JSONObject:
        """`raw` as a JSON object, or `MalformedResponseError`."""
        try:
            body: JSONValue = orjson.loads(raw)
        except orjson.JSONDecodeError:
            shown = one_line(ctype or "no content type", 60)
            raise MalformedResponseError(
                f"{self.where(method, path)}: the reply is not JSON ({shown})", url=self.url
            ) from None
        if not isinstance(body, dict):
            raise MalformedResponseError(
                f"{self.where(method, path)}: the reply is not a JSON object", url=self.url
            )
        return body

    def get(
        self, path: str, *, seconds: float, missing: frozenset[int]
    ) -> tuple[bytes, str] | None:
        """GET `path`: (body, content type), or None when its status is in `missing`."""
        with self.call("GET", path, seconds=seconds) as call:
            if call.status in missing:
                return None
            self.raise_for_status("GET", path, call)
            return call.read(), call.content_type

    def get_json(self, path: str, *, seconds: float, missing: frozenset[int]) -> JSONObject | None:
        """GET `path` as a JSON object; None if its status is `missing`."""
        got = self.get(path, seconds=seconds, missing=missing)
        return None if got is None else self.json_object("GET", path, *got)


def _size(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)} MiB"
    return f"{n:,}-byte"
