"""A worker's stream handed on to the client: `Stream` reads the worker's reply piece by piece
(the proof reads each piece only after it was sent), `StreamOut` sends the pieces while it
watches the client.

Invariants:
- Not a byte is changed, added or dropped; the proof settles exactly once (`Stream.aclose`),
  whether the stream ended, broke off or the client went away.
- A worker's stream that breaks off (its connection dropped, the call's deadline passed)
  is never made to look complete: `StreamBrokenError` leaves the ASGI send path, so the
  server drops the client's connection without the terminating chunk, and the client's
  read fails as it would have against the worker itself.
- A client that goes away cancels the sender, which closes the upstream reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from prefixreg.gateway.admission import Admission
from prefixreg.gateway.door import Door

T = TypeVar("T")


class DisconnectedError(Exception):
    """The client went away before its reply was sent."""


class StreamBrokenError(Exception):
    """The worker's stream broke off; raised out of the ASGI app to abort the response."""


class QuietBrokenStreams(logging.Filter):
    """Drops the server's traceback for an aborted stream: the proof and the log already
    name it in one line, and the abort is the intended way out."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamBrokenError)


async def _watch_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, or `DisconnectedError` (the work cancelled) once the client went away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_watch_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise DisconnectedError
    return task.result()


class Stream:
    """A worker's stream handed on piece by piece (`StreamOut` iterates it); each piece is read
    for the proof only after it was sent. `aclose` (a disconnect, a break or the end) closes
    the upstream reply and settles the proof exactly once, even if no piece was ever asked
    for; `on_close` runs then (the gateway's count of open upstream calls)."""

    def __init__(
        self,
        door: Door,
        resp: httpx.Response,
        adm: Admission,
        *,
        deadline: float,
        started: float,
        on_close: Callable[[], None],
    ) -> None:
        self.door, self.resp, self.adm = door, resp, adm
        self.deadline, self.started, self.on_close = deadline, started, on_close
        self.tally = door.tally(adm)
        self.raw = resp.aiter_raw()
        self.ended = self.closed = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> bytes:
        if self.tally.pending is not None:  # the piece before this one went out: read it now
            self.tally.feed(self.tally.pending)
            self.tally.pending = None
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                piece = await anext(self.raw)
        except StopAsyncIteration:
            self.ended = True
            await self.aclose()  # settled before the client sees the end
            raise
        except (TimeoutError, httpx.HTTPError) as exc:
            why = f"the worker's stream broke off ({type(exc).__name__})"
            self.tally.broken(why)
            await self.aclose()
            logging.getLogger("prefixreg.gateway").warning("%s; the reply was aborted", why)
            raise StreamBrokenError(why) from None
        self.tally.pending = piece
        return piece

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self.resp.aclose()
        finally:
            self.on_close()
            if self.tally.pending is not None and self.ended:
                self.tally.feed(self.tally.pending)  # the last piece was sent whole
            if not self.ended and self.tally.broken_reason is None:
                self.door.metrics.add("cancelled_total")
                self.tally.broken("client disconnected mid-stream")
            added = time.perf_counter() - self.started
            self.door.settle_stream(self.adm, self.resp.status_code, self.tally, added_s=added)


class StreamOut(Response):
    """A streamed reply sent piece by piece as `pieces` yields them, while the client is
    watched: a disconnect cancels the sender, whose generator then closes the upstream; a
    broken upstream stream raises `StreamBrokenError` on (the response is aborted)."""

    def __init__(self, pieces: Stream, status: int, headers: list[Any]) -> None:
        self.pieces = pieces
        self.status_code = status
        self.background = None
        self.raw_headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sender() -> None:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            async for piece in self.pieces:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await unless_gone(receive, sender())
        except (DisconnectedError, OSError):
            pass
        finally:
            await self.pieces.aclose()
