"""The simulator's HTTP server: Halogen's routes on a stdlib `ThreadingHTTPServer`.

Routes: ``GET /health``, ``GET /cache``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``. One thread per connection; a semaphore of ``slots`` is the engine.

Order of work for a completion, as on the real server: authenticate, validate (400s happen
before queueing), wait for a slot (503 ``engine_busy`` after ``queue_timeout``), run the prompt
through the cache (lookup, lagged counters, stores), sleep the modelled prefill
(``uncached / prefill_tps``) and decode (``completion / decode_tps``), both divided by
``speed``. Streams send their headers once a slot is held, then ``: keepalive`` comment lines
while the prefill is longer than the keepalive interval, then the frames.

``/health`` and ``/cache`` never wait for a slot. ``SimServer`` keeps a thread-safe log of every
request line received (method, path), so a test can assert that no chat request arrived.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, NamedTuple

from prefixreg.sim import protocol
from prefixreg.sim.cache import CacheModel, Counters, PromptCache
from prefixreg.sim.config import SimConfig
from prefixreg.sim.protocol import ApiError, Call, Result
from prefixreg.sim.tokenizer import TEMPLATE_SHA256, answer_tokens

__all__ = ["API_VERSION", "LoggedRequest", "SimServer"]

API_VERSION = "0.7.0"  # the Flash release the defaults were measured on
MAX_BODY = 64 * 1024 * 1024
_POST_ROUTES: dict[str, protocol.Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
}
_GET_ROUTES = ("/health", "/cache", "/v1/models")


class LoggedRequest(NamedTuple):
    """One request line the server received (logged before any check)."""

    method: str
    path: str


@dataclass
class _Engine:
    """Slots, queue and the cache, shared by the handler threads."""

    config: SimConfig
    cache: PromptCache
    slots: threading.BoundedSemaphore
    lock: threading.Lock = field(default_factory=threading.Lock)
    holds: dict[int, float] = field(default_factory=dict)  # request serial -> monotonic start
    queued: int = 0
    serial: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)

    def acquire(self) -> int:
        """Wait for a slot; `ApiError` 503 `engine_busy` after the (scaled) queue timeout."""
        with self.lock:
            self.queued += 1
        try:
            got = self.slots.acquire(timeout=self.config.scaled(self.config.queue_timeout))
        finally:
            with self.lock:
                self.queued -= 1
        if not got:
            raise ApiError(
                503,
                "timed out waiting for the engine — halogen serves "
                f"{self.config.slots} request(s) at a time and the queue did not clear",
                code="engine_busy",
            )
        with self.lock:
            self.serial += 1
            self.holds[self.serial] = time.monotonic()
            return self.serial

    def release(self, serial: int) -> None:
        with self.lock:
            self.holds.pop(serial, None)
        self.slots.release()

    def admit(self, call: Call) -> int:
        with self.lock:
            return self.cache.admit(call.prompt).cached

    def counters(self) -> Counters:
        with self.lock:
            return self.cache.counters()

    def load(self) -> dict[str, Any]:
        with self.lock:
            in_flight = len(self.holds)
            oldest = min(self.holds.values(), default=None)
            queued = self.queued
        return {
            "busy": in_flight >= self.config.slots,
            "slots": self.config.slots,
            "slot_ctx": self.config.slot_ctx,
            "in_flight": in_flight,
            "busy_for_s": round(time.monotonic() - oldest, 3) if oldest is not None else 0.0,
            "queued": queued,
        }

    def sleep(self, seconds: float) -> bool:
        """Sleep unless the server is stopping; False means stop now."""
        return not self.stopping.wait(seconds) if seconds > 0 else not self.stopping.is_set()


def _health(config: SimConfig, engine: _Engine) -> dict[str, Any]:
    enabled = config.max_entries > 0
    endpoints = sorted(["/v1/chat/completions", "/v1/completions", "/v1/models"])
    common_tail: dict[str, Any] = {
        "supported": [
            "model",
            "messages",
            "prompt",
            *protocol.TOKEN_BUDGET_ALIASES,
            "stream",
            "stream_options",
            "stop",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
        ],
        "token_budget_aliases": list(protocol.TOKEN_BUDGET_ALIASES),
        "max_tokens_default": protocol.MAX_TOKENS_DEFAULT["chat"],
        "error_format": "openai",
        "accepted_but_ignored": ["n"],
        "max_tokens_cap": config.max_tokens_cap,
        "max_tokens_over_cap": "400",
        "simulator": {"name": "prefixreg.sim", "profile": config.profile, "speed": config.speed},
    }
    if config.profile == "dense":
        prompt_cache: dict[str, Any] = {
            "enabled": enabled,
            "cap_mb": config.max_entries * config.entry_bytes // 2**20,
            "snapshot_align": config.snapshot_align,
            "bitwise_identical_to_cold": config.snapshot_align == 2048,
        }
        return {
            "status": "ok",
            "model": config.model_id,
            "endpoints": endpoints,
            "context": config.slot_ctx,
            **engine.load(),
            "decode": "greedy",
            "prompt_cache": prompt_cache,
            **common_tail,
        }
    prompt_cache = {
        "enabled": enabled,
        # Flash's cap_mb is one entry's size in MiB (116389652 B -> 110), not a budget.
        "cap_mb": config.entry_bytes // 2**20,
        "mode": 2 if enabled else 0,
        "snapshot_align": config.snapshot_align,
        "bitwise_identical_to_cold": False,
    }
    return {
        "status": "ok",
        "model": config.model_id,
        "endpoints": endpoints,
        "cache_counters": "/cache",
        "context": config.slot_ctx,
        "version": {"api": API_VERSION, "engine": API_VERSION, "match": True},
        "chat_template": {"path": None, "sha256": TEMPLATE_SHA256},
        **engine.load(),
        "decode": "greedy",
        "prompt_cache": prompt_cache,
        **common_tail,
    }


def _cache_body(config: SimConfig, c: Counters) -> dict[str, Any]:
    timing = {
        "store_ms_total": c.store_ms_total,
        "restore_ms_total": c.restore_ms_total,
        "last_store_ms": c.last_store_ms,
        "last_restore_ms": c.last_restore_ms,
    }
    if config.profile == "dense":
        cap = config.max_entries * config.entry_bytes
        return {
            "entries": c.entries,
            "bytes": c.bytes,
            "reserved_bytes": c.bytes,
            "cap_bytes": cap,
            "hits": c.hits,
            "misses": c.misses,
            "stores": c.stores,
            "evicted": c.evicted,
            "prompt_tokens_saved": c.prompt_tokens_saved,
            **timing,
            "refused": c.refused,
            "hit_rate": c.hit_rate,
        }
    return {
        "entries": c.entries,
        "max_entries": config.max_entries,
        "bytes": c.bytes,
        "last_entry_bytes": c.last_entry_bytes,
        "hits": c.hits,
        "misses": c.misses,
        "stores": c.stores,
        "evicted": c.evicted,
        "refused": c.refused,
        "prompt_tokens_saved": c.prompt_tokens_saved,
        **timing,
        "rows_copied": 0,
        "rows_copied_ms": 0.0,
        "hit_rate": c.hit_rate,
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; without TCP_NODELAY the client's delayed
    # ACK adds ~40 ms to every reply and would swamp the modelled resume times.
    disable_nagle_algorithm = True
    server_version = "prefixreg-sim"
    sim: SimServer  # set on the per-server subclass

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the stdlib access log; `SimServer(log=...)` gets one line per call."""

    # -- plumbing -------------------------------------------------------------------------

    def _send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        self._send_json(err.status, protocol.error_body(err.status, err.message, err.code))

    def _authorized(self) -> bool:
        key = self.sim.config.api_key
        if not key:
            return True
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        ok = hmac.compare_digest(given.strip().encode(), key.encode())
        return scheme.lower() == "bearer" and ok

    def _read_body(self) -> bytes:
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

    def _route(self) -> str:
        return self.path.split("?", 1)[0]

    # -- methods --------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self._route()
        self.sim._log_request("GET", self.path)
        try:
            if path == "/health":
                # Liveness stays open without a key, and never waits for a slot.
                self._send_json(200, _health(self.sim.config, self.sim._engine))
                return
            if path in _GET_ROUTES and not self._authorized():
                raise ApiError(401, "invalid or missing API key")
            if path == "/cache":
                self._send_json(200, _cache_body(self.sim.config, self.sim._engine.counters()))
            elif path == "/v1/models":
                model = {
                    "id": self.sim.config.model_id,
                    "object": "model",
                    "created": self.sim.started,
                    "owned_by": "prefixreg-sim",
                }
                self._send_json(200, {"object": "list", "data": [model]})
            elif path in _POST_ROUTES:
                raise ApiError(405, f"use POST for {path}")
            else:
                raise ApiError(404, f"no route {path}")
        except ApiError as err:
            self._send_error(err)

    def do_POST(self) -> None:
        path = self._route()
        self.sim._log_request("POST", self.path)
        try:
            kind = _POST_ROUTES.get(path)
            if kind is None:
                self._read_body_quietly()
                raise ApiError(405 if path in _GET_ROUTES else 404, f"no POST route {path}")
            if not self._authorized():
                self._read_body_quietly()
                raise ApiError(401, "invalid or missing API key")
            call = protocol.parse_request(self._read_body(), kind, self.sim.config)
        except ApiError as err:
            self._send_error(err)
            return
        self._complete(call)

    def _read_body_quietly(self) -> None:
        # Drain the body so a keep-alive connection stays in sync for the next request.
        try:
            self._read_body()
        except ApiError:
            self.close_connection = True

    # -- the engine -----------------------------------------------------------------------

    def _complete(self, call: Call) -> None:
        engine, config = self.sim._engine, self.sim.config
        try:
            serial = engine.acquire()
        except ApiError as err:
            self._send_error(err)
            return
        started = time.monotonic()
        try:
            cached = engine.admit(call)
            answer = answer_tokens(call.prompt, config.answer_tokens)
            pieces = tuple(answer[: call.max_tokens])
            result = Result(
                call=call,
                id=("chatcmpl-" if call.kind == "chat" else "cmpl-") + secrets.token_hex(12),
                created=int(time.time()),
                model=config.model_id,
                pieces=pieces,
                finish_reason="stop" if len(pieces) == len(answer) else "length",
                cached=cached,
                prompt_s=config.scaled((call.prompt.n - cached) / config.prefill_tps),
                decode_s=config.scaled(len(pieces) / config.decode_tps),
            )
            if call.stream:
                self._stream(result)
            else:
                if not engine.sleep(result.prompt_s + result.decode_s):
                    self.close_connection = True
                    return
                self._send_json(200, protocol.response_body(result, with_timings=config.timings))
            self.sim._log_call(result, time.monotonic() - started)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; nothing to answer
        finally:
            engine.release(serial)

    def _stream(self, result: Result) -> None:
        engine, config = self.sim._engine, self.sim.config
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the body ends when the connection does
        self.end_headers()
        self.close_connection = True
        self.wfile.flush()
        # Prefill, with a keepalive comment after each interval of silence.
        interval = config.scaled(config.keepalive)
        remaining = result.prompt_s
        while remaining > 0:
            step = min(remaining, interval) if interval > 0 else remaining
            if not engine.sleep(step):
                return
            remaining -= step
            if remaining > 0:
                self.wfile.write(protocol.KEEPALIVE)
                self.wfile.flush()
        # Decode: pace pieces against a deadline so sleeps do not drift.
        t0 = time.monotonic()
        per_piece = result.decode_s / len(result.pieces) if result.pieces else 0.0
        for i, piece in enumerate(result.pieces):
            if not engine.sleep(t0 + (i + 1) * per_piece - time.monotonic()):
                return
            self.wfile.write(protocol.sse(protocol.content_frame(result, piece)))
            self.wfile.flush()
        for frame in protocol.final_frames(result, with_timings=config.timings):
            self.wfile.write(protocol.sse(frame))
        self.wfile.write(protocol.sse("[DONE]"))
        self.wfile.flush()


