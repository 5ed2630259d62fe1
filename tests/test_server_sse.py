"""The SSE reader follows the event-stream spec (WHATWG) without losing its guarantees."""

from __future__ import annotations

import json
import time

import pytest

from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.sse import SSEParser, parse_sse

FRAME = {"choices": [{"index": 0, "delta": {"content": "hé"}, "finish_reason": None}]}
FINISH = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 9,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 4},
    },
}


def body(eol: str = "\n") -> bytes:
    events = [f"data: {json.dumps(f, ensure_ascii=False)}" for f in (FRAME, FINISH, USAGE)]
    events.append("data: [DONE]")
    return "".join(e + eol + eol for e in events).encode()


def test_multi_line_data_is_joined_with_newlines() -> None:
    text = json.dumps(USAGE, indent=1)  # a JSON document spread over many lines
    split = "".join(f"data: {line}\n" for line in text.split("\n"))
    stream = parse_sse(split + "\n" + "data: [DONE]\n\n")
    assert stream.done and stream.malformed is None and stream.chunks == [USAGE]


def test_data_lines_keep_their_own_spaces_after_the_first() -> None:
    stream = parse_sse('data:{"a":\ndata:  "b c"}\n\ndata:[DONE]\n\n')
    assert stream.chunks == [{"a": "b c"}] and stream.done


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_every_line_ending_reads_the_same(eol: str) -> None:
    ev = evidence_from_response(body(eol))
    assert (ev.cache_state, ev.cached_tokens) == ("reused", 4)
    assert ev.output_sha256 == evidence_from_response(body()).output_sha256


@pytest.mark.parametrize("eol", ["\r\n", "\r"])
def test_line_endings_cut_between_pieces(eol: str) -> None:
    raw = body(eol)
    for step in (1, 2, 3):
        parser = SSEParser()
        for i in range(0, len(raw), step):
            parser.feed(raw[i : i + step])
        assert parser.finish() == parse_sse(raw) == parse_sse(body())


def test_comments_and_other_fields_are_ignored() -> None:
    noisy = (
        b"\xef\xbb\xbf: keepalive\n\n"
        b"retry: 3000\nid: 7\nevent: message\n"
        + body()[: body().index(b"\n\n") + 2]
        + b": keepalive\nid\nretry: x\nfoo: bar\n\n"
        + body()[body().index(b"\n\n") + 2 :]
    )
    assert parse_sse(noisy) == parse_sse(body())


def test_error_event_fails_the_call() -> None:
    raw = body().replace(
        b"data: [DONE]", b'event: error\ndata: {"message": "secret"}\n\ndata: [DONE]'
    )
    ev = evidence_from_response(raw)
    assert (ev.cache_state, ev.error) == ("unverified", "server_stream_error")
    assert "secret" not in json.dumps(ev.to_dict())


def test_an_event_left_open_at_the_end_is_discarded() -> None:
    raw = body()[: -len(b"\n\n")]  # "data: [DONE]" without the blank line that dispatches it
    stream = parse_sse(raw)
    assert not stream.done
    assert evidence_from_response(raw).error == "incomplete_stream"


def test_a_field_with_leading_spaces_is_not_data() -> None:
    stream = parse_sse(b'  data: {"a": 1}\n\ndata: [DONE]\n\n')
    assert stream.chunks == [] and stream.done


def _feed_time(n: int) -> float:
    line = b"data: " + b"x" * n  # one line that never ends, fed a byte at a time
    parser = SSEParser()
    started = time.perf_counter()
    for i in range(len(line)):
        parser.feed(line[i : i + 1])
    parser.feed(b"\n\n")
    return time.perf_counter() - started


def test_a_long_line_fed_byte_by_byte_is_linear() -> None:
    small, large = _feed_time(20_000), _feed_time(160_000)
    assert large / max(small, 1e-6) < 30  # linear is ~8x; a re-scan would be ~64x
