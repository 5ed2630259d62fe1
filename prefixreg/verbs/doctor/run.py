"""`doctor`: what a worker's own `/health` and `/cache` say about its prompt cache, and how far
its cache reaches against the registered heads.

`diagnose` (pure) reads the two replies into findings in plain words, each quoting the
worker's fields and numbers, plus what to change. When entries are fixed-size slabs (Flash:
`last_entry_bytes` is `prompt_cache.cap_mb` MiB whatever the prompt) a bigger or longer-lived
cache comes from `cacheMb` (env HALOGEN_CACHE_MB), not from more entries, and all advice
says so. `diagnose_reach` (pure) sets Cmax against each registered head's span (its latest
warm on this build, a resumed one first). Cmax is the largest cached count a leg B was
served, of the B legs the judge did not call unverified, over *every* probe receipt of the
build: the best evidence wins (a later, smaller probe never lowers it). Cmax is a bracket: at
least that count, and below the span of the first larger size whose fresh tail did not resume
(`below`, the smallest over the receipts above the bottom; none when every size resumed). How
far the cache reaches is the judge's (`judge_reach`: urgent only when the bracket's top is
under its threshold, never on a bound the probe's sizes set), and so is a fit (`judge_fit`);
where the alignment shapes Cmax or a fit, the text names it.
Engine flags and counters, llama.cpp's slots and `--cache-ram`: see `doctor.engines`.

Nothing here guesses a number the server did not send: a missing field is said to be missing.
Receipts and measurements are read through the store; an unreadable receipt proves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from prefixreg.core.errors import (
    MalformedResponseError,
    PrefixregError,
    UsageError,
    WorkerHTTPError,
)
from prefixreg.core.jsonio import JSONValue, loads_object
from prefixreg.core.judge import URGENT_CMAX, judge_fit, judge_reach
from prefixreg.core.records import CacheCounters, strict_count
from prefixreg.registry.store import Registry
from prefixreg.server.counters import MEASURED_ENTRIES_PER_REQUEST, lru_survival_stores
from prefixreg.server.engines import ENGINES, METRICS
from prefixreg.server.worker import Worker
from prefixreg.verbs.doctor.engines import diagnose_engine, diagnose_slots
from prefixreg.verbs.doctor.findings import Diagnosis, Level
from prefixreg.verbs.measure.calls import head_warms

MIB: Final = 1 << 20
CACHE_SIZE_SETTING: Final = "the cache-size option `cacheMb` (env HALOGEN_CACHE_MB)"
ENTRIES_SETTING: Final = "HALOGEN_CACHE_ENTRIES"
# Halogen dense keeps ~64 KiB of KV per position (`slots x slot_ctx x 64 KiB` pool).
DENSE_BYTES_PER_POSITION: Final = 64 * 1024
THRASH_RATIO: Final = 0.9
THRASH_HIT_RATE: Final = 0.5
CAN_PROVE: Final = {
    "llamacpp": "per-call cached_tokens (an explicit 0 when cold) and its build from /props; "
    "llama.cpp has no cache-entry counters, so capacity, survival and eviction are only "
    "measured with calls (`prefixreg probe`)",
    "vllm": "per-call cached_tokens only with --enable-prompt-tokens-details (without it every "
    "call is unverified, never cold) and its build from /version and /v1/models; token "
    "counters on /metrics",
    "sglang": "per-call cached_tokens (a null read as 0 only with enable_cache_report on in "
    "/server_info) and its build, flags included, from /server_info; token counters on /metrics",
    "trtllm": "per-call cached_tokens (always sent) and its build from /version and /v1/models; "
    "token counters on /prometheus/metrics",
    "ollama": "per-call cached_tokens from v0.33.3 and its build from /api/version; no counters",
    "generic": "per-call cached_tokens only if the server sends usage.prompt_tokens_details or "
    "timings.cache_n; its build is only the model ids of /v1/models; no counters",
}
FIT_WORDS: Final[dict[str, tuple[Level, str, str]]] = {
    "fits": ("ok", "fits", "."),
    "does_not_fit": ("warn", "does not fit", f". Raise {CACHE_SIZE_SETTING}."),
    "not_proven": ("info", "not proven to fit", "; probe a larger size."),
    "unverified": ("info", "not known to fit", "."),
}


@dataclass(frozen=True, slots=True)
class ProbeReach:
    """A build's best probe receipt: Cmax, whether every B leg resumed whole (Cmax is then a
    lower bound), when, its sizes, and how many of the build's receipts were weighed."""

    cmax: int
    whole: bool
    at: str
    sizes: tuple[int, ...]
    receipts: int = 1
    below: int | None = None  # the bracket's top: Cmax is under it (None: no ceiling found)


