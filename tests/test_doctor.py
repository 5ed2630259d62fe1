"""`prefixreg doctor`: findings in plain words from a worker's own /health and /cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.doctor.run import diagnose
from prefixreg.verbs.measure.warm import warm
from prefixreg.verbs.probe.corpus import builtin_corpus, probe_slice
from prefixreg.verbs.probe.run import ProbeOptions, run_probe
from tests.conftest import run_cli

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
    assert by_topic["cmax"]["text"].startswith(f"urgent: Cmax is {cmax:,} tokens")
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
    assert "no measurement on this build" in texts["fit"]