class SimServer:
    """A running simulator. Use as a context manager, or `start()` / `stop()`.

    ``SimServer(SimConfig(speed=1000))`` binds ``config.host:config.port`` (127.0.0.1 and an
    ephemeral port by default) on `start`, serves from a daemon thread, and exposes ``url``.
    ``log`` receives one human-readable line per completed call (the CLI prints them).
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config if config is not None else SimConfig()
        self._log = log
        cache_model = CacheModel(
            max_entries=self.config.max_entries,
            entries_per_request=self.config.entries_per_request,
            align=self.config.snapshot_align,
            partial_resume=self.config.profile == "dense",
            counter_lag=self.config.counter_lag,
            entry_bytes=self.config.entry_bytes,
        )
        self._engine = _Engine(
            config=self.config,
            cache=PromptCache(cache_model),
            slots=threading.BoundedSemaphore(self.config.slots),
        )
        self._requests: list[LoggedRequest] = []
        self._requests_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.started = int(time.time())

    # -- lifecycle ------------------------------------------------------------------------

    def bind(self) -> SimServer:
        """Bind the listening socket (idempotent); `url` is valid afterwards."""
        if self._httpd is None:
            handler = type("SimHandler", (_Handler,), {"sim": self})
            httpd = ThreadingHTTPServer((self.config.host, self.config.port), handler)
            httpd.daemon_threads = True
            self._httpd = httpd
        return self

    def start(self) -> SimServer:
        """Bind and serve from a daemon thread."""
        httpd = self.bind()._require()
        if self._thread is None:
            self._thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="prefixreg-sim",
                daemon=True,
            )
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until `stop()` (from another thread) or Ctrl-C."""
        try:
            self.bind()._require().serve_forever(poll_interval=0.2)
        finally:
            self._engine.stopping.set()
            self._require().server_close()

    def stop(self) -> None:
        """Stop serving, wake sleeping requests so they end, close the socket."""
        self._engine.stopping.set()
        if self._httpd is None:
            return
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _require(self) -> ThreadingHTTPServer:
        if self._httpd is None:
            raise RuntimeError("the simulator is not bound; call start() first")
        return self._httpd

    # -- what tests look at ---------------------------------------------------------------

    @property
    def host(self) -> str:
        return str(self._require().server_address[0])

    @property
    def port(self) -> int:
        return int(self._require().server_address[1])

    @property
    def url(self) -> str:
        host = self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def requests(self) -> list[LoggedRequest]:
        """Every request line received so far, oldest first (a copy)."""
        with self._requests_lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._requests_lock:
            self._requests.clear()

    def _log_request(self, method: str, path: str) -> None:
        with self._requests_lock:
            self._requests.append(LoggedRequest(method, path))

    def _log_call(self, result: Result, wall_s: float) -> None:
        if self._log is None:
            return
        # The shape of Halogen's request log line; "(K cached)" only when K > 0.
        cached = f" ({result.cached} cached)" if result.cached else ""
        self._log(
            f"sim: {result.call.kind} {len(result.pieces)} tok in {wall_s:.2f}s | "
            f"prompt {result.call.prompt.n}{cached}, prefill {result.prompt_s:.2f}s"
        )
