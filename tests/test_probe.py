"""`prefixreg probe` against the simulator: legs, Cmax, survival, the six checks, interleaving."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from prefixreg.core.errors import LockTimeoutError, UsageError
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.probe.run import ProbeOptions, ProbeReport, parse_sizes, run_probe
from tests.conftest import run_cli


def probe(sim: SimServer, reg: Registry, **options: object) -> ProbeReport:
    with Worker(sim.url) as w:
        return run_probe(reg, w, ProbeOptions(**options))  # type: ignore[arg-type]


@pytest.fixture
def flash() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=5000)) as sim:
        yield sim


def checks(report: ProbeReport) -> dict[int, tuple[str, str, int | None]]:
    return {c.number: (c.per_call, c.windowed, c.lag) for c in report.checks}


def test_measured_defaults_reproduce_the_flash_lane(flash: SimServer, registry: Registry) -> None:
    report = probe(flash, registry, survival=True)
    for b in report.legs("B"):
        ev = b.record.evidence
        assert ev.prompt_tokens is not None and ev.cached_tokens is not None
        assert ev.prompt_tokens - ev.cached_tokens == 19  # all but 19, at every size
        assert b.verdict == "resumed"
    for a2 in report.legs("A2"):
        ev = a2.record.evidence
        assert ev.prompt_tokens is not None and ev.cached_tokens is not None
        assert ev.prompt_tokens - ev.cached_tokens == 7
    assert all(a1.record.evidence.cache_state == "cold" for a1 in report.legs("A1"))
    assert report.cmax == max(b.record.evidence.cached_tokens or 0 for b in report.legs("B"))
    assert [c.verdict for c in report.legs("C")] == ["cold"] * 4  # gone after 9 foreign prompts
    assert report.survival == 3
    got = checks(report)
    assert got[3][:2] == got[4][:2] == got[6][:2] == ("pass", "pass")
    assert got[1] == ("fail", "pass", 1) and got[2] == ("fail", "pass", 1)
    assert got[5][0] == "info"
    assert "fixed entry size" in report.checks[4].detail
    assert report.outcome == "ok"
    follows = " ".join(report.follows())
    assert "one call late" in follows and "keepalive" in follows


def test_counter_lag_zero_passes_checks_1_and_2_per_call(registry: Registry) -> None:
    with SimServer(SimConfig(speed=5000, counter_lag=0)) as sim:
        report = probe(sim, registry, sizes=(4000, 16000))
    got = checks(report)
    assert got[1] == ("pass", "pass", 0)
    assert got[2] == ("pass", "pass", 0)


def test_every_leg_is_registered_measured_and_receipted(
    flash: SimServer, registry: Registry
) -> None:
    report = probe(flash, registry, sizes=(4000, 8000), foreign=4)
    legs = [c for c in report.calls if c.leg in ("A1", "A2", "B", "C")]
    assert len(legs) == 8
    for call in legs:
        assert registry.get(call.sha256).sha256 == call.sha256  # content-addressed, verified
    kinds = sorted(m.kind for m in registry.measurements())
    assert kinds == sorted(["probe-A1", "probe-A2", "probe-B", "probe-C"] * 2)
    assert all(m.build == report.build for m in registry.measurements())
    assert report.json_path is not None and report.md_path is not None
    receipt = orjson.loads(Path(report.json_path).read_bytes())
    assert receipt["cmax"] == report.cmax
    assert len(receipt["calls"]) == len(report.calls)
    assert all(c["cache_before"] is not None for c in receipt["calls"])
    assert "## Counter checks" in Path(report.md_path).read_text()
    assert verify_registry(registry).ok


def test_a_foreign_client_during_a_probe_marks_windows_interleaved(registry: Registry) -> None:
    stop = threading.Event()
    with SimServer(SimConfig(speed=200)) as sim:

        def foreign_client() -> None:
            with Worker(sim.url) as w:
                i = 0
                while not stop.is_set():
                    w.chat(f"An unrelated tenant's system prompt {i}. " * 20, "hi")
                    i += 1

        thread = threading.Thread(target=foreign_client, daemon=True)
        thread.start()
        try:
            time.sleep(0.05)
            report = probe(sim, registry, sizes=(4000, 8000), foreign=2, force=True)
        finally:
            stop.set()
            thread.join(timeout=10)
    assert any(c.record.interleaved for c in report.calls), "foreign traffic must show"
    # Interleaved windows are left out, so foreign traffic does not fail the checks.
    assert not [c for c in report.checks if c.failed], report.checks
    assert any("interleaved" in line for line in report.follows())
    receipt = report.to_dict()
    calls = receipt["calls"]
    assert isinstance(calls, list)
    assert any(isinstance(c, dict) and c["interleaved"] for c in calls)


def test_dense_profile_counts_in_multiples_of_2048(registry: Registry) -> None:
    with SimServer(SimConfig.for_profile("dense", speed=5000)) as sim:
        # 2,000 characters are ~1,300 tokens on the calibrated tokenizer: under 2048.
        report = probe(sim, registry, sizes=(2000, 16000, 32000), foreign=3, survival=True)
    cached = [c.record.evidence.cached_tokens for c in report.calls if c.leg in ("A2", "B")]
    assert [v for v in cached if v is not None], "the larger sizes resume"
    assert all(v % 2048 == 0 for v in cached if v is not None)
    assert report.alignment == 2048
    small = report.legs("B")[0]
    assert small.size == 2000 and small.record.evidence.cached_tokens is None
    follows = " ".join(report.follows())
    assert "prompts under 2048 tokens never resume" in follows
    # Dense omits the count on a cold call: an evicted prefix's check is unverified, so the
    # survival search cannot place it and gives no number (a missing count is never zero).
    assert report.survival_searched and report.survival is None
    assert any(ok is None for _, ok in report.survival_trials)
    assert report.to_dict()["survival_state"] == "unverified"
    assert "Survival is unverified" in follows and "survives" not in follows
    assert report.outcome == "unverified"


def test_refuses_a_busy_worker_unless_forced(registry: Registry) -> None:
    with SimServer(SimConfig(speed=50, slots=1)) as sim:
        slow = threading.Thread(
            target=lambda: Worker(sim.url).chat("A long foreign prefix. " * 3000, "hello"),
            daemon=True,
        )
        slow.start()
        deadline = time.monotonic() + 5
        with Worker(sim.url) as w:
            while w.health().get("in_flight") == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            with pytest.raises(UsageError, match="in flight"):
                run_probe(registry, w, ProbeOptions(sizes=(4000,)))
        slow.join(timeout=30)
    assert registry.measurements() == []


def test_two_probes_from_one_registry_never_overlap(flash: SimServer, tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg", lock_timeout=0.2)
    reg.init()
    lock_path = reg.root / ".locks" / "probe.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
            "print('held', flush=True); time.sleep(30)",
            str(lock_path),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(LockTimeoutError):
            probe(flash, reg, sizes=(4000,))
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    assert [r for r in flash.requests() if r.method == "POST"] == []


def test_cli_probe_json_and_exit_code(flash: SimServer, tmp_path: Path) -> None:
    res = run_cli(
        *("probe", "--worker", flash.url, "--sizes", "4k,8k", "--foreign", "9"),
        *("--registry", str(tmp_path / "reg"), "--json", "--public"),
    )
    assert res.returncode == 0, res.stderr
    receipt = orjson.loads(res.stdout)
    assert receipt["outcome"] == "ok"
    assert "worker" not in receipt and flash.url.encode() not in res.stdout
    assert receipt["build"]["public"] is True and "model" not in receipt["build"]["identity"]
    assert [c["number"] for c in receipt["checks"]] == [1, 2, 3, 4, 5, 6]
    no_json = run_cli(
        *("probe", "--worker", flash.url, "--sizes", "4k", "--public"),
        *("--registry", str(tmp_path / "reg")),
    )
    assert no_json.returncode == 2 and b"--public" in no_json.stderr and no_json.stdout == b""
    bad = run_cli("probe", "--worker", flash.url, "--sizes", "4q", "--registry", str(tmp_path))
    assert bad.returncode == 2 and b"bad size" in bad.stderr


def test_parse_sizes() -> None:
    assert parse_sizes("16k, 4k,4000") == (4000, 16000)
    with pytest.raises(UsageError):
        parse_sizes("0")


def test_report_shaped_probe_is_22_calls_with_seconds_per_leg(
    flash: SimServer, tmp_path: Path
) -> None:
    res = run_cli(
        *("probe", "--worker", flash.url, "--legs", "report", "--foreign", "9"),
        *("--registry", str(tmp_path / "reg"), "--json"),
    )
    assert res.returncode == 0, res.stderr
    receipt = orjson.loads(res.stdout)
    assert receipt["options"]["legs"] == "report"
    # The report's shape: A1/A2/B at each of the four sizes, C (after 9 foreign) at 16k only.
    assert receipt["calls_made"] == len(receipt["calls"]) == 22
    legs = [(c["leg"], c["size"]) for c in receipt["calls"] if c["leg"] != "foreign"]
    assert [s for leg, s in legs if leg == "C"] == [16000]
    for leg in ("A1", "A2", "B"):
        assert sorted(s for name, s in legs if name == leg) == [4000, 16000, 32000, 64000]
    seconds = receipt["leg_seconds"]
    assert set(seconds) == {"A1", "A2", "B", "C"}
    assert set(seconds["A1"]) == {"4000", "16000", "32000", "64000"} and set(seconds["C"]) == {
        "16000"
    }
    by_call = {(c["leg"], str(c["size"])): c["evidence"]["wall_s"] for c in receipt["calls"]}
    for leg, by_size in seconds.items():
        for size, secs in by_size.items():
            assert secs is not None and secs > 0 and secs == by_call[(leg, size)]
    md = Path(receipt["md_path"]).read_text()
    assert "## Seconds per leg" in md and "at 16,000 only; 22 calls" in md
    assert "| C |" in md and "| seconds |" in md
    bad = run_cli(
        "probe", "--worker", flash.url, "--legs", "some", "--registry", str(tmp_path / "reg")
    )
    assert bad.returncode == 2 and b"--legs" in bad.stderr


def test_report_legs_pick_the_size_nearest_16k_and_survival_still_searches(
    flash: SimServer, registry: Registry
) -> None:
    report = probe(flash, registry, sizes=(4000, 20000), foreign=3, legs="report", survival=True)
    assert [c.size for c in report.legs("C")] == [20000]
    # Survival runs on the smallest resumable size, which had no C leg: it searches anyway.
    assert report.survival_searched and report.survival is not None
    assert report.outcome == "ok"
