"""The gateway's HTTP face: Starlette routes, the byte-for-byte pass-through, and the proof
wired around it. uvicorn serves it (`gateway.serve`); nothing here parses HTTP by hand.

A proxied call (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`):
1. the client key, if one is set; the body, read up to `max_body_bytes` (else 413) and
   parsed as a JSON object (else 400), both in the API's own error shape; valid JSON
   orjson refuses (a lone surrogate escape, deep nesting) goes on unread: no head, its
   verdict unverified and why;
2. the door (`door.Door.admit`): head, session, drift, strips, route; a failure there is
   logged and the call goes on unchanged; only a refuse policy answers instead (400);
3. the call upstream under one deadline (`timeout_s`, connect to last byte);
4. a buffered reply (anything not `text/event-stream`, capped at `max_reply_bytes`) goes
   out whole with `x-prefixreg-*` proof headers; a stream goes out event by event as it
   arrives, its proof read after each piece is sent, and logged at its end.

Invariants:
- Not a byte of the worker's body is changed, added or dropped; proof lives in headers,
  the call log and `/metrics` only.
- A client that goes away cancels its upstream call (the reply's socket is closed): a
  stream's sender and a buffered call's reader both watch for `http.disconnect`.
- Memory per call is bounded: the request body by `max_body_bytes`, a buffered reply by
  `max_reply_bytes`, a stream by the piece in flight (the proof stops reading past the cap).
- Every other path is passed through as it is (no proof): `/v1/models`, `/health`,
  `/v1/messages/count_tokens`, ... `/metrics` and `/prefixreg/calls/{id}` are the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, TypeVar

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from prefixreg.gateway import apis
from prefixreg.gateway.apis import Api
from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.door import Door
from prefixreg.gateway.stream import DisconnectedError, Stream, StreamOut, unless_gone
from prefixreg.gateway.upstream import Router, make_client, request_headers, response_headers

log = logging.getLogger("prefixreg.gateway")
T = TypeVar("T")
_SSE: Final = b"text/event-stream"


class _TooLargeError(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused past `limit` bytes without holding more than that."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _TooLargeError
    parts: list[bytes] = []
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise _TooLargeError
        parts.append(piece)
    return b"".join(parts)


class Gateway:
    """One gateway: its config, upstream client, door and counters (`stats`)."""

    def __init__(self, config: GatewayConfig, door: Door | None = None) -> None:
        self.config = config
        self.router = Router(config)
        self.door = door if door is not None else Door(config, self.router)
        self.client: httpx.AsyncClient | None = None
        self.inflight = 0  # upstream calls open now (a disconnect must bring it back down)

    # -- lifecycle -------------------------------------------------------------------------
    async def startup(self) -> None:
        self.client = make_client(self.config)
        await asyncio.to_thread(self.door.start)  # reads the registry and the workers

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.door.stop)
        if self.client is not None:
            await self.client.aclose()

    def _closed(self) -> None:
        self.inflight -= 1

    # -- helpers -----------------------------------------------------------------------------
    def _error(self, api: Api | None, status: int, message: str, **headers: str) -> Response:
        return Response(
            apis.error_body(api, status, message),
            status,
            headers=headers,
            media_type="application/json",
        )

    def _client_ok(self, request: Request) -> bool:
        key = self.config.client_key
        if key is None:
            return True
        bearer = request.headers.get("authorization", "")
        sent = bearer[7:] if bearer[:7].lower() == "bearer " else request.headers.get("x-api-key")
        return sent is not None and _same(sent, key)

    def _upstream_headers(self, request: Request) -> list[tuple[bytes, bytes]]:
        return request_headers(
            request.scope["headers"],
            upstream_key=self.config.upstream_key,
            strip_auth=self.config.client_key is not None,
        )

    async def _open(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], content: bytes | None
    ) -> httpx.Response:
        assert self.client is not None  # noqa: S101 -- set by startup, before any request
        req = self.client.build_request(method, url, headers=headers, content=content)
        return await self.client.send(req, stream=True)

    # -- routes ------------------------------------------------------------------------------
    async def passthrough(self, request: Request) -> Response:
        """Any other path, as it is: buffered, capped, under the deadline; no proof."""
        if not self._client_ok(request):
            return self._error(None, 401, "the gateway's client key is missing or wrong")
        try:
            body = await _read_body(request, self.config.max_body_bytes)
        except _TooLargeError:
            return self._error(None, 413, "request body too large for the gateway")
        target = self.router.targets[0]
        url = target + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        work = self._buffered(request.method, url, self._upstream_headers(request), body or None)
        try:
            status, headers, data, length = await unless_gone(request.receive, work)
        except DisconnectedError:
            return Response(b"", 499)
        except _UpstreamError as exc:
            return self._error(None, exc.status, str(exc))
        if request.method == "HEAD":  # no body: the length is the worker's, as it said it
            return _raw(data, status, headers, head_length=length or "")
        return _raw(data, status, headers)

    async def _buffered(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], content: bytes | None
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, str | None]:
        """A whole reply: (status, headers, body, its content-length as the worker sent it),
        capped, under the call's deadline."""
        try:
            async with asyncio.timeout(self.config.timeout_s):
                self.inflight += 1
                resp = await self._open(method, url, headers, content)
                try:
                    data = await self._drain(resp)
                    length = resp.headers.get("content-length")
                    return resp.status_code, response_headers(resp.headers), data, length
                finally:
                    await resp.aclose()
        except TimeoutError:
            raise _UpstreamError(504, "the worker did not answer within the deadline") from None
        except httpx.HTTPError as exc:
            why = f"the worker could not be reached ({type(exc).__name__})"
            raise _UpstreamError(502, why) from None
        finally:
            self.inflight -= 1

    async def _drain(self, resp: httpx.Response) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for piece in resp.aiter_raw():
            size += len(piece)
            if size > self.config.max_reply_bytes:
                raise _UpstreamError(502, "the worker's reply is larger than the gateway's cap")
            parts.append(piece)
        return b"".join(parts)

    async def api_call(self, request: Request, api: Api) -> Response:
        started = time.perf_counter()
        if not self._client_ok(request):
            return self._error(api, 401, "the gateway's client key is missing or wrong")
        try:
            body = await _read_body(request, self.config.max_body_bytes)
        except _TooLargeError:
            return self._error(api, 413, "request body too large for the gateway")
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
            if not apis.json_orjson_refuses(body):
                return self._error(api, 400, "the request body is not JSON")
        if parsed is not None and not isinstance(parsed, dict):
            return self._error(api, 400, "the request body is not a JSON object")
        if parsed is None:  # valid JSON the fast parser refuses: the worker's to judge
            adm = self.door.admit_unread(api, body, "a JSON body the gateway does not read")
        else:
            adm = self.door.admit(api, parsed, body, request.headers)
        if adm.refuse is not None:
            return self._error(api, 400, adm.refuse, **adm.headers)
        url = adm.target + api.path + (f"?{request.url.query}" if request.url.query else "")
        headers = self._upstream_headers(request) + adm.upstream_headers
        if parsed is not None and parsed.get("stream") is True:
            # llama-server closes a connection after a streamed reply without saying so; a
            # call sent on it from the pool then finds it gone (a 502 for a healthy worker).
            # Asked to close, the worker's stream ends its connection and none is reused.
            headers.append((b"connection", b"close"))
        deadline = time.monotonic() + self.config.timeout_s
        self.inflight += 1  # from the request sent until the reply is closed, however it ends
        try:
            resp = await unless_gone(
                request.receive,
                self._timed(self._open("POST", url, headers, adm.content), deadline),
            )
        except DisconnectedError:
            self.inflight -= 1
            self.door.abandoned(adm, "client disconnected before the reply")
            return Response(b"", 499)
        except _UpstreamError as exc:
            self.inflight -= 1
            self.door.failed(adm, exc.status, str(exc))
            return self._error(api, exc.status, str(exc), **adm.headers)
        ctype = resp.headers.get("content-type", "").encode("latin-1").lower()
        if _SSE in ctype:
            stream = Stream(
                self.door, resp, adm, deadline=deadline, started=started, on_close=self._closed
            )
            return StreamOut(
                stream, resp.status_code, response_headers(resp.headers) + adm.raw_headers()
            )
        try:
            data = await unless_gone(request.receive, self._timed(self._drain(resp), deadline))
        except DisconnectedError:
            self.door.abandoned(adm, "client disconnected before the reply")
            return Response(b"", 499)
        except _UpstreamError as exc:
            self.door.failed(adm, exc.status, str(exc))
            return self._error(api, exc.status, str(exc), **adm.headers)
        finally:
            await resp.aclose()
            self.inflight -= 1
        proof = self.door.settle(
            adm, resp.status_code, data, streamed=False, added_s=time.perf_counter() - started
        )
        return _raw(data, resp.status_code, response_headers(resp.headers) + proof)

    async def _timed(self, work: Awaitable[T], deadline: float) -> T:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await work
        except TimeoutError:
            raise _UpstreamError(504, "the worker did not answer within the deadline") from None
        except httpx.HTTPError as exc:
            why = f"the worker could not be reached ({type(exc).__name__})"
            raise _UpstreamError(502, why) from None

    # -- the gateway's own routes ------------------------------------------------------------
    async def metrics(self, request: Request) -> Response:
        if not self._client_ok(request):
            return self._error(None, 401, "the gateway's client key is missing or wrong")
        text = self.door.metrics_text(inflight=self.inflight)
        return Response(text, 200, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def call(self, request: Request) -> Response:
        if not self._client_ok(request):
            return self._error(None, 401, "the gateway's client key is missing or wrong")
        record = self.door.call_record(request.path_params["call_id"])
        if record is None:
            return self._error(None, 404, "no such call (ids are kept for the latest calls)")
        return Response(orjson.dumps(record), 200, media_type="application/json")

    async def heads(self, request: Request) -> Response:
        if not self._client_ok(request):
            return self._error(None, 401, "the gateway's client key is missing or wrong")
        return Response(orjson.dumps(self.door.heads_view()), 200, media_type="application/json")

    def routes(self) -> list[Route]:
        def bind(api: Api) -> Callable[[Request], Awaitable[Response]]:
            async def endpoint(request: Request) -> Response:
                return await self.api_call(request, api)

            return endpoint

        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
        return [
            *(Route(a.path, bind(a), methods=["POST"]) for a in apis.APIS),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/prefixreg/calls/{call_id}", self.call, methods=["GET"]),
            Route("/prefixreg/heads", self.heads, methods=["GET"]),
            Route("/{path:path}", self.passthrough, methods=methods),
        ]


class _UpstreamError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _raw(
    data: bytes, status: int, headers: list[tuple[bytes, bytes]], *, head_length: str | None = None
) -> Response:
    """A response of exactly `data` with exactly `headers` and the length of `data`; for a
    HEAD (`head_length` given) the worker's length instead, of the body a GET would get
    (none if it sent none)."""
    resp = Response(b"", status)
    resp.body = data
    size = str(len(data)) if head_length is None else head_length
    resp.raw_headers = list(headers)
    if size.isdigit():
        resp.raw_headers.append((b"content-length", size.encode("ascii")))
    return resp


def _same(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode("utf-8", "replace"), b.encode("utf-8", "replace"))


def build_app(config: GatewayConfig, door: Door | None = None) -> tuple[Starlette, Gateway]:
    """The ASGI app for `config`, and the `Gateway` behind it (its counters, its door)."""
    gateway = Gateway(config, door)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.startup()
        try:
            yield
        finally:
            await gateway.shutdown()

    return Starlette(routes=gateway.routes(), lifespan=lifespan), gateway
