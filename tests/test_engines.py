"""The engines users run (#25): each engine's recorded replies parse to the counts their
sources document, detection reads what the server answers, and the evidence rules hold per
engine shape (property tests)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.errors import ArgumentTypeError
from prefixreg.core.jsonio import loads
from prefixreg.registry.store import Registry
from prefixreg.server import engines
from prefixreg.server.counters import parse_prometheus
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.worker import Worker
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
SGLANG_ON = engines.zero_rule("sglang", {"enable_cache_report": True})


def fixture(name: str) -> Any:
    raw = (FIXTURES / name).read_bytes()
    return raw if name.endswith(".txt") else loads(raw)


def counts(name: str, *, done: bool = False, rule: str | None = None) -> tuple[object, ...]:
    body = fixture(name)
    if done:  # a stream's final usage chunk, as the last frame of a finished stream
        body = [body]
    ev = evidence_from_response(body, done=done or None, zero_rule=rule)
    return ev.cache_state, ev.prompt_tokens, ev.cached_tokens


# ------------------------------------------------------------- the fixtures' documented counts


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vllm/chat.details-on.json", ("reused", 64, 48)),
        ("vllm/chat.details-on.local-external.json", ("reused", 64, 48)),
        ("vllm/chat.details-on.cold-zero.json", ("cold", 64, 0)),
        # before #45171 a cold call drops its zero: the same bytes as the flag off
        ("vllm/chat.details-on.cold-omitted.json", ("unverified", 64, None)),
        ("vllm/chat.details-off.json", ("unverified", 64, None)),
        ("sglang/chat.cache-report-on.json", ("reused", 64, 63)),
        ("sglang/chat.cache-report-on.cold.json", ("unverified", 64, None)),
        ("sglang/chat.cache-report-off.json", ("unverified", 64, None)),
        ("trtllm/chat.json", ("reused", 64, 32)),
        ("trtllm/chat.cold.json", ("cold", 64, 0)),
        ("ollama/openai-chat.json", ("reused", 64, 63)),
        ("ollama/openai-chat.cold.json", ("cold", 64, 0)),
        ("ollama/openai-chat.pre-0.33.3.json", ("unverified", 64, None)),
    ],
)
def test_openai_replies_parse_to_their_documented_counts(
    name: str, expected: tuple[object, ...]
) -> None:
    assert counts(name) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vllm/stream-final.details-on.json", ("reused", 64, 48)),
        ("vllm/stream-final.details-on.cold-zero.json", ("cold", 64, 0)),
        ("vllm/stream-final.details-on.cold-omitted.json", ("unverified", 64, None)),
        ("vllm/stream-final.details-off.json", ("unverified", 64, None)),
        ("sglang/stream-final.cache-report-on.json", ("reused", 64, 63)),
        ("sglang/stream-final.cache-report-off.json", ("unverified", 64, None)),
        ("trtllm/stream-final.json", ("reused", 64, 32)),
        ("trtllm/stream-final.cold.json", ("cold", 64, 0)),
        ("ollama/openai-stream-final.json", ("reused", 64, 63)),
        ("ollama/openai-stream-final.pre-0.33.3.json", ("unverified", 64, None)),
    ],
)
def test_stream_usage_chunks_parse_to_their_documented_counts(
    name: str, expected: tuple[object, ...]
) -> None:
    assert counts(name, done=True) == expected
    state, *_ = counts(name)  # the chunk alone is never a finished call
    assert state == "unverified"


def test_a_whole_vllm_stream_parses_to_its_count() -> None:
    ev = evidence_from_response(fixture("vllm/stream.details-on.sse.txt"))
    assert (ev.cache_state, ev.prompt_tokens, ev.cached_tokens, ev.complete) == (
        "reused",
        64,
        48,
        True,
    )


def test_sglang_null_is_zero_only_with_its_flag_read_on() -> None:
    on = engines.sglang_info(fixture("sglang/server_info.json"))
    off = engines.sglang_info(fixture("sglang/server_info.flags-off.json"))
    assert on is not None and off is not None
    rule_on = engines.zero_rule("sglang", engines.sglang_identity(on, None))
    rule_off = engines.zero_rule("sglang", engines.sglang_identity(off, None))
    assert rule_on == SGLANG_ON and rule_off is None
    cold = "sglang/chat.cache-report-on.cold.json"
    assert counts(cold, rule=rule_on) == ("cold", 64, 0)
    assert counts("sglang/stream-final.cache-report-on.cold.json", done=True, rule=rule_on) == (
        "cold",
        64,
        0,
    )
    assert counts(cold, rule=rule_off) == ("unverified", 64, None)
    # the rule never overrides a count that was sent
    assert counts("sglang/chat.cache-report-on.json", rule=rule_on) == ("reused", 64, 63)
    ev = evidence_from_response(fixture(cold), zero_rule=rule_on)
    assert ev.cached_source == SGLANG_ON
    # no other engine has such a rule, whatever its flags say
    for profile in ("vllm", "trtllm", "ollama", "halogen", "llamacpp", "generic"):
        assert engines.zero_rule(profile, {"enable_cache_report": True}) is None


@pytest.mark.parametrize(
    ("engine", "name", "prompt", "cached"),
    [
        ("vllm", "vllm/metrics.txt", 128, 48),
        ("sglang", "sglang/metrics.txt", 128, 63),
        ("trtllm", "trtllm/prometheus-metrics.txt", 128, 32),
    ],
)
def test_prometheus_counters_parse(engine: str, name: str, prompt: int, cached: int) -> None:
    samples, names = parse_prometheus(fixture(name)), engines.METRICS[engine]
    assert engines.metric_total(samples, names.prompt) == prompt
    assert engines.metric_total(samples, names.cached) == cached
    assert engines.metric_total(samples, "nothing_total") is None


def test_detection_signals_per_fixture() -> None:
    assert engines.owned_by(fixture("vllm/models.json")) == "vllm"
    assert engines.owned_by(fixture("trtllm/models.json")) == "trtllm"
    assert engines.owned_by(fixture("sglang/models.json")) == "sglang"
    # max_model_len alone (SGLang's card has it) is no vLLM card
    card = fixture("sglang/models.json")
    card["data"][0]["owned_by"] = "vllm"
    assert engines.owned_by(card) is None
    assert engines.ollama_version(fixture("ollama/version.json")) == "0.34.4"
    assert engines.ollama_reports("0.34.4") is True
    assert engines.ollama_reports("0.33.2") is False
    assert engines.ollama_reports("main") is None
    info: dict[str, Any] = fixture("sglang/server_info.json")
    assert engines.sglang_info(info) is info
    assert engines.sglang_info({**info, "enable_cache_report": "true"}) is None  # strict type
    assert engines.sglang_info(fixture("sglang/model_info.json")) is None


# ------------------------------------------------------------------ detection over real HTTP


def serve(srv: FakeServer, engine: str, *, flags_off: bool = False) -> None:
    json_routes = {
        "vllm": {"/version": "vllm/version.json", "/v1/models": "vllm/models.json"},
        "sglang": {
            "/server_info": f"sglang/server_info{'.flags-off' if flags_off else ''}.json",
            "/v1/models": "sglang/models.json",
            "/model_info": "sglang/model_info.json",
        },
        "trtllm": {
            "/version": "trtllm/version.json",
            "/v1/models": "trtllm/models.json",
            "/metrics": "trtllm/metrics.json",
        },
        "ollama": {
            "/api/version": "ollama/version.json",
            "/api/tags": "ollama/tags.json",
            "/api/ps": "ollama/ps.json",
        },
    }[engine]
    for route, name in json_routes.items():
        srv.route("GET", route, Reply(json=fixture(name)))
    if engine != "ollama":
        srv.route("GET", "/health", Reply(body=b""))
    else:
        srv.route("GET", "/", Reply(body=fixture("ollama/root.txt"), content_type="text/plain"))


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    with FakeServer() as srv:
        yield srv


@pytest.mark.parametrize("engine", engines.ENGINES)
def test_worker_detects_each_engine_from_its_answers(fake: FakeServer, engine: str) -> None:
    serve(fake, engine)
    with Worker(fake.url) as w:
        assert w.detect_profile() == engine
        build = w.server_build()
    assert build.profile == engine
    assert engines.zero_rule(build.profile, build.identity) == (
        SGLANG_ON if engine == "sglang" else None
    )
    assert not any(r.path.startswith("/slots") for r in fake.requests)


def test_sglang_identity_holds_its_flags(fake: FakeServer) -> None:
    serve(fake, "sglang")
    with Worker(fake.url) as w:
        on = w.server_build()
    with FakeServer() as other:
        serve(other, "sglang", flags_off=True)
        with Worker(other.url) as w:
            off = w.server_build()
    assert engines.zero_rule(off.profile, off.identity) is None
    assert on.identity["enable_cache_report"] is True and on.identity["version"] == "0.5.9"
    assert off.identity["enable_cache_report"] is False
    assert on.build_id != off.build_id  # a restart that turns reporting off is another build


def test_sglang_on_its_older_route_and_a_forced_profile(fake: FakeServer) -> None:
    fake.route("GET", "/get_server_info", Reply(json=fixture("sglang/server_info.json")))
    with Worker(fake.url) as w:
        assert w.detect_profile() == "sglang"
    with Worker(fake.url, profile="vllm") as w:
        forced = w.server_build()
    assert forced.profile == "vllm" and engines.zero_rule(forced.profile, forced.identity) is None


def test_a_port_is_no_signal(fake: FakeServer) -> None:
    """Nothing answers like an engine: generic, whatever the port (30000, 8000, 11434)."""
    fake.route("GET", "/v1/models", Reply(json={"data": [{"id": "m", "owned_by": "someone"}]}))
    with Worker(fake.url) as w:
        assert w.detect_profile() == "generic"


def test_a_chat_reads_sglang_null_by_the_build_flag(fake: FakeServer) -> None:
    serve(fake, "sglang")
    cold = fixture("sglang/chat.cache-report-on.cold.json")
    fake.route("POST", "/v1/chat/completions", Reply(json=cold))
    with Worker(fake.url) as w:
        _, before = w.chat("You are terse.", "hi", stream=False)
        build = w.server_build()
        _, after = w.chat("You are terse.", "hi", stream=False, build=build)
        _, again = w.chat("You are terse.", "hi", stream=False)
    assert before.cache_state == "unverified"  # no build given: the flag is not known
    assert (after.cache_state, after.cached_tokens) == ("cold", 0)
    assert again.cache_state == "unverified"  # the client keeps no build between calls


def test_a_pool_reads_a_direct_call_by_the_build_its_survey_read(
    fake: FakeServer, tmp_path: Path
) -> None:
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.pool.spec import Assignment, pool_spec, save_placement

    serve(fake, "sglang")
    fake.route(
        "POST", "/v1/chat/completions", Reply(json=fixture("sglang/chat.cache-report-on.cold.json"))
    )
    reg = Registry(tmp_path / "reg")
    sha = reg.add("You are terse.")
    spec = pool_spec([fake.url], env={})
    with Pool(spec, reg) as pool:
        save_placement(pool.placement_path, spec, [Assignment(sha, fake.url, sha)])
    with Pool(spec, reg) as pool:
        _, unread = pool.chat(sha, "hi", stream=False)  # no survey yet: no build to read it by
        (state,) = pool.survey()
        _, read = pool.chat(sha, "hi", stream=False)
    assert unread.cache_state == "unverified"
    assert state.build is not None and pool.builds == {fake.url: state.build}
    assert (read.cache_state, read.cached_tokens) == ("cold", 0)


def test_a_build_that_is_no_server_build_is_refused_before_sending(fake: FakeServer) -> None:
    wrong: Any = {"profile": "sglang"}  # callers outside the type checker
    with Worker(fake.url) as w:
        with pytest.raises(ArgumentTypeError, match=r"chat\(\): build is a ServerBuild"):
            w.chat("s", "hi", build=wrong)
        with pytest.raises(ArgumentTypeError, match=r"complete\(\): build is a ServerBuild"):
            w.complete("hi", build=wrong)
    assert fake.requests == []


# ----------------------------------------------------------------- evidence per engine shape

SHAPES = {
    "vllm": "vllm/chat.details-on.json",
    "sglang": "sglang/chat.cache-report-on.json",
    "trtllm": "trtllm/chat.json",
    "ollama": "ollama/openai-chat.json",
}


def shaped(engine: str, prompt: int, details: object, *, drop: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = copy.deepcopy(fixture(SHAPES[engine]))
    body["usage"]["prompt_tokens"] = prompt
    if drop:
        del body["usage"]["prompt_tokens_details"]
    else:
        body["usage"]["prompt_tokens_details"] = details
    return body


engine_names = st.sampled_from(engines.ENGINES)
rules = st.sampled_from([None, SGLANG_ON])


@given(engine_names, st.integers(0, 10**6), st.data(), rules)
def test_a_sent_count_is_read_as_sent(engine: str, prompt: int, data: Any, rule: Any) -> None:
    cached = data.draw(st.integers(0, prompt))
    ev = evidence_from_response(shaped(engine, prompt, {"cached_tokens": cached}), zero_rule=rule)
    assert ev.cached_tokens == cached and ev.prompt_tokens == prompt
    assert ev.cache_state == ("cold" if cached == 0 else "reused")


@given(engine_names, st.integers(0, 10**6), st.booleans())
def test_a_missing_count_is_never_zero_without_the_rule(
    engine: str, prompt: int, drop: bool
) -> None:
    ev = evidence_from_response(shaped(engine, prompt, None, drop=drop))
    assert ev.cache_state == "unverified" and ev.cached_tokens is None
    ruled = evidence_from_response(shaped(engine, prompt, None, drop=drop), zero_rule=SGLANG_ON)
    assert (ruled.cache_state, ruled.cached_tokens, ruled.cached_source) == (
        "cold",
        0,
        SGLANG_ON,
    )


bad_counts = st.one_of(
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.booleans(),
    st.integers(max_value=-1),
    st.lists(st.integers(), max_size=2),
)


@given(engine_names, st.integers(0, 1000), bad_counts, rules)
def test_a_malformed_count_stays_unverified(
    engine: str, prompt: int, bad: object, rule: Any
) -> None:
    for details in ({"cached_tokens": bad}, bad, {}):
        if details is None:
            continue
        ev = evidence_from_response(shaped(engine, prompt, details), zero_rule=rule)
        assert ev.cache_state == "unverified" and ev.cached_tokens is None


@given(engine_names, st.integers(0, 1000), st.integers(1, 1000))
def test_more_cached_than_prompt_is_unverified(engine: str, prompt: int, over: int) -> None:
    ev = evidence_from_response(shaped(engine, prompt, {"cached_tokens": prompt + over}))
    assert ev.cache_state == "unverified"


def test_zero_rule_is_a_string_or_none() -> None:
    from prefixreg.core.errors import UsageError

    with pytest.raises(UsageError):
        evidence_from_response(fixture(SHAPES["sglang"]), zero_rule=True)  # type: ignore[arg-type]


@given(
    st.sampled_from(sorted(engines.METRICS)),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 10**4),
    st.integers(0, 10**4),
    st.integers(0, 10**4),
)
def test_the_counter_window_is_attributed_only_to_a_call_alone(
    engine: str, p0: int, c0: int, prompt: int, cached: int, foreign: int
) -> None:
    m = engines.METRICS[engine]
    before = {f'{m.prompt}{{model_name="x"}}': float(p0), m.cached: float(c0)}
    after = {
        f'{m.prompt}{{model_name="x"}}': float(p0 + prompt + foreign),
        m.cached: float(c0 + cached),
    }
    seen = engines.window(m, before, after, prompt)
    assert seen is not None and seen["source"] == m.path
    assert (seen["prompt_tokens"], seen["cached_tokens"]) == (prompt + foreign, cached)
    assert seen["attributed"] is (foreign == 0)
    assert engines.window(m, before, {}, prompt) is None
    assert engines.window(m, None, after, prompt) is None
    assert engines.window(m, before, after, None)["attributed"] is False  # type: ignore[index]
    backwards = engines.window(m, after, before, prompt)  # a restart: never attributed
    assert backwards is not None and (backwards["attributed"] is False or prompt + foreign == 0)


def test_the_zero_rule_needs_a_usage_to_read() -> None:
    body = fixture(SHAPES["sglang"])
    del body["usage"]
    ev = evidence_from_response(body, zero_rule=SGLANG_ON)
    assert (ev.cache_state, ev.cached_tokens, ev.cached_source) == ("unverified", None, None)
    chunks = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]}]
    ev = evidence_from_response(chunks, done=True, zero_rule=SGLANG_ON)  # no usage chunk
    assert (ev.cache_state, ev.cached_tokens, ev.reason) == ("unverified", None, "usage missing")


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/server_info", {"enable_cache_report": True, "enable_metrics": True}),  # no version
        (
            "/server_info",
            {
                "version": "0.5.9",
                "enable_cache_report": 1,
                "enable_metrics": True,
                "disable_radix_cache": False,
            },
        ),
        ("/get_server_info", ["enable_cache_report"]),
        ("/api/version", {"version": 34}),
        ("/api/version", {"version": "0.34.4", "extra": True}),
    ],
)
def test_a_lying_or_malformed_signal_is_not_the_engine(
    fake: FakeServer, route: str, body: object
) -> None:
    fake.route("GET", route, Reply(json=body))
    cold = fixture("sglang/chat.cache-report-on.cold.json")
    fake.route("POST", "/v1/chat/completions", Reply(json=cold))
    with Worker(fake.url) as w:
        build = w.server_build()
        _, ev = w.chat("You are terse.", "hi", stream=False, build=build)
    assert build.profile == "generic" and engines.zero_rule(build.profile, build.identity) is None
    assert ev.cache_state == "unverified"  # a null never becomes 0 on a claim not proven


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sglang/generate.json", ("reused", 64, 63, "meta_info.cached_tokens")),
        ("sglang/generate.cold.json", ("cold", 64, 0, "meta_info.cached_tokens")),
        ("ollama/chat.json", ("reused", 64, 63, "prompt_eval_cached_count")),
        ("ollama/chat.cold.json", ("cold", 64, 0, "prompt_eval_cached_count")),
        ("ollama/chat.stream-final.json", ("reused", 64, 63, "prompt_eval_cached_count")),
        ("ollama/chat.pre-0.33.3.json", ("unverified", 64, None, None)),
    ],
)
def test_native_replies_are_evidence(name: str, expected: tuple[object, ...]) -> None:
    ev = evidence_from_response(fixture(name), zero_rule=SGLANG_ON)  # no rule reaches them
    assert (ev.cache_state, ev.prompt_tokens, ev.cached_tokens, ev.cached_source) == expected
    assert ev.complete and ev.output_sha256 is not None


def test_a_native_reply_not_finished_or_malformed_is_unverified() -> None:
    line = fixture("ollama/chat.json") | {"done": False}  # a stream line before the last
    assert evidence_from_response(line).cache_state == "unverified"
    gen = fixture("sglang/generate.json")
    for bad in (63.0, "63", True, -1, None):
        body = copy.deepcopy(gen)
        body["meta_info"]["cached_tokens"] = bad
        ev = evidence_from_response(body)
        assert ev.cache_state == "unverified" and ev.cached_tokens is None, bad
    body = copy.deepcopy(gen)
    body["meta_info"]["cached_tokens"] = 65  # more than the prompt
    assert evidence_from_response(body).cache_state == "unverified"


@pytest.mark.parametrize(
    ("profile", "identity", "level", "named"),
    [
        ("sglang", {"enable_cache_report": False, "enable_metrics": False}, "warn",
         ["--enable-cache-report", "--enable-metrics"]),
        ("sglang", {"enable_cache_report": True, "enable_metrics": False}, "info",
         ["--enable-metrics"]),
        ("trtllm", {"version": "1.3.0rc23"}, "info", ["return_perf_metrics: true"]),
        ("ollama", {"version": "0.33.2"}, "warn", ["0.33.3", "--cache-ram", "8 GiB"]),
        ("ollama", {"version": "0.34.4"}, "info", ["--cache-ram"]),
        ("vllm", {"version": "0.23.0"}, "info", ["--enable-prompt-tokens-details"]),
    ],
)  # fmt: skip
def test_doctor_names_each_engines_flag(
    profile: str, identity: dict[str, Any], level: str, named: list[str]
) -> None:
    from prefixreg.core.records import ServerBuild
    from prefixreg.verbs.doctor.engines import diagnose_engine
    from prefixreg.verbs.doctor.findings import Diagnosis

    d = Diagnosis(profile=profile)
    diagnose_engine(d, ServerBuild(profile=profile, identity=identity), None, missing=False)
    text = " ".join(f.text for f in d.findings)
    assert all(flag in text for flag in named), text
    assert ("warn" in {f.level for f in d.findings}) is (level == "warn")
    assert "counters" not in d.numbers  # no counters read: none said to be 0


def test_a_counter_that_jumps_past_exact_integers_is_no_witness(
    fake: FakeServer, tmp_path: Path
) -> None:
    # A vLLM whose prompt counter leaps from 0 to 1e300 within one call: no window is
    # recorded (a record cannot hold it, and it is no count), and warm still judges the call
    # by its own count, with no traceback.
    serve(fake, "vllm")
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    sent: list[Request] = []

    def chat(request: Request) -> Reply:
        sent.append(request)
        return Reply(json=fixture(SHAPES["vllm"]))

    def metrics(_r: Request) -> Reply:
        total = "1e300" if sent else "0"  # leaps with the first call
        return Reply(body=f"{names[0]} {total}\n{names[1]} 0\n".encode())

    fake.route("POST", "/v1/chat/completions", chat)
    fake.route("GET", "/metrics", metrics)
    reg = Registry(tmp_path / "reg")
    reg.add("You are terse.\n" * 40, name="p")
    res = run_cli("warm", "p", "--worker", fake.url, "--registry", str(reg.root), "--json")
    assert b"Traceback" not in res.stderr and res.returncode in (0, 1, 4), res.stderr
    calls = orjson.loads(res.stdout)["body"]["calls"]
    assert calls[0].get("counter_window") is None, calls[0]
