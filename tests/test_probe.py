"""`prefixreg probe` against the simulator: legs, Cmax, survival, the six checks, interleaving."""

from __future__ import annotations

import ast
import importlib
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.errors import LockTimeoutError, UsageError
from prefixreg.core.judge import alignment_shaped, allowance, judge
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.registry.userfiles import MAX_INPUT_BYTES as USER_FILE_MAX
from prefixreg.registry.verify import verify_registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.probe.options import ProbeOptions, builtin_corpus, probe_slice
from prefixreg.verbs.probe.run import ProbeReport, check_sizes, parse_sizes, run_probe
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


@pytest.mark.parametrize("processing", ["yes", 1, None])
def test_a_slot_whose_is_processing_is_not_a_boolean_counts_as_busy(
    registry: Registry, processing: object
) -> None:
    from tests.fakeserver import FakeServer, Reply
    from tests.test_snapshots import PROPS

    slot: dict[str, object] = {"id": 0, "n_ctx": 8192, "id_task": 3}
    if processing is not None:
        slot["is_processing"] = processing
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json={"status": "ok"}))
        srv.route("GET", "/props", Reply(json=PROPS))
        srv.route("GET", "/slots", Reply(json=[slot]))
        with Worker(srv.url) as w, pytest.raises(UsageError, match="in flight"):
            run_probe(registry, w, ProbeOptions(sizes=(4000,)))
        assert not any(r.path == "/v1/chat/completions" for r in srv.requests)


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


# -- user-named corpus files are read bounded (issue 22, case 4) ----------------------------


def _probe_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI as a real process under a 1 GiB address-space cap and a deadline: a reader
    that does not stop fails the test instead of eating the machine."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run(
        [sys.executable, "-m", "prefixreg", "probe", *args],
        capture_output=True,
        timeout=60,
        check=False,
        preexec_fn=cap,
    )


def _special(kind: str, tmp_path: Path) -> Path:
    if kind == "device":
        return Path("/dev/zero")
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with path.open("wb") as f:
            f.truncate(USER_FILE_MAX + 1)  # sparse: nothing is written
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe" * 3000)
    return path  # "missing": never created


@pytest.mark.parametrize("kind", ["device", "fifo", "directory", "huge", "binary", "missing"])
def test_a_corpus_that_is_not_a_small_regular_text_file_is_refused(
    flash: SimServer, tmp_path: Path, kind: str
) -> None:
    path = _special(kind, tmp_path)
    reg = tmp_path / "reg"
    res = _probe_cli(
        *("--worker", flash.url, "--registry", str(reg), "--sizes", "1k"),
        *("--corpus", str(path)),
    )
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.startswith(f"error: {path}: ".encode()) and res.stderr.count(b"\n") == 1
    assert res.stdout == b"" and flash.requests() == [] and not reg.exists()


