"""Behaviour of `prefixreg.server.evidence`: the DESIGN §4 rules, one case at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from prefixreg.core.digest import output_digest
from prefixreg.core.records import CacheCounters, CallEvidence
from prefixreg.server.counters import counter_deltas, is_interleaved
from prefixreg.server.evidence import (
    SOURCE_TIMINGS,
    SOURCE_USAGE,
    evidence_from_response,
)
from prefixreg.server.replies import ReplyReader
from prefixreg.server.sse import SSEParser, parse_sse

SHA_A = "a" * 12
SHA_B = "b" * 64


def usage(prompt: Any = 8, cached: Any = None, completion: Any = 4) -> dict[str, Any]:
    """An OpenAI usage block; `cached=None` omits prompt_tokens_details (Halogen cold)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": 12,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def chat_chunks(
    pieces: list[str] | None = None,
    *,
    use: Any = None,
    timings: Any = None,
    runtime: Any = None,
    reasoning: list[str] | None = None,
) -> list[Any]:
    """Content frames, a finish frame, then the include_usage frame (`choices: []`)."""
    frames: list[Any] = [
        {"choices": [{"index": 0, "delta": {"reasoning_content": r}}], "usage": None}
        for r in reasoning or []
    ]
    frames += [
        {"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}], "usage": None}
        for p in (pieces if pieces is not None else ["Hel", "lo"])
    ]
    frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": None})
    last: dict[str, Any] = {"choices": [], "usage": use}
    if timings is not None:
        last["timings"] = timings
    if runtime is not None:
        last["tensorfold"] = runtime
    frames.append(last)
    return frames


def response(use: Any, *, timings: Any = None, content: Any = "Hello") -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": content},
            }
        ],
    }
    if use is not ...:
        out["usage"] = use
    if timings is not None:
        out["timings"] = timings
    return out


def sse(frames: list[Any], *, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames)
    return body + (b"data: [DONE]\n\n" if done else b"")


# ------------------------------------------------------------------ states


def test_cold_and_reused_need_affirmative_counts() -> None:
    cold = evidence_from_response(chat_chunks(use=usage(cached=0)), done=True)
    reused = evidence_from_response(chat_chunks(use=usage(cached=7)), done=True)
    assert (cold.cache_state, cold.cached_tokens, cold.cached_source) == ("cold", 0, SOURCE_USAGE)
    assert (reused.cache_state, reused.prompt_tokens, reused.cached_tokens) == ("reused", 8, 7)
    assert reused.completion_tokens == 4
    assert reused.complete and reused.error is None and reused.reason is None


def test_cached_equal_to_prompt_is_reused() -> None:
    ev = evidence_from_response(response(usage(prompt=8, cached=8)))
    assert ev.cache_state == "reused"


@pytest.mark.parametrize(
    ("use", "reason"),
    [
        (None, "usage missing"),
        ({}, "prompt_tokens missing"),
        ([], "usage is a list"),
        ("invalid", "usage is a string"),
        ({"prompt_tokens": 8}, "cached_tokens missing"),
        (usage(), "cached_tokens missing"),
        (usage(cached=True), "cached_tokens is a boolean"),
        (usage(cached=False), "cached_tokens is a boolean"),
        (usage(cached=8.0), "cached_tokens is a float"),
        (usage(cached=0.0), "cached_tokens is a float"),
        (usage(cached="8"), "cached_tokens is a string"),
        (usage(cached="0"), "cached_tokens is a string"),
        (usage(cached=-1), "cached_tokens is negative"),
        (usage(cached=9), "cached_tokens > prompt_tokens"),
        (usage(prompt=None, cached=0), "prompt_tokens missing"),
        (usage(prompt=-1, cached=0), "prompt_tokens is negative"),
        (usage(prompt=True, cached=0), "prompt_tokens is a boolean"),
        (usage(prompt="8", cached=0), "prompt_tokens is a string"),
        (usage(prompt=8.0, cached=0), "prompt_tokens is a float"),
        ({**usage(), "prompt_tokens_details": [0]}, "prompt_tokens_details is a list"),
    ],
)
def test_malformed_usage_is_unverified_never_zero(use: Any, reason: str) -> None:
    for ev in (
        evidence_from_response(chat_chunks(use=use), done=True),
        evidence_from_response(response(use)),
    ):
        assert ev.cache_state == "unverified"
        assert ev.reason is not None and reason in ev.reason
        assert ev.complete  # the reply arrived whole; only the counts fail


