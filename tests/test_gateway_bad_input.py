"""The gateway under bad input and hostile upstreams: the API's own error shape and status,
bounded memory, no upstream call left running."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.sim import SimConfig, SimServer
from tests.fakeserver import FakeServer, Reply, lazy, sse_flood, sse_frames

SYSTEM = "You are a terse assistant. " * 20


SHORT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]


def body(**extra: object) -> dict[str, object]:
    return {"model": "m", "messages": SHORT, "max_tokens": 4, **extra}


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server


def _wait(predicate: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def test_a_body_not_json_gets_the_apis_error_and_nothing_is_forwarded(fake: FakeServer) -> None:
    with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, _):
        chat = httpx.post(url + "/v1/chat/completions", content=b"{not json")
        msgs = httpx.post(url + "/v1/messages", content=b"\xff\xfe")
        listed = httpx.post(url + "/v1/responses", content=b"[1, 2]")
    assert chat.status_code == msgs.status_code == listed.status_code == 400
    assert chat.json()["error"]["type"] == "invalid_request_error"
    assert msgs.json()["type"] == "error"
    assert msgs.json()["error"]["type"] == "invalid_request_error"
    assert "not a JSON object" in listed.json()["error"]["message"]
    assert fake.requests == []


def test_ten_megabytes_pass_and_a_body_over_the_cap_is_refused(fake: FakeServer) -> None:
    fake.route("POST", "/v1/chat/completions", lambda req: Reply(json={"got": len(req.body)}))
    big = body()
    big["messages"] = [*SHORT, {"role": "user", "content": "x" * (10 * 2**20)}]
    data = json.dumps(big).encode()
    config = GatewayConfig(workers=(fake.url,), max_body_bytes=12 * 2**20)
    with serve_in_thread(config) as (url, _):
        ok = httpx.post(url + "/v1/chat/completions", content=data, timeout=60)
        over = httpx.post(url + "/v1/chat/completions", content=data + b" " * (3 * 2**20))
    assert ok.status_code == 200 and ok.json() == {"got": len(data)}  # forwarded whole
    assert over.status_code == 413
    assert over.json()["error"]["type"] == "invalid_request_error"
    assert len(fake.requests) == 1


def test_a_client_that_disconnects_mid_stream_cancels_the_upstream_call(fake: FakeServer) -> None:
    sent: list[int] = []
    ended = threading.Event()

    def slow() -> Iterator[bytes]:
        try:
            frame = {"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": None}]}
            for i in range(400):  # 20 s if nobody stops it
                sent.append(i)
                yield sse_frames([frame], done=False)[0]
                time.sleep(0.05)
        finally:
            ended.set()

    fake.route(
        "POST", "/v1/chat/completions", Reply(generate=slow, content_type="text/event-stream")
    )
    with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, gw):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body(stream=True)) as r:
            next(r.iter_raw())  # the first event arrived: now go away
        assert ended.wait(10), "the upstream kept streaming after the client left"
        assert _wait(lambda: gw.inflight == 0)
        assert gw.door.metrics.value("cancelled_total") == 1
    assert len(sent) < 400


def test_an_upstream_that_trickles_is_cut_at_the_deadline(fake: FakeServer) -> None:
    fake.route("POST", "/v1/chat/completions", Reply(json={"choices": []}, trickle=0.2))
    config = GatewayConfig(workers=(fake.url,), timeout_s=1.0)
    with serve_in_thread(config) as (url, gw):
        reply = httpx.post(url + "/v1/chat/completions", json=body(), timeout=30)
        assert _wait(lambda: gw.inflight == 0)
    assert reply.status_code == 504
    assert reply.json()["error"]["type"] == "server_error"


def test_an_upstream_that_floods_a_buffered_reply_is_cut_at_the_cap(fake: FakeServer) -> None:
    fake.route("POST", "/v1/chat/completions", Reply(generate=lazy(64 * 2**20)))
    config = GatewayConfig(workers=(fake.url,), max_reply_bytes=2 * 2**20)
    with serve_in_thread(config) as (url, gw):
        reply = httpx.post(url + "/v1/chat/completions", json=body(), timeout=30)
        assert _wait(lambda: gw.inflight == 0)
    assert reply.status_code == 502
    assert "cap" in reply.json()["error"]["message"]


def test_a_flooding_stream_is_forwarded_whole_and_its_proof_stops_reading(fake: FakeServer) -> None:
    total = 24 * 2**20
    fake.route(
        "POST",
        "/v1/chat/completions",
        Reply(generate=sse_flood(total), content_type="text/event-stream"),
    )
    config = GatewayConfig(workers=(fake.url,), max_reply_bytes=2 * 2**20)
    with serve_in_thread(config) as (url, gw):
        got = 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body(stream=True)) as r:
            call = r.headers["x-prefixreg-call"]
            for piece in r.iter_raw():
                got += len(piece)
        record: Any = gw.door.call_record(call)
    assert got >= total
    assert record is not None and record["gateway"]["verdict"] == "unverified"
    assert "too long" in (record["evidence"]["reason"] or "")


def test_an_unreachable_worker_is_the_apis_502_and_logged(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    log = tmp_path / "calls.jsonl"
    with serve_in_thread(GatewayConfig(workers=(dead,), call_log=log)) as (url, _):
        reply = httpx.post(
            url + "/v1/messages",
            json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        )
    assert reply.status_code == 502
    assert reply.json()["type"] == "error"
    line = json.loads(log.read_text().splitlines()[0])
    assert line["gateway"]["status"] == 502 and line["gateway"]["verdict"] == "unverified"


def _raw_request(url: str, head: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_header_with_cr_or_lf_is_refused_before_anything_is_forwarded(fake: FakeServer) -> None:
    payload = json.dumps(body()).encode()
    with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, _):
        for bad in (b"x-session-id: a\rinjected: 1", b"x-session-id: a\x00b"):
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                + b"Content-Type: application/json\r\n"
                + bad
                + b"\r\nContent-Length: "
                + str(len(payload)).encode()
                + b"\r\nConnection: close\r\n\r\n"
            )
            reply = _raw_request(url, head + payload)
            assert reply.startswith(b"HTTP/1.1 400"), reply[:80]
    assert fake.requests == []


def test_session_header_values_never_come_back_as_they_were_sent() -> None:
    with (
        SimServer(SimConfig(speed=5000)) as sim,
        serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, _),
    ):
        reply = httpx.post(
            url + "/v1/chat/completions",
            json=body(),
            headers={"x-session-id": "secret-session-value"},
        )
    assert reply.status_code == 200
    assert all("secret-session-value" not in v for v in reply.headers.values())


def test_a_client_that_gives_up_on_a_buffered_call_cancels_it_upstream(fake: FakeServer) -> None:
    held = threading.Event()

    def slow() -> Iterator[bytes]:
        try:
            for _ in range(200):  # 20 s, a byte at a time, if nobody stops it
                yield b" "
                time.sleep(0.1)
            yield json.dumps({"choices": []}).encode()
        finally:
            held.set()

    fake.route("POST", "/v1/chat/completions", Reply(generate=slow))
    with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, gw):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body(), timeout=0.5)
        assert held.wait(10), "the upstream call went on after its client left"
        assert _wait(lambda: gw.inflight == 0)
        assert gw.door.metrics.value("cancelled_total") == 1


def test_a_client_that_leaves_before_the_first_event_cancels_the_stream(fake: FakeServer) -> None:
    ended = threading.Event()

    def late() -> Iterator[bytes]:
        try:
            time.sleep(0.3)  # the headers went out; the prefill takes its time
            for _ in range(100):
                yield b": keepalive\n\n"
                time.sleep(0.1)
        finally:
            ended.set()

    fake.route(
        "POST", "/v1/chat/completions", Reply(generate=late, content_type="text/event-stream")
    )
    with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, gw):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body(stream=True)) as r:
            call = r.headers["x-prefixreg-call"]  # headers only: leave before any event
        assert ended.wait(10), "the upstream kept streaming after the client left"
        assert _wait(lambda: gw.inflight == 0)
        assert _wait(lambda: gw.door.call_record(call) is not None)
        record: Any = gw.door.call_record(call)
    assert record["gateway"]["verdict"] == "unverified"
    assert gw.door.metrics.value("cancelled_total") == 1


def test_a_worker_stream_that_breaks_off_reaches_the_client_broken(fake: FakeServer) -> None:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    # The worker promises far more than it sends, then drops the connection.
    fake.route(
        "POST",
        "/v1/chat/completions",
        Reply(generate=lambda: [event], content_type="text/event-stream", length=100_000),
    )
    got: list[bytes] = []
    with (
        serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, _),
        httpx.stream("POST", url + "/v1/chat/completions", json=body(stream=True)) as resp,
    ):
        assert resp.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):  # no clean end of the chunked body
            for piece in resp.iter_raw():
                got.append(piece)
    assert b"".join(got) == event  # every byte the worker sent, and no end


def test_valid_json_orjson_refuses_is_forwarded_unread_and_unverified(fake: FakeServer) -> None:
    usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 90}}
    choice = {"index": 0, "message": {"content": "k"}, "finish_reason": "stop"}
    fake.route("POST", "/v1/chat/completions", Reply(json={"choices": [choice], "usage": usage}))
    surrogate = b'{"model": "m", "messages": [{"role": "user", "content": "x\\ud800"}]}'
    deep = b'{"model": "m", "extra": ' + b"[" * 1100 + b"]" * 1100 + b"}"
    deeper = b'{"a": ' + b'{"b": ' * 100_000 + b"1" + b"}" * 100_001  # crashed orjson < 3.9.15
    with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, _):
        bodies = (surrogate, deep, deeper)
        replies = [httpx.post(url + "/v1/chat/completions", content=b) for b in bodies]
        bad = httpx.post(url + "/v1/chat/completions", content=b'{"a": NaN}')
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert [r.body for r in fake.requests] == list(bodies)  # forwarded as they came
    for reply in replies:
        assert reply.headers["x-prefixreg-head"] == "none"
        assert reply.headers["x-prefixreg-verdict"] == "unverified"
        assert reply.headers["x-prefixreg-reason"] == "a JSON body the gateway does not read"
    assert bad.status_code == 400  # not JSON at all: still refused


class _ClosesAfterStreams(threading.Thread):
    """An upstream that, like llama-server, closes a connection after a streamed reply
    without a `Connection: close` (here 0.3 s later, reading nothing more): a call sent on
    it meanwhile gets no reply. Buffered replies keep their connection alive."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.asked_to_close: list[bool] = []

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            while True:
                lines = []
                while (line := rfile.readline()) not in (b"\r\n", b""):
                    lines.append(line.decode("latin-1").lower())
                if not lines:
                    return
                size = next(int(x.split(":")[1]) for x in lines if x.startswith("content-length"))
                sent = json.loads(rfile.read(size))
                if not sent.get("stream"):
                    reply = json.dumps({"choices": [], "usage": {"prompt_tokens": 3}}).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(reply), reply))  # fmt: skip
                    continue
                self.asked_to_close.append(any(x.startswith("connection: close") for x in lines))
                event = b"data: {}\n\ndata: [DONE]\n\n"
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                             % (len(event), event))  # fmt: skip
                time.sleep(0.3)
                return


def test_a_call_after_a_stream_is_never_sent_on_the_connection_the_worker_drops() -> None:
    upstream = _ClosesAfterStreams()
    upstream.start()
    try:
        with (
            serve_in_thread(GatewayConfig(workers=(upstream.url,))) as (url, _),
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            statuses = []
            for _ in range(3):
                with client.stream("POST", "/v1/chat/completions", json=body(stream=True)) as r:
                    r.read()
                    statuses.append(r.status_code)
                statuses.append(client.post("/v1/chat/completions", json=body()).status_code)
    finally:
        upstream.sock.close()
    assert statuses == [200] * 6
    assert upstream.asked_to_close == [True] * 3