@dataclass(frozen=True, slots=True)
class HeadSpan:
    """A named head's span on a build (None: not measured; `error`: failed verification;
    `missing`: its latest warm there, on the worker asked, came back without a cached count)."""

    name: str
    sha256: str
    tokens: int | None
    error: str | None = None
    missing: bool = False


def _raise_setting(slab: bool) -> str:
    fixed = f"{CACHE_SIZE_SETTING}, not {ENTRIES_SETTING} (entries are fixed slabs)"
    return f"raise {fixed if slab else ENTRIES_SETTING}"


def _diagnose_counters(d: Diagnosis, c: CacheCounters, block: Mapping[str, JSONValue]) -> None:
    cap = strict_count(block.get("cap_mb"))
    slab = bool(cap) and c.last_entry_bytes is not None and c.last_entry_bytes // MIB == cap
    d.numbers["slab_entries"] = slab
    if c.entries is not None and c.max_entries is not None:
        d.add("info", "entries", f"{c.entries} of max_entries {c.max_entries} entries in use.")
        per = MEASURED_ENTRIES_PER_REQUEST
        left = d.numbers["survival_estimate"] = lru_survival_stores(c.max_entries, per) // per
        text = f"With max_entries {c.max_entries} and {per} entries stored per prompt (system end "
        text += f"and history end), a prefix survives about {left} foreign prompts before it is "
        text += "evicted (`prefixreg probe --survival` measures it)."
        if left <= 3:
            text += f" That is few for a loop that pauses: {_raise_setting(slab)}, or run "
            d.add("warn", "survival", text + "`prefixreg keepalive`.")
        else:
            d.add("info", "survival", text)
    elif c.entries is not None:
        d.add("info", "entries", f"{c.entries} entries in use; /cache reports no max_entries.")
    if c.last_entry_bytes is not None:
        size, raw_cap = c.last_entry_bytes, block.get("cap_mb")
        note = f" (/health prompt_cache.cap_mb is {raw_cap})" if raw_cap is not None else ""
        d.add("info", "entry_size", f"last_entry_bytes {size:,} = {size / MIB:.1f} MiB{note}.")
    if slab:
        text = f"Entries are fixed slabs of {c.last_entry_bytes or 0:,} bytes (/health "
        text += f"prompt_cache.cap_mb {cap}), whatever the prompt size: more entries "
        text += f"({ENTRIES_SETTING}) are more slabs of the same size. What one entry holds, and "
        d.add("info", "slab", text + f"the room for more, comes from {CACHE_SIZE_SETTING}.")
    rate = None
    if c.hits is not None and c.misses is not None:
        rate = c.hits / (c.hits + c.misses) if c.hits + c.misses else None
        d.numbers["hit_rate"] = None if rate is None else round(rate, 4)
        said = "no lookups yet (hits 0, misses 0)."
        if rate is not None:
            said = f"hits {c.hits:,}, misses {c.misses:,}: hit rate {rate:.1%}."
        d.add("info", "hit_rate", said)
    if c.stores is not None and c.evicted is not None:
        d.numbers["evicted_per_store"] = round(c.evicted / c.stores, 4) if c.stores else None
        # Once an LRU is full every store evicts, so the ratio alone only says "full". It is
        # thrashing when entries are evicted that fast *and* lookups rarely find anything.
        churn = c.stores >= 10 and c.evicted >= THRASH_RATIO * c.stores
        moved = f"stores {c.stores:,}, evicted {c.evicted:,}"
        if churn and rate is not None and rate < THRASH_HIT_RATE:
            fix = f"Raise {ENTRIES_SETTING} (or HALOGEN_CACHE_MB on dense)"
            text = f"stores {c.stores:,} against evicted {c.evicted:,} with a hit rate of "
            text += f"{rate:.1%}: nearly every store evicts an entry before it is reused, so "
            text += "prefixes rarely live long enough to be resumed. "
            text += f"{'R' + _raise_setting(slab)[1:] if slab else fix}, cut foreign traffic, or "
            d.add("warn", "thrashing", text + "run `prefixreg keepalive`.")
        elif churn:
            text = f"{moved}: the cache is full and turns over, but lookups still hit."
            d.add("info", "thrashing", text)
        else:
            d.add("ok", "thrashing", f"{moved}.")
    if c.refused:
        text = f"refused {c.refused:,}: stores the budget could not take. Raise "
        d.add("warn", "refused", text + f"{CACHE_SIZE_SETTING}.")