def test_non_streamed_reply_without_usage_key_is_unverified() -> None:
    ev = evidence_from_response(response(...))
    assert (ev.cache_state, ev.reason, ev.cached_tokens) == ("unverified", "usage missing", None)


def test_the_first_valid_cached_source_wins() -> None:
    # DESIGN §4: "cached_tokens source, first valid wins". A malformed usage count is
    # passed over for timings.cache_n, and the record says which source it read.
    ev = evidence_from_response(response(usage(cached=8.0), timings={"cache_n": 8}))
    assert (ev.cache_state, ev.cached_tokens, ev.cached_source) == ("reused", 8, SOURCE_TIMINGS)
    ev = evidence_from_response(response(usage(cached=8), timings={"cache_n": "9"}))
    assert (ev.cached_tokens, ev.cached_source) == (8, SOURCE_USAGE)
    # None valid: unverified, the reason naming the first malformed source.
    ev = evidence_from_response(response(usage(cached=8.0), timings={"cache_n": True}))
    assert (ev.cache_state, ev.reason) == ("unverified", "cached_tokens is a float")
    ev = evidence_from_response(response(usage(cached=None), timings={"cache_n": -1}))
    assert (ev.cache_state, ev.reason) == ("unverified", "timings.cache_n is negative")


def test_halogen_cold_reply_is_cold_from_timings() -> None:
    """Halogen omits prompt_tokens_details when nothing was cached; timings.cache_n says 0."""
    timings = {"cache_n": 0, "prompt_n": 8, "prompt_ms": 812.5, "predicted_ms": 40}
    ev = evidence_from_response(chat_chunks(use=usage(), timings=timings), done=True)
    assert (ev.cache_state, ev.cached_tokens, ev.cached_source) == ("cold", 0, SOURCE_TIMINGS)
    assert (ev.prompt_ms, ev.predicted_ms) == (812.5, 40.0)


def test_halogen_cold_reply_without_timings_is_unverified() -> None:
    ev = evidence_from_response(chat_chunks(use=usage()), done=True)
    assert ev.cache_state == "unverified"
    assert ev.cached_tokens is None and ev.cached_source is None


def test_halogen_warm_reply_prefers_usage() -> None:
    ev = evidence_from_response(response(usage(prompt=8, cached=6), timings={"cache_n": 5}))
    assert (ev.cached_tokens, ev.cached_source) == (6, SOURCE_USAGE)


@pytest.mark.parametrize("bad", [0.0, "0", True, -1, None])
def test_malformed_timings_cache_n_is_unverified(bad: Any) -> None:
    ev = evidence_from_response(response(usage(), timings={"cache_n": bad}))
    assert ev.cache_state == "unverified"


