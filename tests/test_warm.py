"""`prefixreg warm` end to end: the simulator, a scripted loopback server, real processes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.core.judge import judge
from prefixreg.core.records import CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.measure.warm import warm
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, sse_frames
from tests.test_store import flip_byte
from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH

SYSTEM = "You are a careful coding agent. Follow the repository's conventions.\n" * 40
CHAT = "/v1/chat/completions"


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=2000)) as server:
        yield server


@pytest.fixture
def reg_path(tmp_path: Path) -> Path:
    path = tmp_path / "reg"
    Registry(path).add(SYSTEM, name="loop")
    return path


def warm_cli(reg_path: Path, url: str, *args: str) -> Any:
    return run_cli("warm", "loop", "--worker", url, "--registry", str(reg_path), *args)


def foreign_prompts(url: str, count: int) -> None:
    with Worker(url) as w:
        for i in range(count):
            w.chat(f"Foreign system prompt number {i}, unrelated to the loop. " * 30, "hello")


def test_warm_then_resume_check_is_resumed_from_server_counts(
    sim: SimServer, reg_path: Path
) -> None:
    res = warm_cli(reg_path, sim.url, "--json")
    assert res.returncode == 0, res.stderr
    receipt = orjson.loads(res.stdout)
    body = receipt["body"]
    assert body["verdict"] == "resumed"
    warm, check = body["calls"]
    assert warm["evidence"]["cache_state"] == "cold"
    assert check["evidence"]["cache_state"] == "reused"
    assert check["evidence"]["cached_source"] == "usage.prompt_tokens_details.cached_tokens"
    # The measured Flash shape: a fresh tail after the same system bytes resumes all but 19.
    assert check["evidence"]["prompt_tokens"] - check["evidence"]["cached_tokens"] == 19
    assert receipt["build"]["profile"] == "halogen"
    assert receipt["worker"] == sim.url
    assert check["cache_deltas"]["stores"] == 2
    record = Path(receipt["record"])
    assert record.is_file() and record.parent.name == "measurements"
    shown = run_cli("show", "loop", "--registry", str(reg_path))
    assert b"resumed" in shown.stdout and receipt["build"]["build_id"].encode() in shown.stdout


def test_check_only_after_nine_foreign_prompts_is_cold(sim: SimServer, reg_path: Path) -> None:
    assert warm_cli(reg_path, sim.url, "--no-check").returncode == 0
    foreign_prompts(sim.url, 9)
    res = warm_cli(reg_path, sim.url, "--check-only", "--json")
    assert res.returncode == 1, res.stderr
    check = orjson.loads(res.stdout)["body"]["calls"][0]
    assert check["phase"] == "check"
    assert check["evidence"]["cache_state"] == "cold"
    assert check["evidence"]["cached_source"] == "timings.cache_n"


def test_check_only_right_after_warm_is_resumed(sim: SimServer, reg_path: Path) -> None:
    assert warm_cli(reg_path, sim.url, "--no-check").returncode == 0
    foreign_prompts(sim.url, 2)
    assert warm_cli(reg_path, sim.url, "--check-only").returncode == 0


def test_flipped_byte_exits_3_and_sends_nothing(sim: SimServer, reg_path: Path) -> None:
    reg = Registry(reg_path)
    flip_byte(reg.object_path(reg.resolve("loop")))
    res = warm_cli(reg_path, sim.url)
    assert res.returncode == 3
    assert res.stdout == b""
    assert [r for r in sim.requests() if r.method == "POST"] == []
    assert sim.requests() == []  # not even /health: verification comes first
    assert list((reg_path / "measurements").iterdir()) == []


def test_record_holds_no_key_tail_or_output_and_public_drops_address(
    sim: SimServer, reg_path: Path, tmp_path: Path
) -> None:
    secret = "sk-unique-secret-7f3a9c"
    res = run_cli(
        *("warm", "loop", "--worker", sim.url, "--registry", str(reg_path)),
        *("--json", "--model", "alias-x", "--public"),
        env={"PREFIXREG_API_KEY": secret},
    )
    assert res.returncode == 0, res.stderr
    public = orjson.loads(res.stdout)
    assert "worker" not in public and "model" not in public and public["record"] is None
    assert sim.url.encode() not in res.stdout and b"alias-x" not in res.stdout
    refused = run_cli(
        *("warm", "loop", "--worker", sim.url, "--registry", str(reg_path), "--public"),
    )
    assert refused.returncode == 2 and b"add --json" in refused.stderr
    (record,) = (reg_path / "measurements").iterdir()
    data = record.read_bytes()
    assert secret.encode() not in data
    assert b"prefixreg resume check" not in data  # no tail text, only its hash
    assert b'"content"' not in data
    stored = orjson.loads(data)
    assert stored["worker"] == sim.url and stored["model"] == "alias-x"
    for call in stored["body"]["calls"]:
        assert len(call["tail_sha256"]) == 64
        assert len(call["evidence"]["output_sha256"]) == 64


def _halogen_fake(srv: FakeServer, usage: Any, *, timings: Any = None, done: bool = True) -> None:
    srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
    srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
    final: dict[str, Any] = {"choices": [], "usage": usage}
    if timings is not None:
        final["timings"] = timings
    frames: list[Any] = [
        {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        final,
    ]
    srv.route("POST", CHAT, Reply(sse=sse_frames(frames, done=done)))


def _usage(cached: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": 1000,
        "completion_tokens": 1,
        "total_tokens": 1001,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@pytest.mark.parametrize(
    ("usage", "done", "frames_extra", "needle"),
    [
        (None, True, None, b"usage"),
        ({}, True, None, b"usage"),
        ([], True, None, b"usage"),
        ("usage", True, None, b"usage"),
        (_usage(True), True, None, b"cached_tokens"),
        (_usage(8.0), True, None, b"cached_tokens"),
        (_usage("8"), True, None, b"cached_tokens"),
        (_usage(-1), True, None, b"cached_tokens"),
        (_usage(1001), True, None, b"prompt_tokens"),
        (_usage(990), False, None, b"DONE"),
    ],
)
def test_malformed_usage_exits_4_and_records_unverified(
    reg_path: Path, usage: Any, done: bool, frames_extra: Any, needle: bytes
) -> None:
    with FakeServer() as srv:
        _halogen_fake(srv, usage, done=done)
        res = warm_cli(reg_path, srv.url)
    assert res.returncode == 4, (res.stdout, res.stderr)
    assert b"UNVERIFIED" in res.stdout
    assert needle.lower() in res.stdout.lower()
    (record,) = (reg_path / "measurements").iterdir()
    assert orjson.loads(record.read_bytes())["body"]["verdict"] == "unverified"


def test_error_frame_exits_4(reg_path: Path) -> None:
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        secret_text = "internal engine detail 42"
        frames = [{"error": {"message": secret_text, "type": "server_error"}}]
        srv.route("POST", CHAT, Reply(sse=sse_frames(frames)))
        res = warm_cli(reg_path, srv.url)
    assert res.returncode == 4
    (record,) = (reg_path / "measurements").iterdir()
    assert secret_text.encode() not in record.read_bytes()


def test_halogen_cold_reply_is_cold_from_timings_and_unverified_without(reg_path: Path) -> None:
    cold_usage = {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001}
    with FakeServer() as srv:
        _halogen_fake(srv, cold_usage, timings={"cache_n": 0, "prompt_n": 1000})
        res = warm_cli(reg_path, srv.url, "--json")
    assert res.returncode == 1
    check = orjson.loads(res.stdout)["body"]["calls"][-1]["evidence"]
    assert (check["cache_state"], check["cached_source"]) == ("cold", "timings.cache_n")
    with FakeServer() as srv:
        _halogen_fake(srv, cold_usage)
        res = warm_cli(reg_path, srv.url, "--json")
    assert res.returncode == 4
    assert orjson.loads(res.stdout)["body"]["verdict"] == "unverified"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_worker_errors_exit_5_with_one_line(reg_path: Path) -> None:
    busy = {
        "error": {
            "message": "timed out waiting for the engine",
            "type": "server_error",
            "param": None,
            "code": "engine_busy",
        }
    }
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, Reply(status=503, json=busy))
        res = warm_cli(reg_path, srv.url)
    assert res.returncode == 5
    assert b"engine_busy" in res.stderr or b"503" in res.stderr
    refused = warm_cli(reg_path, f"http://127.0.0.1:{_closed_port()}")
    assert refused.returncode == 5
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, Reply(sse=sse_frames([]), delay=3.0))
        slow = warm_cli(reg_path, srv.url, "--timeout", "0.5")
    assert slow.returncode == 5
    for out in (res, refused, slow):
        lines = out.stderr.decode().strip().splitlines()
        assert len(lines) <= 2 and lines[0].startswith("error: "), out.stderr
        assert b"Traceback" not in out.stderr
    assert b"timed out" in slow.stderr.lower() or b"timeout" in slow.stderr.lower()


@pytest.mark.parametrize(
    ("cached", "prompt", "align", "verdict"),
    [
        (2574, 2593, 0, "resumed"),
        (9, 2065, 0, "partial"),
        (2048, 2593, 2048, "resumed"),
        (0, 2593, 0, "cold"),
    ],
)
def test_judge_resume_looks_at_coverage(cached: int, prompt: int, align: int, verdict: str) -> None:
    ev = CallEvidence(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=1,
        cached_source="usage.prompt_tokens_details.cached_tokens",
        cache_state="cold" if cached == 0 else "reused",
        complete=True,
    )
    # A ~2,580-token prefix and a ~55-byte tail, as the Flash lane measurements.
    got = judge(ev, head_bytes=10_000, rest_bytes=55, alignment=align)
    assert got.verdict == verdict


def test_library_warm_binds_the_measurement_to_the_build(sim: SimServer, reg_path: Path) -> None:
    reg = Registry(reg_path)
    with Worker(sim.url) as w:
        result = warm(reg, reg.head("loop"), w)
        assert result.verdict == "resumed"
        assert result.build.build_id == w.server_build().build_id
    (stored,) = reg.measurements(result.prefix.sha256)
    assert stored.build == result.build
    assert result.prefix.name == "loop"
    assert Path(result.record_path).name.startswith(result.prefix.sha256 + "-")


def test_show_marks_measurements_from_other_builds(sim: SimServer, reg_path: Path) -> None:
    assert warm_cli(reg_path, sim.url).returncode == 0
    with SimServer(SimConfig(speed=2000, slots=2)) as other:  # slots are part of the build
        shown = run_cli("show", "loop", "--registry", str(reg_path), "--worker", other.url)
        assert shown.returncode == 0, shown.stderr
        assert b"no measurement on the current build" in shown.stdout
        assert b"(other build)" in shown.stdout
        assert warm_cli(reg_path, other.url).returncode == 0
        shown = run_cli("show", "loop", "--registry", str(reg_path), "--worker", other.url)
    text = shown.stdout.decode()
    assert "latest on the current build:" in text
    assert text.count("(other build)") == 1


def test_show_calls_a_build_current_only_as_a_worker_says(sim: SimServer, reg_path: Path) -> None:
    assert warm_cli(reg_path, sim.url).returncode == 0
    with SimServer(SimConfig(speed=2000, slots=2)) as other:  # slots are part of the build
        assert warm_cli(reg_path, other.url).returncode == 0  # the newest measurement
        flash = {"PREFIXREG_WORKER": sim.url}
        shown = run_cli("show", "loop", "--registry", str(reg_path), env=flash)
        data = run_cli("show", "loop", "--registry", str(reg_path), "--json", env=flash)
        alone = run_cli("show", "loop", "--registry", str(reg_path), "--json")
    text = shown.stdout.decode()
    first = orjson.loads(data.stdout)["current_build"]
    newest = orjson.loads(alone.stdout)["newest_build"]
    # $PREFIXREG_WORKER is read as --worker is: the first build is current, not the newest.
    assert f"current build {first} (from the worker)" in text
    assert first != newest and orjson.loads(data.stdout)["newest_build"] == newest
    latest = text.splitlines()[text.splitlines().index("latest on the current build:") + 1]
    assert first in latest
    # With no worker no build is called current: the newest measured one is named as that.
    assert orjson.loads(alone.stdout)["current_build"] is None
    plain = run_cli("show", "loop", "--registry", str(reg_path)).stdout.decode()
    assert "current build" not in plain and f"newest measured build {newest}" in plain
    # A worker only the environment names that does not answer: what is on disk, said so;
    # one asked for with --worker must answer (exit 5).
    gone = f"http://127.0.0.1:{_closed_port()}"
    offline = run_cli("show", "loop", "--registry", str(reg_path), env={"PREFIXREG_WORKER": gone})
    assert offline.returncode == 0 and b"$PREFIXREG_WORKER did not answer" in offline.stderr
    assert f"newest measured build {newest}".encode() in offline.stdout
    asked = run_cli("show", "loop", "--registry", str(reg_path), "--worker", gone)
    assert asked.returncode == 5, asked.stderr


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:99999", "http://127.0.0.1:abc", "http://u:pw@[::1", "ftp://x"]
)
def test_bad_worker_urls_are_usage_errors(reg_path: Path, url: str) -> None:
    res = warm_cli(reg_path, url)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(b"error: not a worker URL")
    assert b"pw" not in res.stderr and b"Traceback" not in res.stderr


def test_warm_on_a_mirror_is_refused_before_anything_is_sent(
    sim: SimServer, reg_path: Path
) -> None:
    marker = reg_path / "REGISTRY.json"
    marker.write_text(marker.read_text().replace('"origin"', '"mirror"'))
    res = warm_cli(reg_path, sim.url)
    assert res.returncode == 2
    assert b"is a mirror" in res.stderr
    assert sim.requests() == []
