"""keepalive and the loop API against the simulator, with a foreign-traffic generator."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.core.errors import UsageError
from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.loop import LoopStats
from prefixreg.verbs.probe.options import ProbeOptions
from prefixreg.verbs.probe.run import run_probe
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request

SYSTEM = "You are the coding loop's agent. Read, change, test, report.\n" * 60
ROOT = Path(__file__).resolve().parent.parent


class Foreign:
    """A test helper that sends distinct foreign prompts (another tenant of the worker)."""

    def __init__(self, url: str) -> None:
        self.worker = Worker(url)
        self.sent = 0

    def send(self, n: int = 1) -> None:
        for _ in range(n):
            self.sent += 1
            self.worker.chat(f"Tenant {self.sent} has its own system prompt. " * 25, "hi")

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    registry.add(SYSTEM, name="loop")
    return registry


def run_loop(
    url: str, reg: Registry, keeper: KeepAlive | None, *, calls: int, every: int
) -> LoopStats:
    """The loop calls once every `every` foreign prompts; the keeper steps after each."""
    prefix = reg.get("loop")
    stats = LoopStats(head=prefix)
    foreign = Foreign(url)
    try:
        with Worker(url) as loop:
            for _ in range(calls):
                for _ in range(every):
                    foreign.send()
                    if keeper is not None:
                        keeper.step()
                tail = fresh_tail()
                _, ev = loop.chat(prefix, tail, max_tokens=4)
                stats.add(ev, body={"messages": prefix.messages(tail)})
                if keeper is not None:
                    keeper.touch(prefix.sha256)
                    keeper.step()
    finally:
        foreign.close()
    return stats


def test_loop_resumes_with_keepalive_and_not_without(sim: SimServer, reg: Registry) -> None:
    without = run_loop(sim.url, reg, None, calls=10, every=5)
    assert without.resumed <= 1, str(without)
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [reg.get("loop")], registry=reg)
        keeper.step()  # the first warm
        with_ka = run_loop(sim.url, reg, keeper, calls=10, every=5)
    assert with_ka.resumed >= 9, str(with_ka)
    frac = with_ka.resumed_fraction
    assert frac is not None and frac > 0.85
    s = keeper.summary
    assert s.rewarms >= 10 and s.resumed >= s.rewarms - 1
    assert s.tokens_spent < s.tokens_saved * 0.05
    assert keeper.budget.source.startswith("max_entries")
    kinds = {m.kind for m in reg.measurements()}
    assert kinds == {"keepalive"}


def test_a_cold_rewarm_tightens_a_budget_that_is_too_large(sim: SimServer, reg: Registry) -> None:
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [reg.get("loop")], budget=20)
        keeper.step()
        assert keeper.budget.limit == 20
        stats = run_loop(sim.url, reg, keeper, calls=6, every=10)
    assert keeper.summary.cold >= 1
    assert keeper.budget.stores is not None
    assert keeper.budget.stores < 20
    assert keeper.summary.budget_changes
    assert keeper.budget.source == "tightened after a cold re-warm"
    # After tightening, the later calls of the loop resume.
    assert stats.resumed >= 4, str(stats)
    assert keeper.history[-1].verdict == "resumed"


def test_budget_comes_from_the_latest_probe_survival(sim: SimServer, reg: Registry) -> None:
    with Worker(sim.url) as w:
        run_probe(reg, w, ProbeOptions(sizes=(4000,), foreign=9, survival=True))
        keeper = KeepAlive(w, [reg.get("loop")], registry=reg)
    assert keeper.budget.source.startswith("probe ")
    assert keeper.budget.stores == 3 * 2  # survival 3 prompts x 2 stores per prompt


def test_threaded_keeper_against_a_concurrent_foreign_generator(reg: Registry) -> None:
    stop = threading.Event()
    with SimServer(SimConfig(speed=2000)) as sim:

        def tenant() -> None:
            foreign = Foreign(sim.url)
            try:
                while not stop.is_set():
                    foreign.send()
                    time.sleep(0.01)
            finally:
                foreign.close()

        prefix = reg.get("loop")
        stats = LoopStats(head=prefix)
        with Worker(sim.url, timeout=2.0) as kw, KeepAlive(kw, [prefix], poll_s=0.002) as keeper:
            thread = threading.Thread(target=tenant, daemon=True)
            thread.start()
            try:
                with Worker(sim.url) as loop:
                    for _ in range(12):
                        time.sleep(0.08)  # several foreign prompts between the loop's calls
                        tail = fresh_tail()
                        _, ev = loop.chat(prefix, tail, max_tokens=4)
                        stats.add(ev, body={"messages": prefix.messages(tail)})
                        keeper.touch(prefix.sha256)
            finally:
                stop.set()
                thread.join(timeout=10)
    assert stats.resumed >= 10, str(stats)
    assert keeper.summary.rewarms > 0


def test_time_based_keepalive_without_cache_counters(reg: Registry) -> None:
    usage = {
        "prompt_tokens": 500,
        "completion_tokens": 1,
        "total_tokens": 501,
        "prompt_tokens_details": {"cached_tokens": 480},
    }
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": usage,
    }
    with FakeServer() as srv:
        srv.route("GET", "/v1/models", Reply(json={"data": [{"id": "m"}]}))
        srv.route("POST", "/v1/chat/completions", Reply(json=body))
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.get("loop")], interval_s=0.05)
            assert keeper.budget.stores is None
            assert keeper.budget.source.startswith("time interval")
            keeper.step()
            keeper.step()  # not due yet: interval not elapsed
            time.sleep(0.06)
            keeper.step()
        posts = [r for r in srv.requests if r.method == "POST"]
    assert len(posts) == 2
    assert keeper.summary.resumed == 2


def test_engine_busy_backs_off_and_repeated_errors_stop(reg: Registry) -> None:
    busy = {
        "error": {"message": "queue", "type": "server_error", "param": None, "code": "engine_busy"}
    }
    with FakeServer() as srv:
        srv.route("GET", "/v1/models", Reply(json={"data": [{"id": "m"}]}))
        srv.route("POST", "/v1/chat/completions", Reply(status=503, json=busy))
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.get("loop")], interval_s=0.001, poll_s=0.001)
            keeper.step()
            keeper.step()  # inside the back-off window: no request
            assert len([r for r in srv.requests if r.method == "POST"]) == 1
            summary = keeper.run(duration_s=5)
    assert summary.errors == 5
    assert summary.stopped_because is not None and "errors" in summary.stopped_because


def test_cli_keepalive_duration_json_and_ctrl_c(sim: SimServer, reg: Registry) -> None:
    res = run_cli(
        *("keepalive", "loop", "--worker", sim.url, "--registry", str(reg.root)),
        *("--duration", "0.3", "--poll", "0.05", "--json"),
    )
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["rewarms"] >= 1
    assert (out["budget"]["limit"], out["budget"]["unit"]) == (6, "stores")
    seen = len(sim.requests())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixreg",
            "keepalive",
            "loop",
            "--worker",
            sim.url,
            "--registry",
            str(reg.root),
            "--poll",
            "0.05",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60  # a loaded machine starts the CLI slowly
    while not any(r.method == "POST" for r in sim.requests()[seen:]):
        assert proc.poll() is None and time.monotonic() < deadline, "the keeper never warmed"
        time.sleep(0.05)
    time.sleep(0.3)  # running: its first re-warm sent
    proc.send_signal(signal.SIGINT)
    out_b, err_b = proc.communicate(timeout=30)
    assert proc.returncode == 0, err_b
    assert b"re-warms" in out_b
    assert b"Traceback" not in err_b
    bad = run_cli(
        "keepalive", "loop", "--worker", sim.url, "--registry", str(reg.root), "--duration", "soon"
    )
    assert bad.returncode == 2


def test_loopstats_counts_only_verified_tokens() -> None:
    from prefixreg.core.prefix import Prefix
    from prefixreg.core.records import CallEvidence

    head = Prefix.from_text("0" * 64, "system prompt " * 25)  # 350 bytes
    stats = LoopStats(head=head)
    reused = CallEvidence(
        prompt_tokens=100,
        cached_tokens=90,
        completion_tokens=5,
        cached_source="x",
        cache_state="reused",
        complete=True,
        wall_s=0.1,
    )
    # Judged with its request body: the head's share of 100 tokens is 92, and 90 cover it.
    stats.add(reused, body={"messages": head.messages("a tail of thirty bytes or so..")})
    stats.add(
        CallEvidence(
            prompt_tokens=100,
            cached_tokens=0,
            completion_tokens=5,
            cached_source="x",
            cache_state="cold",
            complete=True,
        )
    )
    stats.add(
        CallEvidence(
            prompt_tokens=None,
            cached_tokens=None,
            completion_tokens=None,
            cached_source=None,
            cache_state="unverified",
            complete=False,
        )
    )
    assert (stats.calls, stats.resumed, stats.cold, stats.unverified) == (3, 1, 1, 1)
    assert stats.resumed_fraction == 0.45
    assert orjson.loads(orjson.dumps(stats.to_dict()))["prompt_tokens"] == 200
    assert "3 calls" in str(stats)
    # Without its body the head's share of the prompt is unknown: unverified, never resumed
    # (a loop with history would otherwise read as partial), while its counts still count.
    stats.add(reused)
    assert (stats.calls, stats.resumed, stats.unverified) == (4, 1, 2)
    assert stats.prompt_tokens == 300 and stats.cached_tokens == 180


def test_example_agent_loop_resumes_its_prefix() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_loop.py")],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    calls = [line for line in lines if line.startswith("call ")]
    assert len(calls) == 6  # a frame with tools and a growing history (tests/test_frames.py)
    assert all(line.split()[2] == "resumed" for line in calls), calls


def _llamacpp_fake(srv: FakeServer, *, metrics: bool) -> list[int]:
    """A llama.cpp-shaped fake: /props with build_info, /slots off (501), /metrics on or
    off. Returns the cumulative prompt-token counter a chat (or the test) moves."""
    tokens = [0]
    props = {
        "build_info": "b0-unknown",
        "model_path": "/m.gguf",
        "total_slots": 2,
        "default_generation_settings": {"n_ctx": 8192},
        "chat_template": "{{ messages }}",
    }
    srv.route("GET", "/health", Reply(json={"status": "ok"}))
    srv.route("GET", "/props", Reply(json=props))
    srv.route("GET", "/slots", Reply(status=501, json={"error": {"message": "no slots"}}))

    def metrics_reply(_req: object) -> Reply:
        if not metrics:
            return Reply(status=501, json={"error": {"message": "no metrics"}})
        text = (
            "# TYPE llamacpp:prompt_tokens_total counter\n"
            f"llamacpp:prompt_tokens_total {tokens[0]}\n"
            "llamacpp:prompt_tokens_cached_total 0\n"
        )
        return Reply(body=text.encode(), content_type="text/plain")

    def chat_reply(_req: object) -> Reply:
        tokens[0] += 500
        usage = {
            "prompt_tokens": 500,
            "completion_tokens": 1,
            "total_tokens": 501,
            "prompt_tokens_details": {"cached_tokens": 480},
        }
        msg = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
        return Reply(json={"choices": [msg], "usage": usage})

    srv.route("GET", "/metrics", metrics_reply)
    srv.route("POST", "/v1/chat/completions", chat_reply)
    return tokens


def test_llamacpp_without_slots_counts_prompts_from_metrics(reg: Registry) -> None:
    with FakeServer() as srv:
        tokens = _llamacpp_fake(srv, metrics=True)
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.get("loop")], registry=reg)
            b = keeper.budget
            assert (b.unit, b.counter, b.prompts) == ("prompts", "/metrics", 1)
            assert b.source.startswith("default")
            keeper.step()  # the first warm; our own prompt is not counted against it
            keeper.step()  # nothing moved: not due
            assert len([r for r in srv.requests if r.method == "POST"]) == 1
            tokens[0] += 130  # a foreign prompt
            keeper.step()
        posts = [r for r in srv.requests if r.method == "POST"]
    assert len(posts) == 2
    assert [r.since for r in keeper.history] == [None, 1]
    (m, second) = sorted(reg.measurements(), key=lambda m: m.at)
    budget = m.body["budget"]
    assert m.body["since_prompts"] is None and second.body["since_prompts"] == 1
    assert isinstance(budget, dict) and budget["unit"] == "prompts"


def test_llamacpp_without_slots_or_metrics_falls_back_to_time(reg: Registry) -> None:
    with FakeServer() as srv:
        _llamacpp_fake(srv, metrics=False)
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.get("loop")], interval_s=30)
    assert keeper.build.profile == "llamacpp"
    assert keeper.budget.unit == "seconds" and keeper.budget.counter is None
    assert keeper.budget.source.startswith("time interval")


def test_an_idle_keeper_does_not_rewarm_without_foreign_traffic(reg: Registry) -> None:
    # A budget no larger than one prompt's stores used to make every poll due.
    with SimServer(SimConfig(speed=5000, max_entries=4)) as sim, Worker(sim.url) as w:
        keeper = KeepAlive(w, [reg.get("loop")])
        for _ in range(10):
            keeper.step()
        assert keeper.summary.rewarms == 1  # the first warm only
        Foreign(sim.url).send(1)
        keeper.step()
        assert keeper.summary.rewarms == 2


def test_several_kept_prefixes_neither_churn_nor_get_evicted(reg: Registry) -> None:
    shas = [reg.add(f"Kept prefix number {i}. " * 200) for i in range(2)]
    prefixes = [reg.get(s) for s in shas]
    with SimServer(SimConfig(speed=5000)) as sim, Worker(sim.url) as w:
        keeper = KeepAlive(w, prefixes)
        assert keeper.budget.limit == 4  # 8 entries less 2 for itself, 2 for the other
        for _ in range(20):
            keeper.step()
        assert keeper.summary.rewarms == 2  # idle: the first warms only, no mutual churn
        foreign = Foreign(sim.url)
        for _ in range(8):
            foreign.send()
            keeper.step()
        foreign.close()
        s = keeper.summary
        assert s.cold == 2 and s.resumed == s.rewarms - 2 and s.rewarms > 2
        with Worker(sim.url) as loop:
            for p in prefixes:
                _, ev = loop.chat(p, fresh_tail())
                assert ev.cache_state == "reused"


def test_a_rewarm_is_kept_when_the_snapshot_after_it_fails(reg: Registry) -> None:
    from tests.test_warm import _halogen_fake, _usage
    from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH

    with FakeServer() as srv:
        _halogen_fake(srv, _usage(990))
        cache = {**HALOGEN_CACHE, "stores": 7}
        # init, first poll, then the re-warm's closing snapshot fails, then fine again.
        srv.route(
            "GET",
            "/cache",
            Reply(json=cache),
            Reply(json=cache),
            Reply(status=500),
            Reply(json=cache),
        )
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.get("loop")], registry=reg)
            keeper.step()
            assert keeper.summary.rewarms == 1
            assert keeper.history[0].record.after is None
            keeper.step()  # the next poll: no foreign stores, nothing due
            assert keeper.summary.rewarms == 1
    assert [m.kind for m in reg.measurements()] == ["keepalive"]


def test_error_streaks_are_broken_by_answered_polls(reg: Registry) -> None:
    from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH

    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        good = Reply(json={**HALOGEN_CACHE, "stores": 7})
        srv.route("GET", "/cache", good, *([Reply(status=500), good] * 10))
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.get("loop")], poll_s=0.0001)
            keeper.touch(reg.resolve("loop"))  # used: the first poll's 7 is its baseline
            for _ in range(20):
                keeper.state.backoff_until = 0.0
                keeper.step()
    assert keeper.summary.errors == 10
    assert keeper.summary.stopped_because is None


def test_dense_without_max_entries_keeps_time(reg: Registry) -> None:
    with SimServer(SimConfig.for_profile("dense", speed=5000)) as sim, Worker(sim.url) as w:
        keeper = KeepAlive(w, [reg.get("loop")], interval_s=0.05)
        assert keeper.budget.unit == "seconds"
        keeper.step()
        time.sleep(0.06)
        rewarms = keeper.step()
    assert keeper.summary.rewarms == 2
    assert rewarms[0].unit == "seconds" and rewarms[0].since is not None
    assert rewarms[0].since >= 0.05


def test_a_failing_callback_stops_the_thread_with_a_reason(sim: SimServer, reg: Registry) -> None:
    def boom(_rewarm: object) -> None:
        raise RuntimeError("callback broke")

    with Worker(sim.url) as w:
        keeper = KeepAlive(w, [reg.get("loop")], on_rewarm=boom, poll_s=0.01).start()
        with pytest.raises(Exception, match="already running"):
            keeper.start()
        deadline = time.monotonic() + 10
        while keeper.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        summary = keeper.stop()
    assert not keeper.alive
    assert summary.stopped_because == "RuntimeError: callback broke"
    assert not summary.stopped_by_worker


def _generic_fake(srv: FakeServer, cached: list[int], prompt: int = 1375) -> None:
    """A server without /cache whose re-warms come back with `cached` tokens, in turn."""
    left = list(cached)

    def chat(_req: Request) -> Reply:
        n = left.pop(0) if len(left) > 1 else left[0]
        usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
        usage["prompt_tokens_details"] = {"cached_tokens": n}  # type: ignore[assignment]
        msg = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
        return Reply(json={"choices": [msg], "usage": usage})

    srv.route("GET", "/v1/models", Reply(json={"data": [{"id": "m"}]}))
    srv.route("POST", "/v1/chat/completions", chat)


def test_a_partial_rewarm_is_not_kept_and_is_counted_as_partial(reg: Registry) -> None:
    # Issue 20 case 6: 5 of 9 re-warms came back 9 of 1,375 tokens; the summary said "0 cold".
    with FakeServer() as srv:
        _generic_fake(srv, [0, 1360, 9, 1360, 9, 9, 1360, 9, 9])
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.get("loop")], registry=reg, interval_s=0.001)
            for _ in range(9):
                time.sleep(0.002)
                keeper.step()
    s = keeper.summary
    # Issue 23: half its re-warms partial, they spend more prefill than they keep warm: the
    # keeper backs off (and says why) instead of re-prefilling the head again and again.
    assert [r.verdict for r in keeper.history] == ["cold", "resumed", "partial"] * 1 + [
        "resumed",
        "partial",
    ]
    assert (s.rewarms, s.kept, s.resumed, s.partial, s.cold) == (5, 2, 2, 2, 1)
    assert s.tokens_saved == 2 * 1360
    # The first warm is cold by nature: nothing was kept yet, so it is not "not kept" (#33).
    assert (
        "1 first warm (nothing kept yet), 2 kept (resumed), 2 not kept (2 partial, 0 cold)"
        in str(s)
    )
    assert s.backoffs == 1 and "backed off 1 times (2 of the last 4 re-warms kept" in str(s)
    assert s.to_dict()["kept"] == 2 and s.to_dict()["partial"] == 2
    assert s.to_dict()["backoff_reason"] == s.backoff_reason
    bodies = [m.body for m in reg.measurements() if m.kind == "keepalive"]
    assert [b["verdict"] for b in bodies].count("partial") == 2


@pytest.mark.parametrize(
    "args",
    [
        ("--poll", "nan"),
        ("--poll", "inf"),
        ("--poll", "0"),
        ("--interval", "nan"),
        ("--interval", "inf"),
        ("--interval", "-1"),
        ("--duration", "0"),
    ],
)
def test_cli_keepalive_refuses_an_interval_that_would_spin_or_never_fire(
    sim: SimServer, reg: Registry, args: tuple[str, str]
) -> None:
    res = run_cli(
        *("keepalive", "loop", "--worker", sim.url, "--registry", str(reg.root)),
        *("--duration", "0.3", *args),
    )
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert b"Traceback" not in res.stderr and len(res.stderr.splitlines()) <= 2
    assert not [r for r in sim.requests() if r.method == "POST"]


def test_keepalive_api_refuses_wrong_types_and_values_before_sending(
    sim: SimServer, reg: Registry
) -> None:
    p = reg.get("loop")
    with Worker(sim.url) as w:
        bad: list[dict[str, Any]] = [
            {"poll_s": math.nan},
            {"poll_s": -1},
            {"poll_s": "x"},
            {"poll_s": math.inf},
            {"interval_s": -1},
            {"interval_s": math.nan},
            {"budget": 0},
            {"budget": True},
            {"budget": 1.5},
            {"registry": "reg"},
            {"on_rewarm": 1},
        ]
        for kwargs in bad:
            with pytest.raises(UsageError):
                KeepAlive(w, [p], **kwargs)
        for heads in ("s", [p.sha256], [], None, [None]):
            with pytest.raises(UsageError):
                KeepAlive(w, heads)  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            KeepAlive(sim.url, [p])  # type: ignore[arg-type]
        assert sim.requests() == []  # refused before anything was sent
        keeper = KeepAlive(w, [p])
        for duration in (math.nan, math.inf, 0, -1, "x"):
            with pytest.raises(UsageError):
                keeper.run(duration_s=duration)  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            keeper.touch(None)  # type: ignore[arg-type]
    assert keeper.summary.polls == 0


def test_a_budget_tightened_by_a_partial_re_warm_says_partial() -> None:
    from prefixreg.verbs.measure.budget import Budget

    for verdict in ("partial", "cold"):
        b = Budget(limit=8, unit="prompts", per_request=1, source="probe")
        change = b.learn(None, None, None, verdict, since=4)
        assert change == f"budget 8 -> 2 prompts: a re-warm after 4 prompts came back {verdict}"
        assert b.source == f"tightened after a {verdict} re-warm" and b.limit == 2
    kept = Budget(limit=8, unit="prompts", per_request=1, source="probe")
    assert kept.learn(None, None, None, "resumed", since=4) is None and kept.source == "probe"
