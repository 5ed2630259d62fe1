"""Running a gateway: uvicorn serving `app.build_app` at an address `config.parse_listen`
checked, and a thread-hosted server for code that embeds a gateway (tests, benchmarks).

Invariants:
- uvicorn logs no access lines (they would name paths and clients; the call log is the
  record) and sends no `server`/`date` header of its own: the worker's go through.
- The socket is bound before `serve` reports the address, so port 0 gives a real port.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn

from prefixreg.core.errors import UsageError
from prefixreg.gateway.app import Gateway, build_app
from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.stream import QuietBrokenStreams


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it a reply's headers and body wait on the client's delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _raise_open_files() -> None:
    """Each stream holds two sockets (the client's and the worker's): take the process's
    soft limit on open files up to its hard limit (a thousand streams need 2,000)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass  # a platform that refuses keeps its limit: calls past it fail as they would


def _server(config: GatewayConfig) -> tuple[uvicorn.Server, Gateway]:
    app, gateway = build_app(config)
    uv = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        backlog=2048,
    )
    quiet = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietBrokenStreams) for f in quiet.filters):
        quiet.addFilter(QuietBrokenStreams())  # an aborted stream is logged in one line
    return uvicorn.Server(uv), gateway


def serve(
    config: GatewayConfig,
    host: str,
    port: int,
    *,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until interrupted (SIGINT/SIGTERM); `ready(url)` once the socket is bound."""
    _raise_open_files()
    server, _ = _server(config)  # its config checked (a call log's path too) before binding
    sock = _bind(host, port)
    bound = sock.getsockname()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if ready is not None and server.started:
            ready(url)
        await task

    try:
        asyncio.run(main())
    finally:
        sock.close()


@contextmanager
def serve_in_thread(
    config: GatewayConfig, host: str = "127.0.0.1"
) -> Iterator[tuple[str, Gateway]]:
    """A gateway on an ephemeral port in a daemon thread: (its base URL, its `Gateway`);
    stopped (and its upstream calls closed) on exit."""
    sock = _bind(host, 0)
    server, gateway = _server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as exc:  # noqa: BLE001 -- reported by the caller below
            errors.append(exc)

    thread = threading.Thread(target=run, name="prefixreg-gateway", daemon=True)
    thread.start()
    for _ in range(1000):
        if server.started or errors or not thread.is_alive():
            break
        threading.Event().wait(0.01)
    if not server.started:
        sock.close()
        raise RuntimeError(f"the gateway did not start: {errors[:1]}")
    try:
        yield f"http://{host}:{sock.getsockname()[1]}", gateway
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
