"""Issue 13's verdict rows: every verdict says exactly what the server proved.

Real loopback servers only: the simulator, `tests/fakeserver.py`, and a fault proxy in front
of the simulator that drops what a real server drops (a zero cached count on cold calls).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from prefixreg.core.errors import UsageError
from prefixreg.core.judge import TEMPLATE_ALLOWANCE, allowance, judge
from prefixreg.core.records import CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.probe.options import ProbeOptions
from prefixreg.verbs.probe.run import run_probe
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request, sse_frames
from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH

CHAT = "/v1/chat/completions"
SYSTEM = "You are a careful coding agent. Follow the repository's conventions.\n" * 40
TINY = "Be brief. Answer in one line. Cite files.\n"  # 42 bytes


def _usage(prompt: int, cached: int | None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": 1,
        "total_tokens": prompt + 1,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _chat_reply(usage: dict[str, Any], timings: dict[str, Any] | None = None) -> Reply:
    final: dict[str, Any] = {"choices": [], "usage": usage}
    if timings is not None:
        final["timings"] = timings
    frames: list[Any] = [
        {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        final,
    ]
    return Reply(sse=sse_frames(frames))


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    r = Registry(tmp_path / "reg")
    r.add(SYSTEM, name="loop")
    r.add(TINY, name="tiny")
    return r


# -- a prefix is resumed only when the cached count covers its span ------------------------


def test_tiny_prefix_with_one_cached_token_is_not_resumed(reg: Registry) -> None:
    assert len(TINY.encode()) == 42
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, _chat_reply(_usage(45, 1)))
        res = run_cli("warm", "tiny", "--worker", srv.url, "--registry", str(reg.root), "--json")
    assert res.returncode == 1, res.stderr
    body = orjson.loads(res.stdout)["body"]
    assert body["verdict"] == "partial"
    assert body["cached_tokens"] == 1 and body["span_tokens"] >= 2


@pytest.mark.parametrize("alignment", [0, 1, 64, 2048])
def test_span_allowance_scales_with_the_span_and_never_exceeds_it(alignment: int) -> None:
    for span in itertools.chain(range(200), range(200, 20_000, 97)):
        given = allowance(span, alignment)
        assert 0 <= given <= span // 2  # never the whole span, never most of it
        assert given <= alignment + TEMPLATE_ALLOWANCE
    # Large spans get the whole alignment + template allowance.
    assert allowance(100_000, alignment) == alignment + TEMPLATE_ALLOWANCE


@pytest.mark.parametrize(
    ("prefix_bytes", "prompt", "cached", "verdict"),
    [
        (42, 45, 1, "partial"),  # the row
        (42, 45, 26, "resumed"),  # Flash's prompt-19 on a tiny prefix covers its span
        (10_000, 2593, 2574, "resumed"),
        (10_000, 2593, 9, "partial"),
        (10_000, 2593, 1000, "partial"),
    ],
)
def test_judge_resume_by_coverage(
    prefix_bytes: int, prompt: int, cached: int, verdict: str
) -> None:
    ev = CallEvidence(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=1,
        cached_source="usage.prompt_tokens_details.cached_tokens",
        cache_state="reused",
        complete=True,
    )
    assert judge(ev, head_bytes=prefix_bytes, rest_bytes=55).verdict == verdict


# -- survival with an unverified trial is unverified ----------------------------------------


class ZeroDroppingProxy:
    """Forwards to the simulator, dropping `timings.cache_n` when it is 0: a server that
    omits a zero count on cold calls (Halogen does). Cold calls then read unverified."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.client = httpx.Client(base_url=upstream, timeout=60)
        self.fake = FakeServer()
        for method, path in (
            ("GET", "/health"),
            ("GET", "/cache"),
            ("GET", "/v1/models"),
            ("POST", CHAT),
        ):
            self.fake.route(method, path, self._forward)

    def _forward(self, request: Request) -> Reply:
        headers = {k: v for k, v in request.headers.items() if k in ("content-type",)}
        got = self.client.request(
            request.method, request.path, content=request.body or None, headers=headers
        )
        ctype = got.headers.get("content-type", "")
        if "event-stream" not in ctype:
            return Reply(status=got.status_code, body=got.content, content_type=ctype or None)
        pieces = []
        for event in got.content.split(b"\n\n"):
            if event.startswith(b"data: {"):
                frame = orjson.loads(event[6:])
                timings = frame.get("timings")
                if isinstance(timings, dict) and timings.get("cache_n") == 0:
                    del timings["cache_n"]
                event = b"data: " + orjson.dumps(frame)
            if event:
                pieces.append(event + b"\n\n")
        return Reply(status=got.status_code, sse=pieces)

    def __enter__(self) -> ZeroDroppingProxy:
        self.fake.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.__exit__(None, None, None)
        self.client.close()

    @property
    def url(self) -> str:
        return self.fake.url


