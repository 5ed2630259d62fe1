"""Server profiles: what each can prove per call, and its build identity. Pure: no I/O.

- halogen: usage (cached only when > 0), `timings.cache_n` (Flash) and `/cache` counters:
  alone proves counter-level facts (hits, misses, evictions). Identity: `version`, model,
  chat template sha256, checkpoint format, context, slots, the `prompt_cache` block.
- llamacpp: usage (an explicit 0) and `timings.cache_n`. Identity: /props `build_info`,
  model path, n_ctx, total slots, the sha256 of `chat_template`.
- vllm: `usage.prompt_tokens_details` only with `--enable-prompt-tokens-details`.
  Identity: /version's version, each /v1/models id with its `max_model_len`.
- sglang, trtllm, ollama (and vllm's detection, zero rule and counters): `server.engines`.
- generic: usage, if sent. Identity: the sorted /v1/models ids (None without the route).

A count the server did not send is never read as zero (DESIGN §4). An identity says *what*
is serving, never how loaded: load fields (`in_flight`, `busy`, ...) never enter it, so an
idle and a busy server have one build id. A public receipt shows only its
`records.public_identity`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject, JSONValue

_HALOGEN_IDENTITY: Final = ("model", "checkpoint_format", "context", "slots", "slot_ctx")


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
