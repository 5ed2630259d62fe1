"""Acceptance: the simulator replays the measured lane's probe, numbers included (#14).

The probe's legs on the corpus slices `prefixreg probe` uses (header + `probe_slice`): A1 cold,
A2 the identical repeat, B the same system bytes with a fresh tail; `max_tokens` 1 at
temperature 0, as prefixreg's warm calls. Measured on the lane: prompt tokens 2,593 / 11,374
(4k / 16k characters), A2 = prompt - 7, B = prompt - 19, A1 3.38 / 9.81 s, A2 0.12-0.19 s,
B 0.4-0.69 s. Times are wall seconds seen by the client and must fall inside the measured
ranges widened by 15% (divided by the speed); concurrent identical cold requests must never be
served from a snapshot before their own prefill finished.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.probe.options import DEFAULT_SIZES, ProbeOptions, builtin_corpus, probe_slice
from prefixreg.verbs.probe.run import run_probe

MEASURED_PROMPT = {4000: 2593, 16000: 11374}
MEASURED_A1 = {4000: (3.38, 3.38), 16000: (9.81, 9.81)}
A2_RANGE = (0.12, 0.19)
B_RANGE = (0.4, 0.69)
SLACK = 0.15


def slice_text(size: int) -> str:
    header = f"prefixreg probe 5eed1e55 prefix of {size} characters"
    return probe_slice(builtin_corpus(size), size, header=header)


def body(system: str, tail: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": tail}],
        "max_tokens": 1,
        "temperature": 0,
    }


def timed(http: httpx.Client, payload: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    resp = http.post("/v1/chat/completions", json=payload)
    elapsed = time.perf_counter() - t0
    assert resp.status_code == 200, resp.text
    reply: dict[str, Any] = resp.json()
    return elapsed, reply


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def inside(value: float, bounds: tuple[float, float], speed: float) -> bool:
    low, high = bounds
    return low * (1 - SLACK) / speed <= value <= high * (1 + SLACK) / speed


@contextmanager
def sim_process(speed: float) -> Iterator[str]:
    """`prefixreg sim` in its own process (as a worker is): its URL until the block ends.

    In one process the client's and the server's threads share the interpreter, which can
    add tens of milliseconds to a call and would blur the modelled times."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixreg", "sim", "--port", "0", "--quiet", "--speed", str(speed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", proc.stderr.readline())
        assert match, "the simulator did not print its URL"
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # a loaded machine can take its time to stop it; its Ctrl-C has its own test
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def replay(size: int, speed: float) -> None:
    system = slice_text(size)
    with (
        sim_process(speed) as url,
        httpx.Client(base_url=url, trust_env=False, timeout=120) as http,
    ):
        http.get("/health")  # the connection is open before the timed calls
        tail = fresh_tail()
        a1_s, a1 = timed(http, body(system, tail))
        a2_s, a2 = timed(http, body(system, tail))
        b_s, b = timed(http, body(system, fresh_tail()))
    prompt = a1["usage"]["prompt_tokens"]
    assert abs(prompt / MEASURED_PROMPT[size] - 1) < 0.02, prompt
    assert cached(a1) == 0 and "prompt_tokens_details" not in a1["usage"]
    assert cached(a2) == prompt - 7
    assert cached(b) == prompt - 19
    # What the server reports and what the client waited, both inside the measured ranges.
    for wall, reply, bounds in (
        (a1_s, a1, MEASURED_A1[size]),
        (a2_s, a2, A2_RANGE),
        (b_s, b, B_RANGE),
    ):
        reported = (reply["timings"]["prompt_ms"] + reply["timings"]["predicted_ms"]) / 1000
        assert inside(reported, bounds, speed), (size, speed, reported, bounds)
        assert inside(wall, bounds, speed), (size, speed, wall, bounds)


@pytest.mark.parametrize("size", [4000, 16000])
def test_probe_replay_at_speed_1_gives_the_lanes_numbers(size: int) -> None:
    replay(size, 1.0)


@pytest.mark.parametrize("size", [4000, 16000])
def test_probe_replay_at_higher_speed_scales_the_ranges(size: int) -> None:
    replay(size, 4.0)


def test_four_identical_cold_requests_are_all_prefilled_before_any_snapshot() -> None:
    # Flash, 4 slots: every request looks up while no snapshot exists yet, and the first
    # snapshot appears only when a prefill finishes; so none of the four reports a resume.
    system = slice_text(4000)
    payload = body(system, "the same tail for all four")
    speed = 5.0  # cold prefill ~0.68 s: far longer than the spread of four starts
    with SimServer(SimConfig(speed=speed)) as sim:
        replies: list[tuple[float, dict[str, Any]]] = []
        together = threading.Barrier(4)

        def run() -> None:
            with httpx.Client(base_url=sim.url, trust_env=False, timeout=60) as http:
                http.get("/health")
                together.wait(timeout=10)
                replies.append(timed(http, payload))

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with httpx.Client(base_url=sim.url, trust_env=False, timeout=60) as http:
            counters = http.get("/cache").json()
            after_s, after = timed(http, payload)
    assert len(replies) == 4
    for wall, reply in replies:
        assert "prompt_tokens_details" not in reply["usage"]
        assert reply["timings"]["cache_n"] == 0
        assert wall >= 3.38 * (1 - SLACK) / speed  # each paid its whole prefill
    assert counters["stores"] == 8  # two snapshots each, all stored after their prefills
    assert cached(after) == after["usage"]["prompt_tokens"] - 7  # then it resumes
    assert after_s < min(w for w, _ in replies) / 3


def test_a_probe_at_the_reports_four_sizes_gives_its_cmax(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "reg")
    with SimServer(SimConfig(speed=5000)) as sim, Worker(sim.url) as worker:
        report = run_probe(registry, worker, ProbeOptions(sizes=DEFAULT_SIZES, foreign=9))
    assert DEFAULT_SIZES == (4000, 16000, 32000, 64000)
    assert report.cmax is not None
    assert abs(report.cmax / 43_519 - 1) < 0.02, report.cmax
    measured = (2593, 11374, 21337, 43538)
    for b, lane in zip(report.legs("B"), measured, strict=True):
        prompt = b.record.evidence.prompt_tokens
        assert prompt is not None and abs(prompt / lane - 1) < 0.02
        assert b.record.evidence.cached_tokens == prompt - 19
