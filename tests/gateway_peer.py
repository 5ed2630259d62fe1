"""A gateway for tests and benchmarks, and a tap that records what a worker sends.

    with serve_gateway("--worker", url, "--call-log", str(log)) as base_url:
        OpenAI(base_url=base_url + "/v1", api_key="x")...

`serve_gateway(*args, env=None, timeout=30)` runs `python -m prefixreg gateway --listen
127.0.0.1:0 ARGS` as a real process (this tree, through PYTHONPATH), waits for the line that
names its address, yields the base URL (no `/v1`), and stops it by its pid (SIGINT, then
SIGKILL) on exit. Its stderr is kept in a temporary file; `GatewayFailedError` shows its tail.

`Tap(upstream_url)` is a loopback TCP relay in front of a worker: point the gateway at
`tap.url`, then `tap.replies()` parses every connection's server-to-client bytes (h11) into
(status, headers, body) records: the bytes the worker sent, de-chunked, as they came.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import h11

__all__ = ["GatewayFailedError", "Tap", "TapReply", "serve_gateway"]

_READY = re.compile(rb"listening on (http://\S+?) ")
_ROOT = Path(__file__).resolve().parent.parent


class GatewayFailedError(RuntimeError):
    pass


@contextmanager
def serve_gateway(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 30.0
) -> Iterator[str]:
    """A gateway process with `args` on an ephemeral loopback port; its base URL."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixreg", "gateway", "--listen", "127.0.0.1:0", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=full_env,
        )
        try:
            url = _wait_ready(proc, err, timeout)
            yield url
        finally:
            _stop(proc)


def _tail(err: object) -> str:
    assert hasattr(err, "seek") and hasattr(err, "read")
    err.seek(0)
    data: bytes = err.read()
    return data[-2000:].decode("utf-8", "replace")


def _wait_ready(proc: subprocess.Popen[bytes], err: object, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert hasattr(err, "seek") and hasattr(err, "read")
        err.seek(0)
        found = _READY.search(err.read())
        if found:
            return found.group(1).decode("ascii")
        if proc.poll() is not None:
            raise GatewayFailedError(f"the gateway exited {proc.returncode}: {_tail(err)}")
        time.sleep(0.02)
    raise GatewayFailedError(f"the gateway did not start in {timeout} s: {_tail(err)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclass(frozen=True)
class TapReply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Tap:
    """A TCP relay to `upstream_url` recording the server-to-client bytes of each connection."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self._to = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._streams: list[bytearray] = []
        self._lock = threading.Lock()
        self._closed = False
        self._open: list[socket.socket] = []  # closed by `close`, after the pumps are done
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._to)
            record = bytearray()
            with self._lock:
                self._streams.append(record)
                self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, record), daemon=True
            ).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if record is not None:
                    record.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def replies(self) -> list[TapReply]:
        """Every complete reply the worker sent, in connection order."""
        out: list[TapReply] = []
        with self._lock:
            streams = [bytes(s) for s in self._streams]
        for raw in streams:
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
            conn.send(h11.EndOfMessage())
            conn.receive_data(raw)
            conn.receive_data(b"")  # the recorded bytes end where the connection did
            status, headers, body = 0, [], bytearray()
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError:
                    break
                if isinstance(event, h11.Response):
                    status, headers = event.status_code, list(event.headers)
                elif isinstance(event, h11.Data):
                    body.extend(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    out.append(TapReply(status, headers, bytes(body)))
                    if conn.their_state is not h11.DONE or conn.our_state is not h11.DONE:
                        break
                    conn.start_next_cycle()
                    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                    conn.send(h11.EndOfMessage())
                    status, headers, body = 0, [], bytearray()
                elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                    break
        return out

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)
        with self._lock:
            for s in self._open:
                s.close()

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
