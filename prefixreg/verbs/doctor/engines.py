"""`doctor` on the engines users run (vLLM, SGLang, TensorRT-LLM, Ollama): the exact flag each
needs, read against what the server says of itself (`server.engines`). On llama.cpp,
`diagnose_slots` (pure) sets `/props` `total_slots` against the loops sharing the worker (each
concurrent loop call needs a slot holding its session, foreign traffic one more) and names
`--cache-ram`, the host-RAM prompt cache `/props` does not report (0 turns it off: an evicted
prompt is gone, only a snapshot restore avoids its re-prefill; on, it comes back from RAM and
a slot erase does not clear it).

`diagnose_engine` (pure) names the flag that makes each call report its cached count and
whether it is on: SGLang says so in `/server_info` (`enable_cache_report`, `enable_metrics`);
Ollama by its version (the count ships from v0.33.3); vLLM never says, so the flag is a
warning only when this build's own warm measurements came back with the count missing (else
it is named as what to check); TensorRT-LLM always reports. The engine's Prometheus counters
give the cache's hit rate over the server's life; none are read as 0 when absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from prefixreg.core.records import ServerBuild, strict_count
from prefixreg.server import engines
from prefixreg.verbs.doctor.findings import Diagnosis, Level

OLLAMA_CACHE_RAM: Final = (
    "Ollama passes no --cache-ram to its llama.cpp runner, so every runner keeps llama.cpp's "
    "8 GiB (8192 MiB) host prompt cache (ollama issue #18264): there is nothing to set there; "
    "OLLAMA_NUM_PARALLEL, OLLAMA_CONTEXT_LENGTH and OLLAMA_KV_CACHE_TYPE are the knobs."
)
CACHE_RAM: Final = (
    "--cache-ram (the host-RAM prompt cache, MiB; 0 turns it off) is not reported by "
    "/props. Off, an evicted prompt is gone: only a snapshot restore (`prefixreg snapshot "
    "save`) avoids its re-prefill. On, an evicted prompt comes back from RAM, and a slot "
    "erase does not clear it (probe's eviction counts then overstate the loss)."
)


def _report_flag(d: Diagnosis, build: ServerBuild, missing: bool) -> None:
    profile, identity = build.profile, build.identity
    flag = engines.FLAGS[profile][0]
    if profile == "sglang":
        on = identity.get("enable_cache_report")
        if on is True:
            text = "/server_info enable_cache_report is true: a null count is read as 0."
            d.add("ok", "report", text + " Native /generate always sends meta_info.cached_tokens.")
        else:
            text = f"/server_info enable_cache_report is {on}: the OpenAI usage carries no cached "
            text += f"count, so warm is unverified. Start SGLang with {flag}."
            d.add("warn", "report", text)
    elif profile == "vllm":
        said = f"vLLM sends usage.prompt_tokens_details.cached_tokens only with {flag} (off by "
        said += "default) and no route says whether it is on"
        if missing:
            text = f"{said}: warm calls on this server came back without it. Restart vllm serve "
            d.add("warn", "report", text + f"with {flag}.")
        else:
            d.add("info", "report", f"{said}; if warm says 'cached_tokens missing', add {flag}.")
    elif profile == "ollama":
        version = identity.get("version")
        if engines.ollama_reports(version):
            d.add("ok", "report", f"Ollama {version} sends prompt_eval_cached_count.")
        else:
            text = f"Ollama {version} sends no cached count (prompt_eval_cached_count and the "
            text += "OpenAI cached_tokens ship from v0.33.3): upgrade Ollama to 0.33.3 or later."
            d.add("warn", "report", text)
        d.add("info", "cache_ram", OLLAMA_CACHE_RAM)
    else:
        d.add("ok", "report", "TensorRT-LLM sends cached_tokens on every call (PR #7637).")


def diagnose_engine(
    d: Diagnosis, build: ServerBuild, samples: Mapping[str, float] | None, *, missing: bool
) -> None:
    """The engine's findings (pure): its reporting flag (`missing`: this build's warms came
    back without a count), then its counters (`samples`: its Prometheus text, None if off)."""
    _report_flag(d, build, missing)
    metrics, counters_flag = engines.METRICS.get(build.profile), engines.FLAGS[build.profile][1]
    if metrics is None:
        d.add("info", "counters", "Ollama exports no Prometheus counters: calls are the witness.")
        return
    prompt = None if samples is None else engines.metric_total(samples, metrics.prompt)
    cached = None if samples is None else engines.metric_total(samples, metrics.cached)
    if prompt is None or cached is None:
        where = f"{metrics.path} has no {metrics.prompt} / {metrics.cached}"
        turn_on = f": turn them on with {counters_flag}" if counters_flag else ""
        d.add("info", "counters", f"{where}{turn_on}; keepalive then counts by time alone.")
        return
    d.numbers["counters"] = {"prompt_tokens": prompt, "cached_tokens": cached}
    rate = f" ({cached / prompt:.1%})" if prompt else ""
    text = f"{metrics.path}: {cached:,.0f} of {prompt:,.0f} prompt tokens came from the cache "
    text += f"since the server started{rate}; keepalive counts foreign prompts with them."
    d.add("info", "counters", text)


def diagnose_slots(d: Diagnosis, props: Mapping[str, object] | None, loops: int = 1) -> None:
    """Add llama.cpp's slots against `loops` concurrent loop calls, and `--cache-ram` (pure)."""
    slots = None if props is None else strict_count(props.get("total_slots"))
    d.numbers["total_slots"] = slots
    if slots is None:
        d.add("info", "slots", "/props does not say total_slots: slots cannot be weighed.")
    elif slots <= loops:
        level: Level = "warn" if slots < loops else "info"
        who = "sessions evict each other" if slots < loops else "a foreign prompt evicts one"
        text = f"total_slots {slots} for {loops} concurrent loop calls: each needs a slot holding "
        text += f"its session and foreign traffic one more, so {who}. Start llama-server with "
        text += f"-np {loops + 1} (or more); `keepalive` refuses more heads than slots."
        d.add(level, "slots", text)
    else:
        text = f"total_slots {slots}: room for {loops} concurrent loop calls and foreign traffic."
        d.add("ok", "slots", text)
    d.add("info", "cache-ram", CACHE_RAM)