def test_a_regular_corpus_file_is_sliced(flash: SimServer, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Prefer small pure functions; state invariants.\n" * 100)
    res = run_cli(
        *("probe", "--worker", flash.url, "--registry", str(tmp_path / "reg")),
        *("--sizes", "2k", "--foreign", "2", "--corpus", str(corpus), "--json"),
    )
    assert res.returncode == 0, res.stderr
    receipt = orjson.loads(res.stdout)
    assert receipt["options"]["corpus"] == "file"
    b = next(c for c in receipt["calls"] if c["leg"] == "B")
    sliced = Registry(tmp_path / "reg").get(b["sha256"]).text
    assert sliced.endswith("\n" + corpus.read_text()[:2000])


# -- the typed boundary: wrong types and values are usage errors (issue 22, case 5) ---------


@pytest.mark.parametrize(
    "options",
    [
        {"sizes": "4000"},
        {"sizes": [4000.0]},
        {"foreign": 0},
        {"foreign": 10**9},
        {"foreign": "9"},
        {"foreign_chars": None},
        {"survival": "yes"},
        {"force": 1},
        {"legs": ["all"]},
        {"corpus": b"bytes"},
        {"corpus": "\ud800" * 70_000},
        {"corpus": "short"},
        {"frame": "loop"},
        {"frame": Prefix.from_text("0" * 64, "x")},
    ],
)
def test_probe_options_refuse_wrong_types_and_values(options: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        ProbeOptions(**options)  # type: ignore[arg-type]


def test_probe_functions_refuse_wrong_types(flash: SimServer, registry: Registry) -> None:
    calls: list[Callable[[], object]] = [
        lambda: parse_sizes(4000),  # type: ignore[arg-type]
        lambda: check_sizes("4k", None),  # type: ignore[arg-type]
        lambda: builtin_corpus("10"),  # type: ignore[arg-type]
        lambda: builtin_corpus(10**12),
        lambda: probe_slice("", 10, header="h"),
        lambda: probe_slice("text", -1, header="h"),
        lambda: probe_slice("text", 1, header=None),  # type: ignore[arg-type]
    ]
    with Worker(flash.url) as w:
        calls += [
            lambda: run_probe(None, w, ProbeOptions()),  # type: ignore[arg-type]
            lambda: run_probe(registry, flash.url, ProbeOptions()),  # type: ignore[arg-type]
            lambda: run_probe(registry, w, {"sizes": (4000,)}),  # type: ignore[arg-type]
            lambda: run_probe(registry, w, ProbeOptions(), progress=3),  # type: ignore[arg-type]
        ]
        for call in calls:
            with pytest.raises(UsageError):
                call()
    assert flash.requests() == [] and not registry.root.exists()


# -- one judge, and the alignment named where it shapes a verdict (issue 20) ---------------


def test_every_leg_carries_the_judges_verdict_and_reason(
    flash: SimServer, registry: Registry
) -> None:
    report = probe(flash, registry, sizes=(4000,), foreign=2)
    for call in report.calls:
        if call.leg == "foreign":
            assert call.judgement is None
        else:
            assert call.judgement is not None and call.judgement.reason
    receipt = report.to_dict()
    calls = receipt["calls"]
    assert isinstance(calls, list)
    legs = [c for c in calls if isinstance(c, dict) and c["leg"] != "foreign"]
    assert {c["verdict"] for c in legs} <= {"resumed", "partial", "cold", "unverified"}
    assert all(isinstance(c["reason"], str) for c in legs)
    bodies = [m.outcome for m in registry.measurements()]
    assert {o.verdict for o in bodies} <= {"resumed", "partial", "cold"} and all(
        o.reason for o in bodies
    )


def test_the_dense_probe_names_the_alignment_where_it_let_a_count_pass(
    registry: Registry,
) -> None:
    with SimServer(SimConfig.for_profile("dense", speed=5000)) as sim:
        report = probe(sim, registry, sizes=(16000,), foreign=2)
    b = report.legs("B")[0]
    assert b.judgement is not None and alignment_shaped(b.judgement)
    md = report.to_markdown()
    assert "| resumed (within the 2,048-token alignment) |" in md
    assert "Cmax (largest B): 10,240 tokens (counted in multiples of 2,048)" in md
    assert "multiples of 2,048 tokens" in (b.judgement.reason or "")


@given(
    span=st.integers(1, 200_000),
    cached=st.integers(0, 200_000),
    alignment=st.sampled_from([0, 1, 64, 2048]),
)
def test_alignment_shaped_only_for_resumed_counts_the_template_allowance_misses(
    span: int, cached: int, alignment: int
) -> None:
    cached = min(cached, span)
    ev = CallEvidence(
        prompt_tokens=span,
        cached_tokens=cached,
        completion_tokens=1,
        cached_source="usage.prompt_tokens_details.cached_tokens",
        cache_state="reused" if cached else "cold",
        complete=True,
    )
    j = judge(ev, head_bytes=span, alignment=alignment, measured_span=span)
    if alignment_shaped(j):
        assert j.verdict == "resumed" and alignment > 0
        assert j.span is not None and j.cached_tokens is not None
        assert j.span - j.cached_tokens > allowance(j.span, 0)
        assert "multiples of" in j.reason


def test_verbs_import_no_other_verb_package() -> None:
    own = ("prefixreg.verbs.probe", "prefixreg.verbs.doctor")
    for package in own:
        root = Path(importlib.import_module(package).__file__ or "").parent
        for module in root.glob("*.py"):
            tree = ast.parse(module.read_text())
            names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            for name in names:
                if name.startswith("prefixreg.verbs."):
                    assert name.startswith((package, "prefixreg.verbs.measure")), (module, name)