@pytest.fixture
def zero_dropping() -> Iterator[ZeroDroppingProxy]:
    with SimServer(SimConfig(speed=5000)) as sim, ZeroDroppingProxy(sim.url) as proxy:
        yield proxy


def test_survival_with_an_unverified_trial_is_unverified_never_a_number(
    zero_dropping: ZeroDroppingProxy, reg: Registry
) -> None:
    res = run_cli(
        *("probe", "--worker", zero_dropping.url, "--registry", str(reg.root)),
        *("--sizes", "4k", "--foreign", "2", "--survival", "--json"),
    )
    assert res.returncode == 4, res.stderr
    receipt = orjson.loads(res.stdout)
    assert receipt["survival"] is None
    assert receipt["survival_state"] == "unverified"
    trials = receipt["survival_trials"]
    assert trials and trials[-1]["survived"] is None  # the eviction the server did not prove
    assert all(t["survived"] is not False for t in trials)  # never counted as a failure
    assert receipt["outcome"] == "unverified"
    follows = " ".join(receipt["follows"])
    assert "Survival is unverified" in follows and "survives" not in follows
    md = Path(receipt["md_path"]).read_text()
    assert "- survival: unverified" in md


# -- a probe whose counter checks are all n/a is unverified ---------------------------------


def test_probe_with_every_check_n_a_is_unverified(reg: Registry) -> None:
    # /cache without hits/misses: no window can be vouched for, nothing is full, no refused
    # counter, one size: every check is n/a although the server claims /cache.
    blind = {"entries": 3, "max_entries": 8, "stores": 7}
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=blind))
        srv.route("POST", CHAT, _chat_reply(_usage(1000, 990)))
        res = run_cli(
            *("probe", "--worker", srv.url, "--registry", str(reg.root)),
            *("--sizes", "2k", "--foreign", "1", "--json"),
        )
    assert res.returncode == 4, res.stderr
    receipt = orjson.loads(res.stdout)
    assert {c["per_call"] for c in receipt["checks"]} == {"n/a"}
    assert receipt["outcome"] == "unverified"
    assert any("counters are unverified" in line for line in receipt["follows"])


# -- warm names interleaving; show prefers clean measurements -------------------------------


