"""HTTP for one worker: every call has a deadline and every reply a size cap.

What a hostile or broken server can do, and what stops it:
- Trickle (a byte a second) or go silent: one deadline bounds each call whole, connect to
  last byte, streams included. httpx's timeouts are per read, so a timer also shuts the
  call's socket (from httpcore's connect trace; no keep-alive: each call has its own) and
  the time left is checked between pieces: `WorkerTimeoutError` within a fraction of a second.
- Send more than any real reply: bodies are streamed and counted after content decoding;
  past `max_bytes`, or from a `Content-Length` over it, `ReplyTooLargeError`; an unbounded
  body is never read whole.
- Fail: refused -> `WorkerUnreachableError`; 503 `engine_busy` -> `EngineBusyError`; other
  3xx/4xx/5xx -> `WorkerHTTPError` with the server's own message (one line, <= 200
  characters, API key scrubbed); a body that is not the JSON promised (`core.jsonio`'s
  rules) -> `MalformedResponseError`. Messages name the method, path and URL (no user info).

Invariants: the URL is canonical (`server.urls`: one spelling per server); the API key is
sent as `Authorization: Bearer` and nowhere else; redirects are not followed; proxies come
from the environment only if the user set them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx

from prefixreg.core import errors
from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import loads
from prefixreg.server.urls import canonical_url

DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024  # far above any real reply (a /health is ~5 KiB)
MAX_SECONDS: Final = 86_400.0  # one day: a cold prefill takes minutes, never days
Body = TypeVar("Body", bytes, dict[str, Any], list[Any])


def shown(value: object) -> str:
    """A short, safe rendering of a bad argument for an error message."""
    if isinstance(value, str | float | None) or (isinstance(value, int) and abs(value) < 1 << 64):
        return repr(value)[:40]
    return f"a {type(value).__name__}"


def check_seconds(name: str, value: object) -> float:
    """A timeout given at the boundary: a finite number of seconds in (0, `MAX_SECONDS`]."""
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not 0 < number <= MAX_SECONDS:
        raise UsageError(f"{name} must be 0 < seconds <= {MAX_SECONDS:g}, not {shown(value)}")
    return float(number)


def check_max_bytes(value: object) -> int:
    """A reply cap given at the boundary: an int of bytes from 1 KiB to 1 TiB."""
    if type(value) is not int or not 1024 <= value <= 1 << 40:
        raise UsageError(f"max_bytes must be an integer from 1024 to 2**40, not {shown(value)}")
    return value


def display_url(url: str) -> str:
    """The URL without user info, query or fragment: safe to print (else `UsageError`)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except (TypeError, ValueError, AttributeError):
        raise UsageError("not a URL (http://host:port)") from None
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: the call is over anyway


class _ExpiredError(Exception):
    """The deadline passed between two pieces."""