def diagnose(
    profile: str, health: Mapping[str, JSONValue], cache_raw: Mapping[str, object] | None
) -> Diagnosis:
    """Read a worker's `/health` and `/cache` replies into findings (pure).

    Raises:
        UsageError: arguments of the wrong types.
    """
    given: list[object] = [profile, health, cache_raw]
    if not isinstance(given[0], str) or not isinstance(given[1], Mapping):
        raise UsageError("diagnose takes a profile name and the /health reply (a mapping)")
    if given[2] is not None and not isinstance(given[2], Mapping):
        raise UsageError("the /cache reply must be a mapping or None")
    d = Diagnosis(profile=profile)
    block = health.get("prompt_cache")
    block = block if isinstance(block, dict) else {}
    d.numbers["prompt_cache"] = dict(block) if block else None
    if profile != "halogen":
        can = CAN_PROVE.get(profile, "nothing beyond per-call usage")
        d.add("info", "profile", f"server profile {profile}: it can prove {can}.")
        return d
    if block.get("enabled") is False:
        d.add("warn", "enabled", "/health prompt_cache.enabled is false: nothing will resume.")
    if (mode := block.get("mode")) is not None:
        text = f"prompt_cache.mode {mode} (2 resumes any shared prefix, 1 exact repeats, 0 off)."
        d.add("info", "mode", text)
    if block.get("bitwise_identical_to_cold") is False:
        text = "bitwise_identical_to_cold is false: a resumed answer may differ from a cold one."
        d.add("info", "bitwise", text)
    if cache_raw is None:
        d.add("warn", "cache", "/cache is not available: counters cannot be read.")
        return d
    counters = CacheCounters.from_server(cache_raw)
    d.numbers["cache"] = counters.to_dict()
    _diagnose_counters(d, counters, block)
    # Dense: can the configured budget hold even one full-context entry?
    cap_bytes = strict_count(cache_raw.get("cap_bytes"))
    slot_ctx = strict_count(health.get("slot_ctx")) or strict_count(health.get("context"))
    if cap_bytes is not None and slot_ctx is not None:
        full = d.numbers["full_context_entry_bytes"] = slot_ctx * DENSE_BYTES_PER_POSITION
        if cap_bytes < full:
            text = f"cap_bytes {cap_bytes:,} cannot hold one full-context entry (slot_ctx "
            text += f"{slot_ctx:,} x 64 KiB = {full:,} bytes): the cache reports itself enabled "
            text += "and never hits. Raise HALOGEN_CACHE_MB (or leave it empty for auto)."
            d.add("warn", "budget", text)
        else:
            text = f"cap_bytes {cap_bytes:,} holds {cap_bytes // full} full-context entries."
            d.add("ok", "budget", text)
    return d