def test_interleaved_warm_says_so_and_show_prefers_the_clean_measurement(reg: Registry) -> None:
    with FakeServer() as srv:  # static counters: a clean window
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, _chat_reply(_usage(1000, 981)))
        clean = run_cli("warm", "loop", "--worker", srv.url, "--registry", str(reg.root))
    assert clean.returncode == 0, clean.stderr
    assert b"not a clean measurement" not in clean.stdout
    reads = itertools.count()

    def busy_cache(_req: Request) -> Reply:
        # Foreign calls land between every two reads: hits move by 3 per window.
        n = next(reads)
        return Reply(json={**HALOGEN_CACHE, "hits": 5 + 3 * n, "misses": 2 + n})

    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", busy_cache)
        srv.route("POST", CHAT, _chat_reply(_usage(1000, None), {"cache_n": 0}))
        res = run_cli("warm", "loop", "--worker", srv.url, "--registry", str(reg.root), "--json")
        text = run_cli("warm", "loop", "--worker", srv.url, "--registry", str(reg.root))
    assert res.returncode == 1 and text.returncode == 1, res.stderr
    body = orjson.loads(res.stdout)["body"]
    assert body["verdict"] == "cold"
    assert body["interleaved"] is True and body["clean"] is False
    assert b"COLD \xe2\x80\x94 foreign calls interleaved; not a clean measurement" in text.stdout
    shown = run_cli("show", "loop", "--registry", str(reg.root))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.decode().splitlines()
    latest = lines[lines.index("latest on the newest measured build:") + 1]
    assert "resumed" in latest and "interleaved" not in latest
    assert shown.stdout.count(b"(interleaved: not a clean measurement)") == 2


# -- keepalive exits non-zero when no re-warm succeeded ------------------------------------


def test_keepalive_with_every_chat_call_failing_exits_5(reg: Registry) -> None:
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, Reply(status=500, json={"error": {"message": "boom"}}))
        res = run_cli(
            *("keepalive", "loop", "--worker", srv.url, "--registry", str(reg.root)),
            *("--duration", "1", "--poll", "0.05", "--json"),
        )
        posts = [r for r in srv.requests if r.method == "POST"]
    assert res.returncode == 5, (res.stdout, res.stderr)
    out = orjson.loads(res.stdout)
    assert out["rewarms"] == 0 and out["succeeded"] == 0 and out["errors"] >= 1
    assert len(posts) >= 1
    assert b"no re-warm succeeded" in res.stderr
    assert b"Traceback" not in res.stderr


# -- probe sizes are bounded before anything big is allocated -------------------------------


@pytest.mark.parametrize(
    "sizes", ["99999999999999999999k", "200000000", "4k,1e9", "\u0664k", "0", ""]
)
def test_absurd_probe_sizes_are_usage_errors_before_any_request(reg: Registry, sizes: str) -> None:
    with SimServer(SimConfig(speed=5000)) as sim:
        res = run_cli("probe", "--worker", sim.url, "--registry", str(reg.root), "--sizes", sizes)
        assert sim.requests() == []
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(b"error: ") and b"Traceback" not in res.stderr


def test_sizes_over_the_worker_context_are_usage_errors(reg: Registry) -> None:
    before = {o.sha256 for o in reg.list_objects()}
    with SimServer(SimConfig(speed=5000, slot_ctx=2048)) as sim:
        res = run_cli(
            "probe", "--worker", sim.url, "--registry", str(reg.root), "--sizes", "4k,64k"
        )
        foreign = run_cli(
            *("probe", "--worker", sim.url, "--registry", str(reg.root)),
            *("--sizes", "1k", "--foreign-chars", "9000000"),
        )
        posts = [r for r in sim.requests() if r.method == "POST"]
    for out in (res, foreign):
        assert out.returncode == 2, out.stderr
        assert b"context" in out.stderr and b"Traceback" not in out.stderr
    assert b"64,000" in res.stderr
    assert posts == []
    assert {o.sha256 for o in reg.list_objects()} == before  # no probe slice registered


@pytest.mark.parametrize(
    "options",
    [
        {"sizes": (10**12,)},
        {"sizes": ()},
        {"sizes": (4000,), "foreign_chars": 10**12},
        {"sizes": (True,)},
        {"sizes": (4000,), "legs": "most"},
    ],
)
def test_probe_api_refuses_absurd_options_before_any_request(
    reg: Registry, options: dict[str, Any]
) -> None:
    with SimServer(SimConfig(speed=5000)) as sim, Worker(sim.url) as w:
        with pytest.raises(UsageError):
            run_probe(reg, w, ProbeOptions(**options))
        assert [r for r in sim.requests() if r.method == "POST"] == []
