"""Property: whatever bytes a server streams, evidence is cold, reused or unverified, and
cold/reused only with a completed stream and valid counts (issue 13)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.records import CallEvidence
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.sse import SSEParser, parse_sse
from prefixreg.server.worker import Worker
from tests.fakeserver import FakeServer, Reply, Request
from tests.hypothesis_profile import bounded

COUNT = st.one_of(
    st.integers(min_value=-2, max_value=60),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.booleans(),
    st.none(),
    st.sampled_from(["8", [], {}]),
)
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)


@st.composite
def usage_frame(draw: st.DrawFn) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    for key in ("prompt_tokens", "completion_tokens"):
        if draw(st.booleans()):
            usage[key] = draw(COUNT)
    if draw(st.booleans()):
        usage["prompt_tokens_details"] = {"cached_tokens": draw(COUNT)}
    frame: dict[str, Any] = {"choices": [], "usage": usage}
    if draw(st.booleans()):
        frame["timings"] = {"cache_n": draw(COUNT), "disk_restore_n": draw(COUNT)}
    return frame


FRAME = st.one_of(
    TEXT.map(lambda t: {"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}),
    st.just({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    usage_frame(),
    st.just({"error": {"message": "boom"}}),
)
EVENT = st.one_of(
    FRAME.map(lambda f: [f"data: {json.dumps(f, ensure_ascii=False)}"]),
    FRAME.map(lambda f: [f"data: {line}" for line in json.dumps(f, indent=1).split("\n")]),
    st.sampled_from([[": keepalive"], ["id: 3", "retry: 10"], ["event: error", "data: {}"]]),
    st.sampled_from([["data: [DONE]"], ["data: {oops"], ["data: 5"]]),
    st.binary(max_size=12).map(lambda b: [b]),
)


VALID_USAGE = st.builds(
    lambda prompt, cached: {
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    },
    st.integers(min_value=0, max_value=60),
    st.integers(min_value=0, max_value=60),
)
HARMLESS = st.sampled_from([[": keepalive"], ["id: 3", "retry: 10"], ["event: message"]])


@st.composite
def well_formed(draw: st.DrawFn) -> list[list[str | bytes]]:
    """A proper stream (text, finish, usage, [DONE]) with harmless or hostile events mixed in."""
    events: list[list[str | bytes]] = [
        [f"data: {json.dumps(f, ensure_ascii=False)}"]
        for f in [
            *draw(st.lists(FRAME.filter(lambda f: "error" not in f), max_size=3)),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            draw(VALID_USAGE),
        ]
    ]
    events.append(["data: [DONE]"])
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        noise: list[str | bytes] = list(draw(st.one_of(HARMLESS, HARMLESS, EVENT)))
        events.insert(draw(st.integers(min_value=0, max_value=len(events))), noise)
    return events


@st.composite
def byte_stream(draw: st.DrawFn) -> bytes:
    """Events with any line endings, possibly cut anywhere, possibly with junk bytes."""
    out = bytearray()
    for lines in draw(st.one_of(well_formed(), st.lists(EVENT, max_size=8))):
        eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
        for line in lines:
            out += (line if isinstance(line, bytes) else line.encode()) + eol
        out += eol
    if draw(st.integers(min_value=0, max_value=3)) == 0:
        out = out[: draw(st.integers(min_value=0, max_value=len(out)))]
    return bytes(out)


def assert_proven(ev: CallEvidence, body: bytes) -> None:
    assert ev.cache_state in ("cold", "reused", "unverified")
    if ev.cache_state == "unverified":
        return
    oracle = parse_sse(body)  # the stream itself must have completed cleanly
    assert oracle.done and oracle.malformed is None
    assert ev.complete and ev.error is None and ev.output_sha256 is not None
    prompt, cached = ev.prompt_tokens, ev.cached_tokens
    assert type(prompt) is int and type(cached) is int and 0 <= cached <= prompt
    assert (ev.cache_state == "cold") == (cached == 0)


@bounded(400)
@given(body=byte_stream(), step=st.integers(min_value=1, max_value=9))
def test_any_byte_stream_proves_only_what_it_says(body: bytes, step: int) -> None:
    ev = evidence_from_response(body)
    assert_proven(ev, body)
    parser = SSEParser()
    for i in range(0, len(body), step):
        parser.feed(body[i : i + step])
    assert evidence_from_response(parser.finish()) == ev  # the cuts change nothing
    assert CallEvidence.from_dict(ev.to_dict()) == ev


@bounded(400)
@given(body=st.binary(max_size=200))
def test_random_bytes_are_never_cold_or_reused_without_done(body: bytes) -> None:
    ev = evidence_from_response(body)
    assert_proven(ev, body)


class _Current:
    body = b""


@pytest.fixture(scope="module")
def stream_server() -> Iterator[tuple[FakeServer, _Current]]:
    current = _Current()

    def reply(_req: Request) -> Reply:
        return Reply(body=current.body, content_type="text/event-stream")

    with FakeServer() as srv:
        srv.route("POST", "/v1/chat/completions", reply)
        yield srv, current


@bounded(40)
@given(body=byte_stream())
def test_over_loopback_the_worker_judges_as_the_pure_reader(
    stream_server: tuple[FakeServer, _Current], body: bytes
) -> None:
    srv, current = stream_server
    current.body = body
    with Worker(srv.url, read_timeout=10) as w:
        _, ev = w.chat("system", "tail")
    assert_proven(ev, body)
    pure = evidence_from_response(body)
    got = (ev.cache_state, ev.cached_tokens, ev.complete, ev.output_sha256, ev.error)
    assert got == (
        pure.cache_state,
        pure.cached_tokens,
        pure.complete,
        pure.output_sha256,
        pure.error,
    )
