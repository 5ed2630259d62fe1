"""The pure cache model: LRU survival, stores/evictions, counter lag, dense alignment."""

from __future__ import annotations

from typing import Any, NamedTuple

from prefixreg.core.prefix import fresh_tail
from prefixreg.sim.cache import PromptCache, snapshot_places
from prefixreg.sim.config import SimConfig
from prefixreg.sim.tokenizer import RenderedPrompt, render_chat


class Admitted(NamedTuple):
    cached: int
    stored: int
    refused: int


def admit(cache: PromptCache, prompt: RenderedPrompt) -> Admitted:
    """One request whose prefill takes no time: look up, count, then store."""
    before = cache.counters()
    cached = cache.lookup(prompt)
    cache.count(cached)
    cache.store(prompt)
    after = cache.counters()
    return Admitted(
        cached, after["stores"] - before["stores"], after["refused"] - before["refused"]
    )


def flash(**kw: Any) -> PromptCache:
    return PromptCache(SimConfig(**{"token_bytes": 0, **kw}))  # no slab wall unless asked


def dense(**kw: Any) -> PromptCache:
    config = SimConfig.for_profile("dense", **{"entry_bytes": 1, "dedupe_snapshots": False, **kw})
    return PromptCache(config)


def prompt(system: str) -> RenderedPrompt:
    return render_chat([("system", system), ("user", fresh_tail())])


def words(seed: str, n: int) -> str:
    return " ".join(f"{seed}{i}" for i in range(n))


def test_prefix_survives_three_foreign_prompts_and_not_four() -> None:
    for foreign, survives in ((3, True), (4, False)):
        cache = flash()
        admit(cache, prompt("the prefix"))
        for i in range(foreign):
            admit(cache, prompt(f"foreign {i}"))
        assert (admit(cache, prompt("the prefix")).cached > 0) is survives


def test_a_hit_refreshes_recency() -> None:
    cache = flash()
    admit(cache, prompt("the prefix"))
    for i in range(3):
        admit(cache, prompt(f"foreign {i}"))
        assert admit(cache, prompt("the prefix")).cached > 0  # each check refreshes it
    assert cache.counters()["entries"] == 8


def test_once_full_every_store_evicts_and_entries_stay_at_capacity() -> None:
    cache = flash()
    for i in range(20):
        before = cache.counters()
        out = admit(cache, prompt(f"p{i % 5}"))
        after = cache.counters()
        assert out.stored == after["stores"] - before["stores"] == 2
        if before["entries"] == 8:
            assert after["evicted"] - before["evicted"] == after["stores"] - before["stores"]
        assert after["entries"] == min(2 * (i + 1), 8)
        assert after["stores"] - after["evicted"] == after["entries"]
        assert after["refused"] == 0
        assert after["last_entry_bytes"] == 116389652
        assert after["bytes"] == after["entries"] * 116389652


def test_counter_lag_delays_hits_misses_and_saved_by_one_request() -> None:
    cache = flash(counter_lag=1)
    p = prompt("lagged")
    admit(cache, p)
    assert (cache.counters()["hits"], cache.counters()["misses"]) == (0, 0)
    assert cache.counters()["stores"] == 2  # stores are not lagged
    saved = admit(cache, p).cached
    c = cache.counters()
    assert (c["hits"], c["misses"], c["prompt_tokens_saved"]) == (0, 1, 0)
    admit(cache, prompt("other"))
    c = cache.counters()
    assert (c["hits"], c["misses"], c["prompt_tokens_saved"]) == (1, 1, saved)


def test_counter_lag_zero_is_immediate() -> None:
    cache = flash(counter_lag=0)
    p = prompt("now")
    admit(cache, p)
    saved = admit(cache, p).cached
    c = cache.counters()
    assert (c["hits"], c["misses"], c["prompt_tokens_saved"]) == (1, 1, saved)
    assert c["hit_rate"] == 0.5


def test_flash_entries_per_request_adds_full_entry() -> None:
    cache = flash(entries_per_request=4)
    p = prompt("full entry")
    admit(cache, p)
    assert admit(cache, p).cached == p.n  # the "full" place serves an exact repeat whole


def test_flash_snapshot_align_rounds_places_down() -> None:
    cache = flash(snapshot_align=64)
    p = prompt(words("w", 300))
    assert all(place % 64 == 0 for place in snapshot_places(p, cache.config))
    admit(cache, p)
    cached = admit(cache, p).cached
    assert cached % 64 == 0
    assert p.n - 7 - 63 <= cached <= p.n - 7


