"""Server profiles: how each is detected, what it proves per call, its identity. Pure.

- halogen: usage (cached only when > 0), `timings.cache_n` (Flash) and `/cache` counters:
  alone proves counter-level facts (hits, misses, evictions). Identity: `version`, model,
  chat template sha256, checkpoint format, context, slots, the `prompt_cache` block.
- llamacpp: usage (an explicit 0) and `timings.cache_n`. Identity: /props `build_info`,
  model path, n_ctx, total slots, the sha256 of `chat_template`.
- vllm: `usage.prompt_tokens_details` only with `--enable-prompt-tokens-details`.
  Identity: /version's version, each /v1/models id with its `max_model_len`.
- generic: usage, if sent. Identity: the sorted /v1/models ids (None without the route).

A count the server did not send is never read as zero (DESIGN §4). An identity says *what*
is serving, never how loaded: load fields (`in_flight`, `busy`, ...) never enter it, so an
idle and a busy server have one build id. A public receipt shows only its
`records.public_identity`.

The engines users run (vLLM, SGLang, TensorRT-LLM `trtllm`, Ollama), as each answers, read
from its own source (tests/fixtures/engines/README.md cites them):
- Detection, never from a port: SGLang's `/server_info` (or the older `/get_server_info`) is
  an object with boolean `enable_cache_report`, `enable_metrics`, `disable_radix_cache` and a
  string `version`; `/v1/models` cards `owned_by` "tensorrt_llm" (TensorRT-LLM) or "vllm";
  Ollama's `/api/version` (SGLang's Ollama shim has none). A field of the wrong type is "not
  this engine".
- The per-call count is `usage.prompt_tokens_details.cached_tokens` on every OpenAI route.
  Missing, it is a zero only where the engine's own rule makes it one *and* the flag for it
  is known on (`zero_rule`): SGLang alone (`_details_if_cached` sends it only when > 0, so
  with `enable_cache_report` read true from `/server_info` a null is a 0). vLLM (no route
  tells whether `--enable-prompt-tokens-details` is on; builds before #45171 drop a zero,
  later ones send it: PR #44475, which the issue cites, is not merged), TensorRT-LLM (always
  sends it, PR #7637) and Ollama (from v0.33.3, PR #17943; older never) have none: a missing
  count stays unverified.
- Prometheus counters (`METRICS`), the per-window witness where per-call counts are absent:
  vLLM `/metrics`, SGLang `/metrics` (with `--enable-metrics`), TensorRT-LLM
  `/prometheus/metrics` (its `/metrics` is a JSON list of iteration stats); Ollama has none.
  And the flags `doctor` names (`FLAGS`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final, NamedTuple

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject, JSONValue

ENGINES: Final = ("vllm", "sglang", "trtllm", "ollama")
SGLANG_FLAGS: Final = ("enable_cache_report", "enable_metrics", "disable_radix_cache")
OLLAMA_CACHED_SINCE: Final = (0, 33, 3)
_HALOGEN_IDENTITY: Final = ("model", "checkpoint_format", "context", "slots", "slot_ctx")


class Metrics(NamedTuple):
    """An engine's Prometheus route and its prompt-token (cached included) and cached counters."""

    path: str
    prompt: str
    cached: str