def _receipt_reach(path: Path, raw: bytes, build_id: str) -> ProbeReach | None:
    try:
        receipt = loads_object(raw, path=path)
    except PrefixregError:
        return None  # an unreadable receipt proves nothing
    build, calls, options = receipt.get("build"), receipt.get("calls"), receipt.get("options")
    if not isinstance(build, dict) or build.get("build_id") != build_id:
        return None
    calls = calls if isinstance(calls, list) else []
    legs = [c for c in calls if isinstance(c, dict) and c.get("leg") in ("B", "bisect-B")]
    judged = [c.get("evidence") for c in legs if c.get("verdict") in ("resumed", "partial", "cold")]
    counts = [strict_count(ev.get("cached_tokens")) for ev in judged if isinstance(ev, dict)]
    if not (valid := [n for n in counts if n is not None]):
        return None
    sizes = options.get("sizes") if isinstance(options, dict) else None
    at, whole = receipt.get("at"), all(c.get("verdict") == "resumed" for c in legs)
    ints = tuple(s for s in sizes if type(s) is int) if isinstance(sizes, list) else ()
    return ProbeReach(max(valid), whole, at if isinstance(at, str) else "?", ints, 1, _below(legs))


def _below(legs: list[dict[str, JSONValue]]) -> int | None:
    """The span of the first size above every resumed one whose fresh tail did not resume."""
    sized = [(n, c) for c in legs if (n := strict_count(c.get("size"))) is not None]
    top = max((n for n, c in sized if c.get("verdict") == "resumed"), default=0)
    missed = sorted((n, c) for n, c in sized if n > top and c.get("verdict") in ("partial", "cold"))
    if not missed:
        return None
    first = missed[0][1]
    ev = first.get("evidence")
    prompt = strict_count(ev.get("prompt_tokens")) if isinstance(ev, dict) else None
    return strict_count(first.get("span_tokens")) or prompt


def best_reach(registry: Registry, build_id: str) -> ProbeReach | None:
    """The best Cmax evidence of `build_id` over all its probe receipts: the highest bottom,
    and the lowest top above it."""
    found = [r for p, raw in registry.probe_receipts() if (r := _receipt_reach(p, raw, build_id))]
    best = max(found, key=lambda r: (r.cmax, not r.whole), default=None)
    if best is None:
        return None
    tops = [r.below for r in found if r.below is not None and r.below > best.cmax]
    return replace(best, receipts=len(found), below=min(tops, default=None))


def head_spans(registry: Registry, build_id: str, worker: str | None = None) -> list[HeadSpan]:
    """Every named head and its span on `build_id`: its latest warm's, a resumed one first;
    `missing` read from the warms on `worker` only (another server of one build may differ in
    a flag its build does not show, such as vLLM's --enable-prompt-tokens-details)."""
    out = []
    for name, sha in registry.names().items():
        try:
            head = registry.head(name)
            warms = head_warms(registry, head, build_id)
        except PrefixregError as exc:
            out.append(HeadSpan(name, sha, None, str(exc)))
            continue
        spans = [
            (m.outcome.verdict == "resumed", i, span)
            for i, m in enumerate(warms)
            if (span := m.outcome.span_tokens)
        ]
        here = [m for m in warms if worker is None or m.worker == worker]
        reason = here[-1].outcome.reason if here else None
        missing = reason is not None and "cached_tokens missing" in reason
        out.append(HeadSpan(name, head.sha256, max(spans)[2] if spans else None, missing=missing))
    return out