def test_dense_counts_are_multiples_of_2048_and_below_the_prompt() -> None:
    cache = dense()
    p = prompt(words("d", 5000))
    assert admit(cache, p).cached == 0
    cached = admit(cache, p).cached
    assert cached > 0
    assert cached % 2048 == 0
    assert cached < p.n
    # Partial resume: a new tail after the same system text still resumes aligned rows.
    # The common prefix is the system message plus 5 tokens of the new user message.
    assert admit(cache, prompt(words("d", 5000))).cached == (p.n - 19 + 5) // 2048 * 2048


def test_dense_prompt_under_2048_never_hits() -> None:
    cache = dense()
    p = prompt(words("s", 300))
    assert p.n < 2048
    for _ in range(3):
        assert admit(cache, p).cached == 0
    assert cache.counters()["stores"] == 0


def test_zero_entries_disables_the_cache() -> None:
    cache = flash(max_entries=0)
    p = prompt("off")
    admit(cache, p)
    assert admit(cache, p).cached == 0
    assert cache.counters()["stores"] == 0


def test_a_dense_hit_moves_the_matched_snapshot_to_most_recent() -> None:
    # Dense resumes from any snapshot sharing a prefix, so a hit on A's snapshot from a
    # different prompt B stores B's own place but must also make A the most recent of the
    # older entries; otherwise the next eviction takes A instead of C.
    base = words("a", 3000)
    cache = dense()
    a = prompt(base + " " + words("x", 1500))
    first = admit(cache, a)
    assert first.cached == 0
    own = admit(cache, a).cached  # A's own snapshot: everything aligned below its length
    assert own > 2048
    admit(cache, prompt(words("c", 3000)))  # C: stored after A
    hit = admit(cache, prompt(base + " " + words("y", 1500)))  # B shares A's first ~3000
    assert hit.cached >= 2048
    admit(cache, prompt(words("f", 3000)))  # one eviction: the least recently used goes
    # Only A's own snapshot resumes `own`; B's would resume just the shared 2048.
    assert admit(cache, a).cached == own, "A was refreshed by B's hit, so C went first"


def test_no_snapshot_exists_before_its_store() -> None:
    # A lookup before the first request's store finds nothing: stores follow the prefill.
    cache = flash(counter_lag=0)
    p = prompt("concurrent")
    assert [cache.lookup(p) for _ in range(4)] == [0, 0, 0, 0]
    for _ in range(4):
        cache.count(0)
    cache.store(p)
    assert cache.lookup(p) == p.n - 7


def test_a_snapshot_the_slab_cannot_take_is_refused() -> None:
    p = prompt(words("w", 200))
    places = snapshot_places(p, flash().config)  # system end and history end
    # Room for the system end snapshot only: the history end one is refused.
    cache = flash(token_bytes=10, entry_bytes=10 * places[0])
    out = admit(cache, p)
    assert (out.stored, out.refused) == (1, 1)
    c = cache.counters()
    assert (c["stores"], c["refused"], c["entries"]) == (1, 1, 1)
    assert admit(cache, prompt(words("w", 200))).cached == places[0]
    # A slab too small for either: everything refused, nothing resumes.
    tiny = flash(token_bytes=10, entry_bytes=10)
    admit(tiny, p)
    assert admit(tiny, p).cached == 0
    assert (tiny.counters()["stores"], tiny.counters()["refused"]) == (0, 4)


def test_a_budget_without_room_for_one_entry_refuses_every_store() -> None:
    cache = dense(cap_mb=1, entry_bytes=2 << 20)  # a budget too small for one entry
    p = prompt(words("d", 3000))
    admit(cache, p)
    assert admit(cache, p).cached == 0
    assert (cache.counters()["stores"], cache.counters()["refused"]) == (0, 2)


def test_dense_keeps_no_duplicate_snapshots_and_flash_does() -> None:
    p = prompt(words("d", 3000))
    deduped = dense(dedupe_snapshots=True)
    for _ in range(3):
        admit(deduped, p)
    assert (deduped.counters()["entries"], deduped.counters()["stores"]) == (1, 1)
    plain = flash()
    for _ in range(3):
        admit(plain, p)
    assert (plain.counters()["entries"], plain.counters()["stores"]) == (6, 6)  # measured on 0.7.0
