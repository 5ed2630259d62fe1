"""A scriptable loopback HTTP server for tests that need a real socket.

API (small on purpose; other tests reuse it):

    with FakeServer() as srv:                       # 127.0.0.1, a free port, daemon thread
        srv.route("GET", "/health", Reply(json={"status": "ok"}))
        srv.route("POST", "/v1/chat/completions", Reply(sse=sse_frames([...])), Reply(status=503))
        ...use srv.url...
        srv.requests                                # every request, in order: Request records

`route(method, path, *replies)` scripts a route: replies are served in order and the last one
repeats; a callable `(Request) -> Reply` may be given instead. An unscripted route answers 404
with an OpenAI-style error envelope. `Reply` can send JSON, raw bytes, or SSE pieces (flushed one
by one, `piece_delay` apart), wait `delay` seconds first, announce more bytes than it sends
(`truncate_at`: the client sees the connection drop mid-body) or hang up without answering
(`hangup`). A hostile server is scripted too: `generate` yields a body lazily (a 1 GB reply
without holding 1 GB), `length` announces a Content-Length of its own, `trickle` sends the body
one byte every `trickle` seconds, and `trickle_head` does the same to the status line and
headers. Handler errors (a client that went away) are swallowed, never raised in a thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["FakeServer", "Reply", "Request", "sse_frames"]


@dataclass(frozen=True)
class Request:
    """One request as received: header names are lower case; `json` is None if not JSON."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any


@dataclass(frozen=True)
class Reply:
    """One scripted reply. `body` wins over `sse`, which wins over `json`."""

    status: int = 200
    json: Any = None
    body: bytes | None = None
    sse: Sequence[bytes | str] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str | None = None
    delay: float = 0.0
    piece_delay: float = 0.0
    truncate_at: int | None = None
    hangup: bool = False
    generate: Callable[[], Iterable[bytes]] | None = None
    length: int | None = None
    trickle: float = 0.0
    trickle_head: bool = False


Script = Callable[[Request], Reply]


