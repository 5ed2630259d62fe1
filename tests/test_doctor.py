"""`prefixreg doctor`: findings in plain words from a worker's own /health and /cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.errors import UsageError
from prefixreg.core.judge import URGENT_CMAX, allowance, judge_fit, judge_reach
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.doctor.run import diagnose, doctor
from prefixreg.verbs.measure.warm import warm
from prefixreg.verbs.probe.options import ProbeOptions, builtin_corpus, probe_slice
from prefixreg.verbs.probe.run import run_probe
from tests.conftest import run_cli
from tests.test_store import flip_byte

FLASH_BLOCK: dict[str, Any] = {
    "enabled": True,
    "cap_mb": 110,
    "mode": 2,
    "snapshot_align": 0,
    "bitwise_identical_to_cold": False,
}


HEALTH: dict[str, Any] = {"prompt_cache": FLASH_BLOCK}


def topics(d: Any, level: str) -> set[str]:
    return {f.topic for f in d.findings if f.level == level}


def test_measured_lane_counters_warn_about_thrashing_and_survival() -> None:
    # The DESIGN's measured night: 3,271 evictions against 3,279 stores, few hits.
    cache = {
        "entries": 8,
        "max_entries": 8,
        "stores": 3279,
        "evicted": 3271,
        "hits": 40,
        "misses": 1600,
        "refused": 0,
        "last_entry_bytes": 116389652,
    }
    d = diagnose("halogen", HEALTH, cache)
    assert {"thrashing", "survival"} <= topics(d, "warn")
    text = " ".join(f.text for f in d.findings)
    assert "3,279" in text and "3,271" in text
    assert "111.0 MiB" in text and "cap_mb is 110" in text
    # Entries are slabs of cap_mb MiB: the advice is the cache size, by its setting names.
    assert "slab" in topics(d, "info") and d.numbers["slab_entries"] is True
    survival = next(f.text for f in d.findings if f.topic == "survival")
    assert "`cacheMb` (env HALOGEN_CACHE_MB), not HALOGEN_CACHE_ENTRIES" in survival
    thrashing = next(f.text for f in d.findings if f.topic == "thrashing")
    assert "Raise the cache-size option `cacheMb` (env HALOGEN_CACHE_MB)" in thrashing
    assert d.numbers["survival_estimate"] == 3
    assert not d.healthy


def test_a_full_cache_that_still_hits_is_not_thrashing() -> None:
    cache = {
        "entries": 24,
        "max_entries": 24,
        "stores": 5000,
        "evicted": 4976,
        "hits": 4000,
        "misses": 500,
        "refused": 0,
    }
    d = diagnose("halogen", HEALTH, cache)
    assert "thrashing" not in topics(d, "warn")
    assert "survival" not in topics(d, "warn")  # 24 entries: a prefix survives 11 prompts
    assert d.healthy


def test_dense_budget_that_cannot_hold_a_full_context_entry() -> None:
    health: dict[str, Any] = {
        "prompt_cache": {"enabled": True, "cap_mb": 8192, "snapshot_align": 2048},
        "slot_ctx": 262144,
    }
    cache = {
        "entries": 0,
        "cap_bytes": 8 << 30,
        "stores": 0,
        "evicted": 0,
        "hits": 0,
        "misses": 3,
        "refused": 2,
    }
    d = diagnose("halogen", health, cache)
    assert {"budget", "refused"} <= topics(d, "warn")
    assert any("never hits" in f.text for f in d.findings)


def test_other_profiles_say_what_they_can_and_cannot_prove() -> None:
    llama = diagnose("llamacpp", {}, None)
    assert "no cache-entry counters" in llama.findings[0].text
    vllm = diagnose("vllm", {}, None)
    assert "enable-prompt-tokens-details" in vllm.findings[0].text
    assert llama.healthy and vllm.healthy


def test_doctor_against_the_simulator_cli(tmp_path: Any) -> None:
    with SimServer(SimConfig(speed=5000)) as sim:
        with Worker(sim.url) as w:
            for i in range(12):  # distinct prompts churn the 8-entry LRU
                w.chat(f"Distinct system prompt {i}. " * 40, "hi")
        res = run_cli("doctor", "--worker", sim.url, "--json")
    assert res.returncode == 1  # something to change: survival of 3 foreign prompts
    out = orjson.loads(res.stdout)
    assert out["profile"] == "halogen" and out["worker"] == sim.url
    assert out["numbers"]["cache"]["entries"] == 8
    assert out["numbers"]["survival_estimate"] == 3
    assert any(f["topic"] == "thrashing" for f in out["findings"])


LANE_SIZES = (4000, 16000, 32000, 64000)


def coding_loop(reg: Registry) -> str:
    """A registered ~43.5k-token prefix (64,000 characters of the probe corpus)."""
    text = probe_slice(builtin_corpus(64000), 64000, header="coding-loop system prompt")
    return reg.add(text, name="coding-loop")


def lane_run(config: SimConfig, reg: Registry, sizes: tuple[int, ...]) -> tuple[str, Any]:
    """Warm coding-loop and probe on a simulator, then run `doctor` on it (text and JSON)."""
    with SimServer(config) as sim:
        with Worker(sim.url) as w:
            warm(reg, reg.head("coding-loop"), w)
            run_probe(reg, w, ProbeOptions(sizes=sizes, foreign=9))
        args = ("doctor", "--worker", sim.url, "--registry", str(reg.root))
        text = run_cli(*args)
        as_json = run_cli(*args, "--json")
    assert text.returncode == as_json.returncode, text.stderr
    return text.stdout.decode(), orjson.loads(as_json.stdout)


def test_doctor_on_the_lane_advises_the_cache_size_and_checks_the_prefix_fits(
    tmp_path: Path,
) -> None:
    reg = Registry(tmp_path / "reg")
    sha = coding_loop(reg)
    text, out = lane_run(SimConfig(speed=5000, cap_mb=110), reg, LANE_SIZES)
    assert "cacheMb" in text and "HALOGEN_CACHE_MB" in text  # the setting, by name
    by_topic = {f["topic"]: f for f in out["findings"]}
    assert by_topic["slab"]["level"] == "info"
    assert "`cacheMb` (env HALOGEN_CACHE_MB)" in by_topic["slab"]["text"]
    assert abs(out["numbers"]["cmax"] / 43_519 - 1) < 0.02
    assert by_topic["cmax"]["level"] == "info" and "at least" in by_topic["cmax"]["text"]
    fit = by_topic["fit"]
    assert fit["level"] == "ok" and f"coding-loop ({sha[:12]})" in fit["text"]
    assert "urgent" not in text


def test_doctor_with_a_tiny_cache_applies_the_urgency_rule(tmp_path: Path) -> None:
    # A 4 MiB slab holds 2,048 tokens: the 2k slice resumes, the 4k one cannot be stored.
    reg = Registry(tmp_path / "reg")
    coding_loop(reg)
    text, out = lane_run(SimConfig(speed=5000, cap_mb=4), reg, (2000, 4000))
    by_topic = {f["topic"]: f for f in out["findings"]}
    cmax = out["numbers"]["cmax"]
    assert 0 < cmax < 2048
    assert by_topic["cmax"]["level"] == "warn"
    below = out["numbers"]["cmax_below"]
    assert cmax < below < 4000  # the 4k slice's span: the bracket's top is under 4,000
    assert by_topic["cmax"]["text"].startswith(f"urgent: Cmax is under {below:,} tokens")
    assert "does not reach past the system prompt" in text
    assert by_topic["fit"]["level"] == "warn" and "does not fit in one entry" in text
    assert "HALOGEN_CACHE_MB" in by_topic["cmax"]["text"]
    assert out["healthy"] is False


def test_doctor_without_a_probe_of_this_build_says_so(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    coding_loop(reg)
    with SimServer(SimConfig(speed=5000)) as sim:
        res = run_cli("doctor", "--worker", sim.url, "--registry", str(reg.root), "--json")
    out = orjson.loads(res.stdout)
    texts = {f["topic"]: f["text"] for f in out["findings"]}
    assert "no probe receipt" in texts["cmax"] and out["numbers"]["cmax"] is None
    assert "no warm measurement on this build" in texts["fit"]


# -- Cmax is the best evidence across this build's receipts (issue 20, case 10) ---------------


def test_a_later_smaller_probe_does_not_lower_cmax(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    sha = coding_loop(reg)
    with SimServer(SimConfig(speed=5000)) as sim:
        with Worker(sim.url) as w:
            warm(reg, reg.head("coding-loop"), w)
            first = run_probe(reg, w, ProbeOptions(sizes=LANE_SIZES, foreign=9))
            later = run_probe(reg, w, ProbeOptions(sizes=(16000,), foreign=9, survival=True))
        res = run_cli("doctor", "--worker", sim.url, "--registry", str(reg.root), "--json")
    assert first.cmax is not None and later.cmax is not None
    assert abs(first.cmax / 43_518 - 1) < 0.02 and abs(later.cmax / 11_350 - 1) < 0.02
    assert later.build.build_id == first.build.build_id
    out = orjson.loads(res.stdout)
    by_topic = {f["topic"]: f for f in out["findings"]}
    assert out["numbers"]["cmax"] == first.cmax
    assert "the best of 2 probes of this build" in by_topic["cmax"]["text"]
    assert first.at in by_topic["cmax"]["text"] and "at least" in by_topic["cmax"]["text"]
    fit = by_topic["fit"]
    assert fit["level"] == "ok" and f"coding-loop ({sha[:12]}): fits" in fit["text"]
    assert "not proven" not in res.stdout.decode()


def test_unreadable_or_foreign_receipts_prove_nothing(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    coding_loop(reg)
    deep = b"[" * 100_000 + b"]" * 100_000
    other = b'{"build": {"build_id": "other"}, "cmax": 9}'
    for i, raw in enumerate((b"{not json", deep, other)):

        def render(_json: Path, _md: Path, raw: bytes = raw) -> tuple[bytes, bytes]:
            return raw, b"# v\n"

        reg.write_probe_receipt(f"20250101T00000{i}.000000Z", render)
    with SimServer(SimConfig(speed=5000)) as sim:
        res = run_cli("doctor", "--worker", sim.url, "--registry", str(reg.root), "--json")
    assert b"Traceback" not in res.stderr
    out = orjson.loads(res.stdout)
    assert out["numbers"]["cmax"] is None


def test_doctor_names_the_alignment_on_an_aligned_engine(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    text = probe_slice(builtin_corpus(32000), 32000, header="coding-loop system prompt")
    reg.add(text, name="coding-loop")
    with SimServer(SimConfig.for_profile("dense", speed=5000)) as sim:
        with Worker(sim.url) as w:
            warm(reg, reg.head("coding-loop"), w)
            run_probe(reg, w, ProbeOptions(sizes=(32000,), foreign=2))
        res = run_cli("doctor", "--worker", sim.url, "--registry", str(reg.root), "--json")
    out = orjson.loads(res.stdout)
    by_topic = {f["topic"]: f["text"] for f in out["findings"]}
    assert out["numbers"]["alignment"] == 2048 and out["numbers"]["cmax"] % 2048 == 0
    assert "multiples of the server's 2,048-token alignment" in by_topic["cmax"]
    assert (
        "fits" in by_topic["fit"] and "within the server's 2,048-token alignment" in by_topic["fit"]
    )


def test_a_tampered_head_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    sha = coding_loop(reg)
    flip_byte(reg.object_path(sha))
    with SimServer(SimConfig(speed=5000)) as sim:
        res = run_cli("doctor", "--worker", sim.url, "--registry", str(reg.root), "--json")
    assert res.returncode == 1, res.stderr
    fit = next(f for f in orjson.loads(res.stdout)["findings"] if f["topic"] == "fit")
    assert fit["level"] == "warn" and "cannot be used" in fit["text"]


@given(
    span=st.integers(-5, 100_000),
    cmax=st.integers(-5, 100_000),
    lower_bound=st.booleans(),
    alignment=st.sampled_from([0, 1, 16, 2048]),
)
def test_judge_fit_never_says_fits_beyond_the_allowance(
    span: int, cmax: int, lower_bound: bool, alignment: int
) -> None:
    verdict, why = judge_fit(span, cmax, lower_bound=lower_bound, alignment=alignment)
    assert why
    if verdict == "fits":
        assert span >= 1 and cmax >= span - allowance(span, alignment)
        if cmax < span - allowance(span, 0):
            assert f"{alignment:,}-token alignment" in why
    elif span >= 1 and cmax >= 0:
        assert verdict == ("not_proven" if lower_bound else "does_not_fit")
    else:
        assert verdict == "unverified"


def test_doctor_functions_refuse_wrong_types() -> None:
    calls: list[Callable[[], object]] = [
        lambda: doctor(None),  # type: ignore[arg-type]
        lambda: doctor("http://127.0.0.1:1"),  # type: ignore[arg-type]
        lambda: diagnose(3, {}, None),  # type: ignore[arg-type]
        lambda: diagnose("halogen", [], None),  # type: ignore[arg-type]
        lambda: diagnose("halogen", {}, "cache"),  # type: ignore[arg-type]
    ]
    with SimServer(SimConfig(speed=5000)) as sim, Worker(sim.url) as w:
        calls.append(lambda: doctor(w, "registry"))  # type: ignore[arg-type]
        for call in calls:
            with pytest.raises(UsageError):
                call()
        assert sim.requests() == []


def test_llamacpp_slots_are_weighed_against_the_loops_and_cache_ram_is_named() -> None:
    from prefixreg.verbs.doctor.engines import diagnose_slots

    one = diagnose("llamacpp", {}, None)
    diagnose_slots(one, {"total_slots": 2}, loops=1)
    assert [f.level for f in one.findings if f.topic == "slots"] == ["ok"]
    assert one.numbers["total_slots"] == 2
    (ram,) = [f.text for f in one.findings if f.topic == "cache-ram"]
    assert "--cache-ram" in ram and "0 turns it off" in ram and "snapshot" in ram
    two = diagnose("llamacpp", {}, None)
    diagnose_slots(two, {"total_slots": 2}, loops=2)  # no slot left for foreign traffic
    (info,) = [f for f in two.findings if f.topic == "slots"]
    assert info.level == "info" and "-np 3" in info.text and two.healthy
    three = diagnose("llamacpp", {}, None)
    diagnose_slots(three, {"total_slots": 2}, loops=3)  # sessions evict each other
    (warn,) = [f for f in three.findings if f.topic == "slots"]
    assert warn.level == "warn" and "-np 4" in warn.text and not three.healthy
    unknown = diagnose("llamacpp", {}, None)
    diagnose_slots(unknown, None)
    assert any("does not say total_slots" in f.text for f in unknown.findings)


def test_doctor_on_llamacpp_reads_the_slots_from_props(tmp_path: Any) -> None:
    from tests.fakeserver import FakeServer, Reply
    from tests.test_snapshots import PROPS

    with FakeServer() as srv:
        srv.route("GET", "/props", Reply(json={**PROPS, "total_slots": 1}))
        srv.route("GET", "/health", Reply(json={"status": "ok"}))
        res = run_cli("doctor", "--worker", srv.url, "--loops", "2", "--registry", str(tmp_path))
    assert res.returncode == 1, res.stderr
    assert b"total_slots 1 for 2 concurrent loop calls" in res.stdout
    assert b"--cache-ram" in res.stdout


def test_a_vllm_flag_warning_reads_the_warms_on_this_server_only(tmp_path: Path) -> None:
    # Two vLLM servers of one build, one started without --enable-prompt-tokens-details: its
    # warm came back without a count; the doctor of the other must not blame that on it.
    reg = Registry(tmp_path / "reg")
    reg.add("You are a careful coding agent.\n" * 80, name="loop")
    off = SimConfig(speed=5000, engine="vllm", cache_report=False)
    with SimServer(off) as quiet, SimServer(SimConfig(speed=5000, engine="vllm")) as told:
        with Worker(quiet.url) as w:
            assert warm(reg, reg.head("loop"), w).verdict == "unverified"
        with Worker(told.url) as w, Worker(quiet.url) as q:
            assert w.server_build().build_id == q.server_build().build_id  # no flag in it
            other, same = doctor(w, reg), doctor(q, reg)
    assert "warn" not in {f.level for f in other.findings if f.topic == "report"}
    assert "warn" in {f.level for f in same.findings if f.topic == "report"}


# -- Cmax is a bracket; urgent only when its top is under 4,000 (issue 33, case 3) ---------


def test_a_coarse_probe_never_calls_a_cache_urgent_on_the_bound_its_sizes_set(
    tmp_path: Path,
) -> None:
    """A 19 MiB slab holds 9,728 tokens: the 4k slice (2,593 tokens) resumes, the 16k one
    (11,374) cannot be stored. Cmax is then at least 2.5k and below 11.3k: no verdict on
    4,000 until `probe --bisect` narrows it, and then it reaches."""
    reg = Registry(tmp_path / "reg")
    coding_loop(reg)
    with SimServer(SimConfig(speed=5000, cap_mb=19)) as sim:
        with Worker(sim.url) as w:
            run_probe(reg, w, ProbeOptions(sizes=(4000, 16000), foreign=2))
        args = ("doctor", "--worker", sim.url, "--registry", str(reg.root))
        coarse = orjson.loads(run_cli(*args, "--json").stdout)
        res = run_cli(
            "probe",
            "--worker",
            sim.url,
            "--registry",
            str(reg.root),
            "--sizes",
            "4k,16k",
            "--foreign",
            "2",
            "--bisect",
            "--json",
        )
        # Exit 1: check 6 (refused stays 0) fails, the 16k slice's store was refused.
        assert res.returncode == 1, res.stderr
        fine = orjson.loads(run_cli(*args, "--json").stdout)
        text = run_cli(*args).stdout.decode()
    cmax = {f["topic"]: f for f in coarse["findings"]}["cmax"]
    low, top = coarse["numbers"]["cmax"], coarse["numbers"]["cmax_below"]
    assert abs(low / 2578 - 1) < 0.02 and abs(top / 11_350 - 1) < 0.02
    assert cmax["level"] == "info" and not cmax["text"].startswith("urgent")
    assert f"at least {low:,} and below {top:,} tokens" in cmax["text"]
    assert "--bisect" in cmax["text"] and coarse["numbers"]["reach"] == "not_proven"
    receipt = orjson.loads(res.stdout)
    legs = [c for c in receipt["calls"] if c["leg"] == "bisect-B"]
    assert legs and receipt["options"]["bisect"] is True
    low, top = fine["numbers"]["cmax"], fine["numbers"]["cmax_below"]
    assert low <= 9728 < top and (top - low) / low < 0.03  # the slab's 9,728 tokens, bracketed
    assert fine["numbers"]["reach"] == "reaches" and "urgent" not in text


@given(low=st.integers(0, 100_000), gap=st.integers(1, 100_000), top=st.booleans())
def test_judge_reach_is_urgent_only_when_the_bracket_top_is_under_4000(
    low: int, gap: int, top: bool
) -> None:
    below = low + gap if top else None
    verdict, why = judge_reach(low, below)
    assert (verdict == "urgent") == (below is not None and below <= URGENT_CMAX)
    assert (verdict == "reaches") == (low >= URGENT_CMAX and verdict != "urgent")
    assert f"{low:,}" in why
