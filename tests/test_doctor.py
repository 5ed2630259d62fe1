"""`prefixreg doctor`: findings in plain words from a worker's own /health and /cache."""

from __future__ import annotations

from typing import Any

import orjson

from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.doctor import diagnose
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
    assert "3,279" in text and "3,271" in text and "HALOGEN_CACHE_ENTRIES" in text
    assert "111.0 MiB" in text and "cap_mb is 110" in text
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