METRICS: Final[Mapping[str, Metrics]] = {
    "vllm": Metrics("/metrics", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    "sglang": Metrics("/metrics", "sglang:prompt_tokens_total", "sglang:cached_tokens_total"),
    "trtllm": Metrics(
        "/prometheus/metrics", "trtllm_prompt_tokens_total", "trtllm_prompt_cached_tokens_total"
    ),
}

# engine -> (the flag that makes each call report its cached count, the counters' flag)
FLAGS: Final[Mapping[str, tuple[str | None, str | None]]] = {
    "vllm": ("--enable-prompt-tokens-details", None),
    "sglang": ("--enable-cache-report", "--enable-metrics"),
    "trtllm": (None, "return_perf_metrics: true (--config YAML)"),
    "ollama": (None, None),
}


def sglang_info(body: object) -> JSONObject | None:
    """SGLang's `/server_info` body when it is one (see the module docstring), else None."""
    if not isinstance(body, dict) or not isinstance(body.get("version"), str):
        return None
    return body if all(type(body.get(flag)) is bool for flag in SGLANG_FLAGS) else None


def owned_by(models: object) -> str | None:
    """The engine `/v1/models` names as owner of every card: vllm (each card with an int
    `max_model_len` and a `permission` list), trtllm, sglang; else None."""
    data = models.get("data") if isinstance(models, dict) else None
    cards = [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
    owners = {c.get("owned_by") for c in cards}
    if not cards or len(owners) != 1:
        return None
    owner = owners.pop()
    if owner == "vllm":
        vllm = all(type(c.get("max_model_len")) is int and isinstance(c.get("permission"), list)
                   for c in cards)  # fmt: skip
        return "vllm" if vllm else None
    return {"tensorrt_llm": "trtllm", "sglang": "sglang"}.get(str(owner))


def ollama_version(body: object) -> str | None:
    """Ollama's `/api/version` string (`{"version": "0.x.y"}`), else None."""
    if not isinstance(body, dict) or len(body) != 1:
        return None
    version = body.get("version")
    return version if isinstance(version, str) else None


def sglang_identity(info: Mapping[str, JSONValue], models: JSONValue) -> JSONObject:
    """SGLang's build, flags included (a restart turning reporting off is another build, so a
    zero read under the flag cannot cross it)."""
    keys = ("version", "model_path", "page_size", "max_total_num_tokens")
    out: JSONObject = {key: info.get(key) for key in (*keys, *SGLANG_FLAGS)}
    return out | {"model_ids": served_ids(models)}


def served_ids(models: JSONValue) -> JSONValue:
    """The sorted model ids `/v1/models` lists; None without the route."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    return generic_identity(models)["model_ids"]


def engine_identity(version: JSONValue, models: JSONValue) -> JSONObject:
    """TensorRT-LLM's and Ollama's build: the version string and the served model ids."""
    raw = version.get("version") if isinstance(version, dict) else None
    return {"version": raw if isinstance(raw, str) else None, "model_ids": served_ids(models)}


def string_prompt_only(profile: str, identity: Mapping[str, JSONValue]) -> str | None:
    """Why this build's `/v1/completions` takes a string prompt only, never token IDs; None
    when it may take them. Halogen dense (no `version` in its identity: halogen-api.md
    §3.11) and Ollama are known string-only; Halogen Flash is unverified, so it is tried."""
    if profile == "halogen" and identity.get("version") is None:
        return "Halogen dense's /v1/completions takes a string prompt"
    if profile == "ollama":
        return "Ollama's /v1/completions takes a string prompt"
    return None


def zero_rule(profile: str, identity: Mapping[str, JSONValue]) -> str | None:
    """Why a missing cached count is a zero on this build, or None (it stays unverified)."""
    if profile == "sglang" and identity.get("enable_cache_report") is True:
        return "sglang: null prompt_tokens_details with enable_cache_report on is 0"
    return None


def ollama_reports(version: object) -> bool | None:
    """Whether this Ollama sends `prompt_eval_cached_count` (v0.33.3+); None: unreadable."""
    parts = version.split("-")[0].split(".") if isinstance(version, str) else ["?"]
    if not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts) >= OLLAMA_CACHED_SINCE


def metric_total(samples: Mapping[str, float], name: str) -> float | None:
    """The sum of `name`'s series over labels (SGLang splits by `cache_source`); None: none."""
    found = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return sum(found) if found else None


def window(
    metrics: Metrics,
    before: Mapping[str, float] | None,
    after: Mapping[str, float] | None,
    prompt_tokens: int | None,
) -> JSONObject | None:
    """The counters' moves over one call's window (a witness where its own count is absent;
    verdicts still come from that count), `attributed` when the window is the call's alone
    (the prompt counter moved by exactly its prompt tokens; a foreign call adds at least
    one); None when either side lacks a counter or a move is no exact count (not whole, or
    beyond 2**53: past a float's exact integers, and no record holds it)."""
    if before is None or after is None:
        return None
    moved: dict[str, int] = {}
    for key, name in (("prompt_tokens", metrics.prompt), ("cached_tokens", metrics.cached)):
        start, end = metric_total(before, name), metric_total(after, name)
        if start is None or end is None or not float(end - start).is_integer():
            return None
        if abs(end - start) > 2**53:  # a counter that lies: no witness, never a bogus count
            return None
        moved[key] = int(end - start)
    ours = moved["prompt_tokens"] == prompt_tokens and moved["cached_tokens"] >= 0
    return {"source": metrics.path, **moved, "attributed": ours and prompt_tokens is not None}


def _reply(value: object, what: str, *, optional: bool = False) -> Mapping[str, JSONValue]:
    """A server's reply as read (a JSON object), or `UsageError` for anything else."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise UsageError(f"{what} is a JSON object, not {type(value).__name__}")
    return value


def is_halogen(health: Mapping[str, object] | None) -> bool:
    """Halogen's /health names its prompt cache (dense) or its /cache route (Flash)."""
    body = _reply(health, "/health", optional=True)
    return "prompt_cache" in body or "cache_counters" in body


def halogen_identity(health: Mapping[str, JSONValue]) -> JSONObject:
    body = _reply(health, "/health")
    template = body.get("chat_template")
    identity: JSONObject = {
        "version": body.get("version"),
        "chat_template_sha256": template.get("sha256") if isinstance(template, dict) else None,
        "prompt_cache": body.get("prompt_cache"),
    }
    return identity | {key: body.get(key) for key in _HALOGEN_IDENTITY}


def llamacpp_identity(props: Mapping[str, JSONValue]) -> JSONObject:
    body = _reply(props, "/props")
    settings, template = body.get("default_generation_settings"), body.get("chat_template")
    if isinstance(template, str):
        template = hashlib.sha256(template.encode("utf-8", "surrogatepass")).hexdigest()
    return {
        "build_info": body.get("build_info"),
        "model_path": body.get("model_path"),
        "n_ctx": settings.get("n_ctx") if isinstance(settings, dict) else None,
        "total_slots": body.get("total_slots"),
        "chat_template_sha256": template if isinstance(template, str) else None,
    }


def _served(models: Mapping[str, JSONValue] | None) -> dict[str, JSONValue] | None:
    """Each model id /v1/models lists, with its `max_model_len` (None when not an int)."""
    if models is None:
        return None
    data = _reply(models, "/v1/models").get("data")
    served: dict[str, JSONValue] = {}
    for model in data if isinstance(data, list) else []:
        if isinstance(model, dict) and isinstance(model.get("id"), str):
            length = model.get("max_model_len")
            served[str(model["id"])] = length if type(length) is int else None
    return served


def generic_identity(models: Mapping[str, JSONValue] | None) -> JSONObject:
    served = _served(models)
    return {"model_ids": None if served is None else list[JSONValue](sorted(served))}


def vllm_identity(
    version: Mapping[str, JSONValue] | None, models: Mapping[str, JSONValue] | None
) -> JSONObject:
    raw = _reply(version, "/version", optional=True).get("version")
    served = _served(models)
    listed: list[JSONValue] | None = None
    if served is not None:
        listed = [{"id": name, "max_model_len": served[name]} for name in sorted(served)]
    return {"version": raw if isinstance(raw, str) else None, "models": listed}
