"""The simulator's HTTP server: Halogen's routes on a stdlib `ThreadingHTTPServer`, one thread
per connection, a listen backlog of 1,024 (connects never wait for SYN retransmits). A completion,
as on the real server: authenticate, validate (400s before queueing), wait for a slot (503
``engine_busy`` after ``queue_timeout``), look up (memory, then the disk tier when that resumes
more), sleep the modelled prefill, store the snapshots (so of identical cold requests at once
none is served from a snapshot), sleep the decode; every duration divided by ``speed``. A
stream sends headers once it holds a slot, ``: keepalive`` lines while the prefill outlasts the
keepalive interval, then the frames. ``/health`` (no key), ``/cache`` and ``/metrics`` never
wait for a slot. Every request line received is logged (`requests`). With `config.engine` the
GET routes and the `Server` header are that engine's (`sim.engines`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from prefixreg.core.errors import UsageError
from prefixreg.sim import engines, protocol
from prefixreg.sim.config import SimConfig
from prefixreg.sim.engine import Engine
from prefixreg.sim.protocol import ApiError, Kind, Result, parse_request

_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux only
MAX_BODY = 64 * 1024 * 1024
_POST_ROUTES: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_GET_ROUTES: dict[str, Callable[[Engine], Any]] = {
    "/health": Engine.health,
    "/cache": Engine.cache_body,
    "/metrics": Engine.metrics,
    "/v1/models": Engine.models,
}


class LoggedRequest(NamedTuple):
    """One request line the server received (logged before any check)."""

    method: str
    path: str


class _HTTPServer(ThreadingHTTPServer):
    # socketserver's default backlog is 5: a burst of connects beyond it waits ~1 s for a SYN
    # retransmit, which would swamp the modelled times of concurrent calls; and with SYN
    # cookies on, a connection completed past a full queue is reset after its request was
    # sent. 1,024 holds a thousand streams opened at once (a benchmark's load).
    request_queue_size = 1024
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a reset while idle, say after a 404) is no error; else print."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; without TCP_NODELAY the client's delayed
    # ACK adds ~40 ms to every reply and would swamp the modelled resume times.
    disable_nagle_algorithm = True
    server_version = "prefixreg-sim"
    sim: SimServer  # set on the per-server subclass

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the stdlib access log; `SimServer(log=...)` gets one line per call."""

    def version_string(self) -> str:
        """The `Server` header: ours, uvicorn's (vLLM, SGLang, TensorRT-LLM) or none (Ollama)."""
        engine = self.sim.config.engine
        if engine is None:
            return super().version_string()
        return "uvicorn" if engine in engines.UVICORN else ""

    def send_header(self, keyword: str, value: str) -> None:
        if keyword != "Server" or value:
            super().send_header(keyword, value)

    def _send(self, status: int, body: Any) -> None:
        """Send `body`: JSON, or text (`/metrics`); None starts a stream, ended by the close."""
        self.send_response(status)
        if body is None:
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            return
        text = isinstance(body, str)
        data = body.encode() if text else json.dumps(body, separators=(",", ":")).encode()
        kind = "text/plain; version=0.0.4" if text else "application/json"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        key = self.sim.config.api_key
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        ok = not key or hmac.compare_digest(given.strip().encode(), key.encode())
        return not key or (scheme.lower() == "bearer" and ok)

    def _read_body(self) -> bytes:
        # A client that writes headers and body separately (httpx does) holds the body back
        # (Nagle) until the headers are acknowledged, and a delayed ACK holds that for ~40 ms
        # or more: acknowledge now, so the wait never adds to the modelled times.
        if _QUICKACK is not None:
            with contextlib.suppress(OSError):
                self.connection.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise ApiError(411, "a Content-Length header is required")
        try:
            length = int(length_header)
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
        if length < 0 or length > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY} bytes")
        return self.rfile.read(length)

    def _route(self, method: str) -> str:
        with self.sim._requests_lock:
            self.sim._requests.append(LoggedRequest(method, self.path))
        return self.path.split("?", 1)[0]

    def do_GET(self) -> None:
        path, config, engine = self._route("GET"), self.sim.config, self.sim._engine
        try:
            if config.engine is not None:  # the engine's routes; `/` and `/health` are open
                known, open_paths = path in engines.GET_ROUTES[config.engine], {"/health", "/"}
            else:  # dense exports no metrics
                known = path in _GET_ROUTES and (path != "/metrics" or config.flash)
                open_paths = {"/health"}
            if not (known or path == "/v1/models"):
                if path in _POST_ROUTES:
                    use = f"use POST for {path}" if config.engine is None else f"no route {path}"
                    raise ApiError(405, use)
                raise ApiError(404, f"no route {path}")
            if path not in open_paths and not self._authorized():
                raise ApiError(401, "invalid or missing API key")
            body = engine.engine_get(path) if config.engine else _GET_ROUTES[path](engine)
            self._send(200, body)
        except ApiError as err:
            self._send(err.status, err.body())

    def do_POST(self) -> None:
        path, engine, config = self._route("POST"), self.sim._engine, self.sim.config
        native = protocol.NATIVE.get((str(config.engine), path))  # the engine's own route
        kind = native or _POST_ROUTES.get(path)
        try:
            if kind is None or not self._authorized():
                try:  # drain the body so a keep-alive connection stays in sync
                    self._read_body()
                except ApiError:
                    self.close_connection = True
                if kind is None:
                    raise ApiError(405 if path in _GET_ROUTES else 404, f"no POST route {path}")
                raise ApiError(401, "invalid or missing API key")
            raw = self._read_body()
            if native is not None:  # read into the shared request
                raw = protocol.native_request(str(config.engine), raw)
            t0 = time.monotonic()
            call = parse_request(raw, kind, config)
            work = time.monotonic() - t0  # tokenizing and the lookup count against the prefill
            with engine.slot(call):  # its 503 is the last error: nothing was sent before it
                started = time.monotonic()
                result = Result(config, call, engine.lookup(call))
                if call.stream:  # headers once a slot is held, then keepalives while prefilling
                    self._send(200, None)
                if not self._run(result, result.prompt_s - work - (time.monotonic() - started)):
                    self.close_connection = True
                    return
                if not call.stream:
                    body = result.response_body()
                    self._send(200, body if native is None else protocol.native_reply(result))
                self.sim._log_call(result, time.monotonic() - started)
        except ApiError as err:
            self._send(err.status, err.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; nothing to answer

    def _run(self, result: Result, prefill_s: float) -> bool:
        """Prefill (keepalives), store, decode (pieces paced to a deadline so sleeps do not drift);
        False if the server stopped meanwhile."""
        engine, config, call = self.sim._engine, self.sim.config, result.call
        interval = config.keepalive / config.speed if call.stream else 0.0
        while prefill_s > 0:
            step = min(prefill_s, interval) if interval > 0 else prefill_s
            if not engine.sleep(step):
                return False
            prefill_s -= step
            if prefill_s > 0:
                self.wfile.write(b": keepalive\n\n")
        engine.store(call)
        if not call.stream:
            return engine.sleep(result.decode_s)
        t0, per_piece = time.monotonic(), result.decode_s / len(result.pieces)
        for i, piece in enumerate(result.pieces):
            if not engine.sleep(t0 + (i + 1) * per_piece - time.monotonic()):
                return False
            self.wfile.write(protocol.sse(result.reply(None, piece, chunk=True)))
        self.wfile.write(result.final_frames())
        return True


class SimServer:
    """A simulator bound at construction (`url` is valid at once); `start` serves from a daemon
    thread, `stop` ends it (or use it as a context manager); ``log`` gets a line per call."""

    def __init__(
        self, config: SimConfig | None = None, *, log: Callable[[str], None] | None = None
    ) -> None:
        self.config = config if config is not None else SimConfig()
        self._log = log
        self._engine = Engine(self.config)
        self._requests: list[LoggedRequest] = []
        self._requests_lock = threading.Lock()
        handler = type("SimHandler", (_Handler,), {"sim": self})
        self._httpd = _HTTPServer((self.config.host, self.config.port), handler)
        self._thread: threading.Thread | None = None
        self.host, self.port = str(self._httpd.server_address[0]), self._httpd.server_address[1]
        self.url = f"http://{self.host}:{self.port}"  # the server is IPv4 (AF_INET) only

    @classmethod
    def listening(cls, config: SimConfig, *, log: Callable[[str], None] | None = None) -> SimServer:
        """A `SimServer` bound to `config`'s address; one taken or not ours is a bad argument
        (`UsageError` naming it), not a crash."""
        try:
            return cls(config, log=log)
        except OSError as exc:
            where = f"{config.host}:{config.port}"
            raise UsageError(f"cannot listen on {where}: {exc.strerror or exc}") from None

    def serve_forever(self, *, say: Callable[[str], None] | None = None) -> None:
        """Serve in the foreground until Ctrl-C (``say`` gets ``stopping``), then stop."""
        try:
            self.start()
            forever = threading.Event()
            # Until Ctrl-C, waking each second: the kernel may hand SIGINT to a serving
            # thread, and Python runs its handler only when the main thread next runs.
            while not forever.wait(1.0):
                pass
        except KeyboardInterrupt:
            if say is not None:
                say("stopping")
        finally:
            self.stop()

    def start(self) -> SimServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake sleeping requests so they end, close the socket."""
        self._engine.stopping.set()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def requests(self) -> list[LoggedRequest]:
        """Every request line received so far, oldest first (a copy)."""
        with self._requests_lock:
            return list(self._requests)

    def _log_call(self, result: Result, wall_s: float) -> None:
        if self._log is not None:  # the shape of Halogen's request log line
            cached = f" ({result.cached} cached)" if result.cached else ""
            self._log(
                f"sim: {result.call.kind} {len(result.pieces)} tok in {wall_s:.2f}s | "
                f"prompt {result.call.prompt.n}{cached}, prefill {result.prompt_s:.2f}s"
            )