def sse_frames(frames: Sequence[object], *, done: bool = True) -> list[bytes]:
    """SSE pieces for `frames`: each dict becomes `data: <json>\\n\\n`, a str or bytes is sent
    as is (use it for `: keepalive\\n\\n` or a broken line); `done` appends `data: [DONE]`."""
    out: list[bytes] = []
    for frame in frames:
        if isinstance(frame, bytes):
            out.append(frame)
        elif isinstance(frame, str):
            out.append(frame.encode("utf-8"))
        else:
            out.append(b"data: " + json.dumps(frame).encode("utf-8") + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


class _Scripted:
    def __init__(self, replies: Sequence[Reply] | Script) -> None:
        self._replies = replies
        self._next = 0
        self._lock = threading.Lock()

    def reply(self, request: Request) -> Reply:
        if callable(self._replies):
            return self._replies(request)
        with self._lock:
            index = min(self._next, len(self._replies) - 1)
            self._next += 1
        return self._replies[index]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up is not a test failure; stay quiet."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """No access log on stderr."""

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:  # a GET route's headers (its length too), never its body
        self._serve()

    def _serve(self) -> None:
        fake = self.server.fake
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        try:
            parsed: Any = json.loads(body) if body else None
        except (ValueError, RecursionError):  # deeper than Python reads: not parsed
            parsed = None
        path = self.path.split("?", 1)[0]
        request = Request(
            method=self.command,
            path=path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
            json=parsed,
        )
        fake.requests.append(request)
        script = fake.routes.get((self.command, path))
        if script is None:
            reply = Reply(status=404, json={"error": {"message": f"no route {path}", "code": None}})
        else:
            reply = script.reply(request)
        try:
            self._send(reply)
        except OSError:
            self.close_connection = True

    def _send(self, reply: Reply) -> None:
        stop = self.server.fake.stopping
        if reply.delay and stop.wait(reply.delay):
            return
        if reply.hangup:
            self.close_connection = True
            return
        if reply.generate is not None or reply.trickle or reply.trickle_head:
            self._send_hostile(reply)
            return
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if reply.body is None and reply.sse is not None:
            self.send_header("Content-Type", reply.content_type or "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()  # no length: the body ends when the connection closes
            for piece in reply.sse:
                self.wfile.write(piece if isinstance(piece, bytes) else piece.encode("utf-8"))
                self.wfile.flush()
                if reply.piece_delay and stop.wait(reply.piece_delay):
                    return
            return
        if reply.body is not None:
            data = reply.body
            ctype = reply.content_type or "application/octet-stream"
        else:
            data = json.dumps(reply.json).encode("utf-8")
            ctype = reply.content_type or "application/json"
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if reply.truncate_at is not None:
            data = data[: reply.truncate_at]
            self.close_connection = True
        if self.command == "HEAD":
            data = b""
        self.wfile.write(data)
        self.wfile.flush()

    def _send_hostile(self, reply: Reply) -> None:
        """Write the reply by hand: lazily generated, and/or a byte at a time."""
        stop = self.server.fake.stopping
        self.close_connection = True
        if reply.generate is not None:
            pieces: Iterable[bytes] = reply.generate()
            ctype = reply.content_type or "application/octet-stream"
        elif reply.sse is not None:
            pieces = [p if isinstance(p, bytes) else p.encode("utf-8") for p in reply.sse]
            ctype = reply.content_type or "text/event-stream"
        else:
            data = reply.body if reply.body is not None else json.dumps(reply.json).encode()
            pieces = [data]
            ctype = reply.content_type or "application/json"
        head = [f"HTTP/1.0 {reply.status} OK", f"Content-Type: {ctype}"]
        head += [f"{k}: {v}" for k, v in reply.headers.items()]
        if reply.length is not None:
            head.append(f"Content-Length: {reply.length}")
        raw_head = ("\r\n".join(head) + "\r\n\r\n").encode()

        def write(data: bytes, slow: bool) -> bool:
            if not slow:
                self.wfile.write(data)
                self.wfile.flush()
                return True
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                if stop.wait(reply.trickle or 0.2):
                    return False
            return True

        if not write(raw_head, reply.trickle_head):
            return
        for piece in pieces:
            if not write(piece, bool(reply.trickle)) or stop.is_set():
                return


class FakeServer:
    """A loopback HTTP server with scripted routes; a context manager (see module docstring)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.routes: dict[tuple[str, str], _Scripted] = {}
        self.stopping = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.fake = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def route(self, method: str, path: str, *replies: Reply | Script) -> None:
        """Script `method path`: replies in order (the last repeats), or one callable."""
        if len(replies) == 1 and callable(replies[0]):
            self.routes[(method, path)] = _Scripted(replies[0])
            return
        plain = [r for r in replies if isinstance(r, Reply)]
        if not plain or len(plain) != len(replies):
            raise ValueError("route needs Reply objects or a single callable")
        self.routes[(method, path)] = _Scripted(plain)

    def paths(self) -> list[str]:
        """The paths requested so far, in order."""
        return [r.path for r in self.requests]

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def lazy(total: int, piece: bytes = b"x" * 65536) -> Callable[[], Iterable[bytes]]:
    """A body of `total` bytes made on the fly: the server never holds it."""

    def generate() -> Iterator[bytes]:
        sent = 0
        while sent < total:
            yield piece
            sent += len(piece)

    return generate


def sse_flood(total: int) -> Callable[[], Iterable[bytes]]:
    """An endless-looking stream of valid content frames, `total` bytes in all."""
    frame = {"choices": [{"index": 0, "delta": {"content": "y" * 900}, "finish_reason": None}]}
    one = b"data: " + json.dumps(frame).encode() + b"\n\n"
    return lazy(total, one * 64)