def test_llamacpp_explicit_zero_cold_reply() -> None:
    """llama.cpp sends cached_tokens 0 and timings.cache_n 0 on a cold call."""
    resp = {
        "choices": [
            {
                "finish_reason": "length",
                "index": 0,
                "message": {"role": "assistant", "content": "Q"},
            }
        ],
        "object": "chat.completion",
        "usage": {
            "completion_tokens": 4,
            "prompt_tokens": 2065,
            "total_tokens": 2069,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "timings": {"cache_n": 0, "prompt_n": 2065, "prompt_ms": 6860.1, "predicted_ms": 67.153},
    }
    ev = evidence_from_response(resp, wall_s=6.9)
    assert (ev.cache_state, ev.cached_source, ev.prompt_tokens) == ("cold", SOURCE_USAGE, 2065)
    assert ev.prompt_ms == 6860.1 and ev.wall_s == 6.9 and ev.ttft_s is None


def test_timings_that_are_not_numbers_are_dropped() -> None:
    timings = {"cache_n": 0, "prompt_ms": "12", "predicted_ms": True}
    ev = evidence_from_response(response(usage(), timings=timings))
    assert ev.cache_state == "cold"
    assert ev.prompt_ms is None and ev.predicted_ms is None


# ------------------------------------------------------------------ streams


def test_stream_without_done_is_unverified_without_hashes() -> None:
    frames = chat_chunks(use=usage(cached=7), runtime={"token_sha": SHA_A})
    ev = evidence_from_response(frames, done=False, ttft_s=0.1, wall_s=0.2)
    assert (ev.cache_state, ev.complete, ev.error) == ("unverified", False, "incomplete_stream")
    assert ev.reason == "stream ended without [DONE]"
    assert ev.output_sha256 is None and ev.token_sha is None and ev.ttft_s is None
    assert ev.wall_s == 0.2
    assert ev.cached_tokens == 7  # what the server said is kept; it proves nothing here


def test_error_frame_is_unverified_and_drops_the_message() -> None:
    secret = "engine refused: prompt was 'my private tail'"
    frames = [
        *chat_chunks(use=usage(cached=7))[:1],
        {"error": {"message": secret, "code": "x"}},
    ]
    ev = evidence_from_response(sse(frames))  # Flash ends an error stream with [DONE]
    assert (ev.cache_state, ev.complete, ev.error) == ("unverified", False, "server_stream_error")
    assert ev.reason == "error frame"
    assert secret not in json.dumps(ev.to_dict())


def test_keepalive_comments_and_blank_lines_are_ignored() -> None:
    frames = chat_chunks(use=usage(cached=7))
    plain = sse(frames)
    noisy = b": keepalive\n\n" + plain.replace(b"\n\n", b"\n\n: keepalive\n\n\r\n", 2)
    a, b = evidence_from_response(plain), evidence_from_response(noisy)
    assert a.cache_state == b.cache_state == "reused"
    assert a.output_sha256 == b.output_sha256 is not None


def test_data_line_that_is_not_json_makes_the_stream_malformed() -> None:
    body = sse(chat_chunks(use=usage(cached=7))).replace(
        b"data: [DONE]", b"data: {oops\n\ndata: [DONE]"
    )
    stream = parse_sse(body)
    assert stream.done and stream.malformed == "a data: line is not JSON"
    ev = evidence_from_response(stream)
    assert (ev.cache_state, ev.error, ev.output_sha256) == ("unverified", "malformed_stream", None)


def test_non_object_frame_and_non_utf8_are_malformed() -> None:
    assert evidence_from_response(b"data: 5\n\ndata: [DONE]\n\n").error == "malformed_stream"
    stream = parse_sse(b"data: \xff\xfe\n\ndata: [DONE]\n\n")
    assert stream.malformed == "the stream is not UTF-8"


def test_parser_is_incremental_and_stops_at_done() -> None:
    body = sse(chat_chunks(use=usage(cached=7))) + b'data: {"late": 1}\n\n'
    parser = SSEParser()
    seen: list[object] = []
    for i in range(0, len(body), 7):  # cut anywhere, even inside "data:" or a UTF-8 char
        seen += parser.feed(body[i : i + 7])
    stream = parser.finish()
    assert stream.done and stream.malformed is None
    assert seen == stream.chunks and len(seen) == 4
    assert evidence_from_response(stream) == evidence_from_response(body)


def test_parse_sse_and_evidence_accept_text_as_bytes() -> None:
    body = sse(chat_chunks(use=usage(cached=7)))
    assert parse_sse(body.decode()) == parse_sse(bytearray(body)) == parse_sse(body)
    assert evidence_from_response(body.decode()) == evidence_from_response(body)


def test_non_string_text_piece_is_unverified() -> None:
    frames = chat_chunks(use=usage(cached=7))
    frames[0]["choices"][0]["delta"]["content"] = 42
    ev = evidence_from_response(frames, done=True)
    assert (ev.cache_state, ev.error, ev.output_sha256) == (
        "unverified",
        "invalid_text_chunk",
        None,
    )
    assert evidence_from_response(response(usage(cached=7), content=["x"])).complete is False


def test_null_content_pieces_are_skipped() -> None:
    frames = chat_chunks(["a"], use=usage(cached=7))
    frames.insert(0, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
    ev = evidence_from_response(frames, done=True)
    assert ev.complete and ev.output_sha256 == output_digest(b"a", b"")


def test_list_of_chunks_needs_done_to_be_complete() -> None:
    frames = chat_chunks(use=usage(cached=7))
    assert evidence_from_response(frames).cache_state == "unverified"
    assert evidence_from_response(frames, done=True).cache_state == "reused"


# ------------------------------------------------------------------ output_sha256


def test_output_sha_ignores_chunk_boundaries() -> None:
    whole = evidence_from_response(chat_chunks(["café 🚀"], use=usage(cached=0)), done=True)
    split = evidence_from_response(chat_chunks(["ca", "fé 🚀", ""], use=usage(cached=0)), done=True)
    assert whole.output_sha256 == split.output_sha256 == output_digest("café 🚀".encode(), b"")
    nonstream = evidence_from_response(response(usage(cached=0), content="café 🚀"))
    assert nonstream.output_sha256 == whole.output_sha256


def test_output_sha_distinguishes_reasoning_from_content() -> None:
    a = evidence_from_response(chat_chunks(["x"], reasoning=["y"], use=usage(cached=0)), done=True)
    b = evidence_from_response(chat_chunks(["y"], reasoning=["x"], use=usage(cached=0)), done=True)
    assert a.output_sha256 == output_digest(b"x", b"y")
    assert a.output_sha256 != b.output_sha256


def test_completions_text_frames_are_hashed() -> None:
    frames: list[Any] = [{"choices": [{"index": 0, "text": t}]} for t in ("ab", "c")]
    frames.append({"choices": [], "usage": usage(cached=0)})
    ev = evidence_from_response(frames, done=True)
    assert ev.output_sha256 == output_digest(b"abc", b"")


def test_only_the_first_choice_is_hashed() -> None:
    frames = chat_chunks(["a"], use=usage(cached=0))
    frames.insert(0, {"choices": [{"index": 1, "delta": {"content": "zzz"}}]})
    assert evidence_from_response(frames, done=True).output_sha256 == output_digest(b"a", b"")


# ------------------------------------------------------------------ token_sha


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        (SHA_A, SHA_A),
        (SHA_B, SHA_B),
        (None, None),
        (True, None),
        ("not-a-hash", None),
        ("a" * 11, None),
        ("A" * 12, None),
        ("a" * 13, None),
        ("a" * 12 + "\n", None),
    ],
)
def test_token_sha_only_from_tensorfold_block(raw: Any, kept: str | None) -> None:
    ev = evidence_from_response(
        chat_chunks(use=usage(cached=0), runtime={"token_sha": raw}), done=True
    )
    assert ev.token_sha == kept