class _Deadline:
    """One call's deadline: a timer shuts the call's socket (found by `trace`), waking its read."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def passed(self) -> bool:
        return self.expired or time.monotonic() >= self.at

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        connected = event.startswith("connection.connect_") and event.endswith(".complete")
        stream = info.get("return_value") if connected else None
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket):
            with self._lock:
                self._sockets.append(sock)
                if self.expired:
                    _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._sockets.clear()


class _Call:
    """An open call: its status and content type, and its body read under deadline and cap."""

    def __init__(self, resp: httpx.Response, deadline: _Deadline, max_bytes: int) -> None:
        self.resp, self.deadline, self.max_bytes = resp, deadline, max_bytes
        self.status = resp.status_code
        self.content_type = str(resp.headers.get("content-type", ""))

    def pieces(self, *, drop_ok: bool = False) -> Iterator[bytes]:
        """The body as it arrives; raises past the deadline or the cap. A connection dropped
        mid-body raises as unreachable, or with `drop_ok` ends the body (judged incomplete)."""
        length = self.resp.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > self.max_bytes:
            raise errors.ReplyTooLargeError("")
        received, body = 0, self.resp.iter_bytes()
        while True:
            try:
                piece = next(body, None)
            except httpx.TransportError as exc:
                if isinstance(exc, httpx.TimeoutException) or not drop_ok or self.deadline.passed():
                    raise
                piece = None
            if self.deadline.passed():
                raise _ExpiredError  # the timer's shutdown can read as a clean end of body
            if piece is None:
                return
            received += len(piece)
            if received > self.max_bytes:
                raise errors.ReplyTooLargeError("")
            yield piece

    def read(self) -> bytes:
        return b"".join(self.pieces())


class Transport:
    """A `Worker`'s HTTP: deadlines, capped bodies, mapped errors (`UsageError`: a bad URL)."""

    def __init__(self, url: str, *, key: str | None, max_bytes: object, transport: object) -> None:
        base = canonical_url(url, keep_userinfo=True)  # one spelling per server: `urls`
        self.url = display_url(base)
        self.max_bytes = check_max_bytes(max_bytes)
        self._key = key
        if transport is not None and not isinstance(transport, httpx.BaseTransport):
            raise UsageError(f"transport must be an httpx transport, not {shown(transport)}")
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        try:  # no keep-alive: each call connects anew, so its deadline knows its socket
            self._client = httpx.Client(
                base_url=base,
                headers=headers,
                transport=transport,
                follow_redirects=False,
                limits=httpx.Limits(max_keepalive_connections=0),
            )
        except httpx.InvalidURL:
            raise UsageError(f"not a worker URL (http://host:port): {self.url!r}") from None

    def close(self) -> None:
        self._client.close()

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
        missing: frozenset[int] = frozenset(),
    ) -> Iterator[_Call]:
        """Open one call bounded by `seconds` in all; errors, and a non-2xx status not in
        `missing`, come out as the error tree."""
        where = f"{method} {path} on {self.url}"
        deadline = _Deadline(seconds)
        timed_out = errors.WorkerTimeoutError(
            f"{where}: timed out (no complete reply within {seconds:g} s)",
            url=self.url,
            hint="raise the timeout, or check that the worker is not stuck",
        )
        try:
            with self._client.stream(
                method,
                path,
                content=content,
                headers=headers,
                timeout=httpx.Timeout(seconds),
                extensions={"trace": deadline.trace},
            ) as resp:
                call = _Call(resp, deadline, self.max_bytes)
                if call.status not in missing:
                    self._raise_for_status(where, call)
                yield call
        except (httpx.TimeoutException, _ExpiredError):
            raise timed_out from None
        except errors.ReplyTooLargeError:
            cap = self.max_bytes
            size = f"{cap >> 20} MiB" if cap % (1 << 20) == 0 else f"{cap:,}-byte"
            raise errors.ReplyTooLargeError(
                f"{where}: the reply is larger than the {size} cap",
                url=self.url,
                hint="a real reply is far smaller; raise max_bytes only if this one is real",
            ) from None
        except httpx.DecodingError:
            why = f"{where}: the reply body could not be decoded"
            raise errors.MalformedResponseError(why, url=self.url) from None
        except httpx.TransportError as exc:
            if deadline.passed():
                raise timed_out from None
            detail = one_line(self.scrub(str(exc))) or type(exc).__name__
            raise errors.WorkerUnreachableError(
                f"{where}: cannot reach the worker ({detail})",
                url=self.url,
                hint="is the worker running, and is the URL right?",
            ) from None
        finally:
            deadline.cancel()

    def _raise_for_status(self, where: str, call: _Call) -> None:
        """Raise the error tree for a non-2xx answer (its body read under the cap)."""
        status = call.status
        if status < 300:
            return
        if status < 400:
            raise errors.WorkerHTTPError(
                f"{where}: HTTP {status}: redirect not followed",
                status_code=status,
                url=self.url,
                hint="give the worker's final URL",
            )
        message, code = _error_message(call.read())
        # The reason phrase is the server's text too: scrub it like the body.
        text = one_line(self.scrub(message or call.resp.reason_phrase or "")) or "no message"
        full, busy = f"{where}: HTTP {status}: {text}", status == 503 and code == "engine_busy"
        kind = errors.EngineBusyError if busy else errors.WorkerHTTPError
        hint = "the worker serves one request at a time; retry when it is idle" if busy else None
        raise kind(full, status_code=status, code=code, url=self.url, hint=hint)

    def fetch(
        self,
        kind: type[Body],
        path: str,
        *,
        seconds: float,
        content: bytes | None = None,
        missing: frozenset[int] = frozenset(),
    ) -> Body | None:
        """One small call (POST of the JSON `content`, else GET): its body as `kind` (bytes, a
        JSON dict or list, else `MalformedResponseError`); None when its status is in `missing`."""
        method = "GET" if content is None else "POST"
        headers = None if content is None else {"Content-Type": "application/json"}
        with self.call(
            method, path, seconds=seconds, content=content, headers=headers, missing=missing
        ) as call:
            if call.status in missing:
                return None
            raw, ctype = call.read(), call.content_type
        value: object = raw
        if kind is not bytes:
            try:
                value = loads(raw)
            except errors.CorruptRecordError:
                value = None  # judged below, as any reply that is not JSON of `kind`
        if not isinstance(value, kind):
            what = {"dict": "object"}.get(kind.__name__, kind.__name__)
            raise errors.MalformedResponseError(
                f"{method} {path} on {self.url}: the reply is not a JSON {what} "
                f"({one_line(ctype or 'no content type', 60)})",
                url=self.url,
            )
        return value


def _error_message(raw: bytes) -> tuple[str, str | None]:
    """(message, code) of an error body: OpenAI's `error`, else `detail`, else its text."""
    try:
        body = loads(raw)
    except errors.CorruptRecordError:
        body = None
    if not isinstance(body, dict):
        return raw.decode("utf-8", "replace"), None
    err = body.get("error")
    if isinstance(err, dict):
        message, code = err.get("message"), err.get("code")
        return message if isinstance(message, str) else "", code if isinstance(code, str) else None
    text = err if isinstance(err, str) else body.get("detail")
    return text if isinstance(text, str) else "", None
