"""Property: whatever bytes a server streams, evidence is cold, reused or unverified, and
cold/reused only with a completed stream and valid counts (issue 13)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.errors import PrefixregError, UsageError
from prefixreg.core.records import CacheCounters, CallEvidence
from prefixreg.server.activity import PromptCounter, StoresCounter
from prefixreg.server.counters import (
    counter_deltas,
    is_interleaved,
    lru_survival_stores,
    parse_prometheus,
)
from prefixreg.server.engines import (
    generic_identity,
    halogen_identity,
    is_halogen,
    llamacpp_identity,
    vllm_identity,
)
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.sse import SSEParser, parse_sse
from prefixreg.server.transport import check_max_bytes, check_seconds, display_url
from prefixreg.server.worker import Worker
from tests.fakeserver import FakeServer, Reply, Request, sse_frames
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


# ------------------------------------------------------------------ the typed boundary (#22)

URL = "http://127.0.0.1:9"
WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([10**400, -(10**400), 2**64, -1, 0]),  # 10**400 overflows a float
    st.floats(),  # NaN and both infinities too
    st.text(max_size=6),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2),
    st.binary(max_size=6),
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=3),
    st.dictionaries(st.text(max_size=3), st.none() | st.integers() | st.floats(), max_size=2),
    st.sampled_from(
        [
            object(),
            {1: 2},
            {"role": 5},
            [{"role": "user", "content": object()}],
            [{"role": "user", "content": "\ud800"}],
            [[[[]]]] * 2,
            "http://user:secret@exa mple.com:99999",
            "http://h\n:80",
            "ftp://h/",
            {"x-routing-key": "a\r\nb"},
            {"bad name": "v"},
            frozenset({"x"}),
            CacheCounters(),
        ]
    ),
)


WORKER_ARGS = ("api_key", "timeout", "read_timeout", "max_bytes", "profile", "model", "transport")


def _worker_with(name: str) -> Callable[[Any], object]:
    return lambda value: Worker(URL, **{name: value}).close()


def _calls(w: Worker) -> dict[str, Callable[[Any], object]]:
    """Every public entry point of `prefixreg.server`, one argument at a time made wrong."""
    ok = CacheCounters(hits=1, misses=1)
    return {
        "Worker(url)": lambda v: Worker(v).close(),
        **{f"Worker({name})": _worker_with(name) for name in WORKER_ARGS},
        "chat(prefix)": lambda v: w.chat(v, "t"),
        "chat(tail)": lambda v: w.chat("system", v),
        "chat(history)": lambda v: w.chat("system", history=v),
        "chat(tools)": lambda v: w.chat("system", "t", tools=v),
        "chat(stream)": lambda v: w.chat("system", "t", stream=v),
        "chat(headers)": lambda v: w.chat("system", "t", headers=v),
        "chat(max_tokens)": lambda v: w.chat("system", "t", max_tokens=v),
        "chat(stream_options)": lambda v: w.chat("system", "t", stream_options=v),
        "post_json(path)": lambda v: w.post_json(v, {}, seconds=1),
        "post_json(body)": lambda v: w.post_json("/x", v, seconds=1),
        "post_json(seconds)": lambda v: w.post_json("/x", {}, seconds=v),
        "post_json(missing)": lambda v: w.post_json("/x", {}, seconds=1, missing=v),
        "template_tokens": lambda v: w.template_tokens(v),
        "evidence(done)": lambda v: evidence_from_response({}, done=v),
        "evidence(wall_s)": lambda v: evidence_from_response({}, wall_s=v),
        "evidence(ttft_s)": lambda v: evidence_from_response({}, ttft_s=v),
        "parse_sse": parse_sse,
        "SSEParser.feed": lambda v: SSEParser().feed(v),
        "counter_deltas": lambda v: counter_deltas(v, ok),
        "is_interleaved": lambda v: is_interleaved(ok, ok, v),
        "lru_survival_stores": lambda v: lru_survival_stores(v, 2),
        "parse_prometheus": parse_prometheus,
        "is_halogen": is_halogen,
        "halogen_identity": halogen_identity,
        "llamacpp_identity": llamacpp_identity,
        "generic_identity": generic_identity,
        "vllm_identity": lambda v: vllm_identity(v, v),
        "StoresCounter": StoresCounter,
        "StoresCounter.saw": lambda v: StoresCounter(w).saw(v),
        "PromptCounter": lambda v: PromptCounter(w, v),
        "check_seconds": lambda v: check_seconds("timeout", v),
        "check_max_bytes": check_max_bytes,
        "display_url": display_url,
    }


@pytest.fixture(scope="module")
def api_worker() -> Iterator[Worker]:
    use = {
        "prompt_tokens": 9,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    frames = [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": use}]
    with FakeServer() as srv:
        srv.route("POST", "/v1/chat/completions", Reply(sse=sse_frames(frames)))
        srv.route("GET", "/v1/models", Reply(json={"data": [{"id": "m"}]}))
        with Worker(srv.url, timeout=5) as w:
            yield w


NAMES = sorted(_calls(Worker(URL)))


@bounded(600)
@given(name=st.sampled_from(NAMES), value=WRONG)
def test_the_server_api_raises_only_its_own_errors(
    api_worker: Worker, name: str, value: Any
) -> None:
    """Wrong types and values come out as `UsageError` (or, for a reply, unverified
    evidence): never a raw TypeError, ValueError, AttributeError or OverflowError."""
    try:
        _calls(api_worker)[name](value)
    except UsageError as exc:  # one line; a URL's user info (a password) is never echoed
        assert "\n" not in str(exc)
        assert "secret" not in str(exc) or not name.startswith(("Worker(url)", "display"))
    except PrefixregError as exc:  # a call that went out: the worker's own error tree
        assert name.startswith(("chat", "post_json", "template")), exc


@bounded(300)
@given(value=WRONG)
def test_any_reply_object_is_evidence_never_an_exception(value: Any) -> None:
    """`evidence_from_response` reads anything it is given: what it cannot read is a
    malformed reply, unverified with a reason (the documented result, not an error)."""
    ev = evidence_from_response(value)
    assert ev.cache_state == "unverified" and ev.reason and not ev.complete
    assert CallEvidence.from_dict(ev.to_dict()) == ev