def diagnose_reach(
    d: Diagnosis, probe: ProbeReach | None, spans: list[HeadSpan], build_id: str, alignment: int = 0
) -> None:
    """Cmax of this build's best probe against the registered heads (pure)."""
    d.numbers["cmax"] = None if probe is None else probe.cmax
    d.numbers["alignment"] = alignment
    if probe is None:
        text = f"no probe receipt with a Cmax for this build ({build_id}): `prefixreg probe` "
        d.add("info", "cmax", text + "measures how many tokens one entry resumes.")
    else:
        best = f"the best of {probe.receipts} probes of this build: " if probe.receipts > 1 else ""
        sizes = ", ".join(f"{s:,}" for s in probe.sizes) or "?"
        where = f"{best}probe of {probe.at}, sizes {sizes} characters"
        if alignment > 1:
            where += f"; counted in multiples of the server's {alignment:,}-token alignment"
        verdict, why = judge_reach(probe.cmax, probe.below)
        d.numbers["cmax_below"] = probe.below
        d.numbers["reach"] = verdict
        if verdict == "urgent":
            text = f"urgent: {why} ({where}): the cache does not reach past the system prompt, "
            text += "so a loop re-reads everything after it on every call. "
            d.add("warn", "cmax", text + f"Raise {CACHE_SIZE_SETTING}.")
        elif verdict == "not_proven":
            text = f"{why} ({where}). `prefixreg probe --bisect` narrows the bracket between the "
            d.add("info", "cmax", text + f"sizes; below {URGENT_CMAX:,} would be urgent.")
        else:
            d.add("info", "cmax", f"{why} ({where}).")
    for p in spans:
        label = f"{p.name} ({p.sha256[:12]})"
        if p.error is not None:
            d.add("warn", "fit", f"{label}: cannot be used: {p.error} (`prefixreg verify`).")
        elif p.tokens is None:
            text = f"{label}: no warm measurement on this build: `prefixreg warm {p.name}` measures"
            d.add("info", "fit", text + " its token span.")
        elif probe is None:
            text = f"{label}: about {p.tokens:,} tokens; no Cmax to compare it with."
            d.add("info", "fit", text)
        else:
            # Under the bracket's top, a head's span is not known not to fit: a lower bound.
            bound = probe.whole or (probe.below is not None and p.tokens < probe.below)
            fit, why = judge_fit(p.tokens, probe.cmax, lower_bound=bound, alignment=alignment)
            level, words, advice = FIT_WORDS[fit]
            d.add(level, "fit", f"{label}: {words} in one entry: {why}{advice}")


def doctor(worker: Worker, registry: Registry | None = None, *, loops: int = 1) -> Diagnosis:
    """Read `/health` (and `/cache` on Halogen) and diagnose; with a registry, also weigh this
    build's probe receipts against the registered heads.

    Raises:
        UsageError: `worker` is not a `Worker`, or `registry` not a `Registry` or None.
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    given: list[object] = [worker, registry, loops]
    if not isinstance(given[0], Worker) or not isinstance(given[1], (Registry, type(None))):
        raise UsageError("doctor takes a Worker and, optionally, a Registry")
    if type(given[2]) is not int or loops < 1:
        raise UsageError(f"doctor: loops must be a whole number >= 1, not {loops!r}")
    profile = worker.detect_profile()
    health = worker.health() if profile == "halogen" else {}
    diagnosis = diagnose(profile, health, worker.cache_raw() if profile == "halogen" else None)
    spans: list[HeadSpan] = []
    if registry is not None:
        build = worker.server_build()
        spans = head_spans(registry, build.build_id, worker.url)
    if profile in ENGINES:
        build, metrics = worker.server_build(), METRICS.get(profile)
        try:
            samples = None if metrics is None else worker.metrics(metrics.path)
        except (WorkerHTTPError, MalformedResponseError):
            samples = None  # counters that cannot be read are said to be missing
        diagnose_engine(diagnosis, build, samples, missing=any(s.missing for s in spans))
    if profile == "llamacpp":
        diagnose_slots(diagnosis, worker.props(), loops)
    if registry is not None:
        diagnosis.numbers["build_id"] = build.build_id
        probe = best_reach(registry, build.build_id)
        diagnose_reach(diagnosis, probe, spans, build.build_id, build.snapshot_align)
    return diagnosis