def test_token_sha_elsewhere_is_ignored() -> None:
    frames = chat_chunks(use=usage(cached=0))
    frames[-1]["token_sha"] = SHA_A
    assert evidence_from_response(frames, done=True).token_sha is None


# ------------------------------------------------------------------ SDK objects


@dataclass
class _Details:
    cached_tokens: int | None


@dataclass
class _Usage:
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: _Details | None


class _Message:
    def __init__(self, content: str) -> None:
        self.role = "assistant"
        self.content = content
        self._private = "not read"


class _Choice:
    def __init__(self, content: str) -> None:
        self.index = 0
        self.finish_reason = "stop"
        self.message = _Message(content)


class _DumpModel:
    """Looks like a pydantic model: only `model_dump()` is read."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def model_dump(self) -> dict[str, Any]:
        return self._data


class _ToDict:
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def to_dict(self) -> dict[str, Any]:
        return self._data


def test_sdk_objects_by_duck_typing() -> None:
    via_dump = evidence_from_response(_DumpModel(response(usage(cached=5))))
    via_to_dict = evidence_from_response(_ToDict(response(usage(cached=5))))
    assert via_dump.cache_state == via_to_dict.cache_state == "reused"

    class Completion:
        def __init__(self) -> None:
            self.choices = [_Choice("Hello")]
            self.usage = _Usage(8, 4, _Details(3))

    ev = evidence_from_response(Completion())
    assert (ev.cache_state, ev.cached_tokens) == ("reused", 3)
    assert ev.output_sha256 == evidence_from_response(response(usage(cached=3))).output_sha256


def test_sdk_object_with_null_details_is_unverified() -> None:
    """model_dump() writes prompt_tokens_details None when the server omitted it."""
    dumped = response({"prompt_tokens": 8, "completion_tokens": 4, "prompt_tokens_details": None})
    ev = evidence_from_response(_DumpModel(dumped))
    assert ev.cache_state == "unverified"


def test_sdk_chunk_objects() -> None:
    frames = [_DumpModel(f) for f in chat_chunks(use=usage(cached=2))]
    assert evidence_from_response(frames, done=True).cache_state == "reused"


def test_error_body_and_junk_responses() -> None:
    err = evidence_from_response({"error": {"message": "bad thing", "code": None}})
    assert (err.cache_state, err.error, err.complete) == ("unverified", "server_error", False)
    for junk in ("text", 5, None, {"usage": usage(cached=0)}):
        ev = evidence_from_response(junk)
        assert ev.cache_state == "unverified" and not ev.complete and ev.output_sha256 is None


def test_evidence_round_trips_through_its_record() -> None:
    ev = evidence_from_response(
        chat_chunks(use=usage(cached=7), runtime={"token_sha": SHA_A}), done=True, wall_s=1
    )
    assert CallEvidence.from_dict(ev.to_dict()) == ev
    assert isinstance(ev.wall_s, float)


def test_the_callers_view_of_a_reply() -> None:
    streamed = ReplyReader()
    for frame in chat_chunks(["Hel", "lo"], reasoning=["think"], use=usage(cached=7)):
        streamed.take_frame(frame)
    streamed.end_stream(done=True, malformed=None)
    reply = streamed.view()
    assert reply["content"] == "Hello" and reply["reasoning"] == "think"
    assert reply["finish_reason"] == "stop" and reply["usage"] == usage(cached=7)
    assert evidence_from_response(streamed).cache_state == "reused"
    flat = ReplyReader()
    flat.take_response(response(usage(cached=7)))
    assert flat.view()["content"] == "Hello" and flat.view()["reasoning"] is None


# ------------------------------------------------------------------ counters


def test_counter_deltas() -> None:
    before = CacheCounters(hits=3, misses=1, stores=4, prompt_tokens_saved=100)
    after = CacheCounters(hits=5, misses=1, stores=5, prompt_tokens_saved=None)
    d = counter_deltas(before, after)
    assert (d["hits"], d["misses"], d["stores"]) == (2, 0, 1)
    assert d["prompt_tokens_saved"] is None and d["evicted"] is None


def test_interleaving() -> None:
    before = CacheCounters(hits=3, misses=1)
    assert not is_interleaved(before, CacheCounters(hits=4, misses=2), calls=2)
    assert not is_interleaved(before, CacheCounters(hits=3, misses=1), calls=2)  # counter lag
    assert is_interleaved(before, CacheCounters(hits=5, misses=2), calls=2)
    assert is_interleaved(before, CacheCounters(hits=0, misses=0), calls=2)  # restarted
    assert is_interleaved(before, CacheCounters(hits=4), calls=2)  # cannot vouch


def test_sse_split_at_every_byte_even_inside_a_utf8_character() -> None:
    frames = [
        {"choices": [{"index": 0, "delta": {"content": "café 🚀"}, "finish_reason": None}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 7},
            },
        },
    ]
    body = (
        b"".join(
            b"data: " + json.dumps(f, ensure_ascii=False).encode() + b"\r\n\r\n" for f in frames
        )
        + b"data: [DONE]\r\n\r\n"
    )
    assert max(body) > 127  # really non-ASCII on the wire
    whole = evidence_from_response(body)
    parser = SSEParser()
    for i in range(len(body)):
        parser.feed(body[i : i + 1])
    split = evidence_from_response(parser.finish())
    assert whole.cache_state == split.cache_state == "reused"
    assert whole.output_sha256 == split.output_sha256 is not None
    assert whole.output_sha256 == output_digest("café 🚀".encode(), b"")
