"""Build identity per server profile: which fields of a server's own reports say *what* is
serving (DESIGN §4), never how loaded it is. Pure: no I/O.

    halogen   version.*, model, chat_template.sha256, checkpoint_format, context, slots,
              slot_ctx, the whole prompt_cache block
    llamacpp  /props build_info, model_path, default_generation_settings.n_ctx,
              total_slots, sha256 of chat_template
    vllm      /version's version, and each /v1/models id with its max_model_len
    generic   the sorted model ids of /v1/models (None when the route is missing)

Load fields (`in_flight`, `busy`, `queued`, ...) never enter an identity, so the build id
of an idle server and of a busy one are the same. What a public receipt may show of an
identity is `records.public_identity`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

from prefixreg.core.jsonio import JSONObject, JSONValue

__all__ = [
    "generic_identity",
    "halogen_identity",
    "is_halogen",
    "llamacpp_identity",
    "vllm_identity",
]

_HALOGEN_IDENTITY: Final = ("model", "checkpoint_format", "context", "slots", "slot_ctx")


def is_halogen(health: Mapping[str, object] | None) -> bool:
    """Halogen's /health names its prompt cache (dense) or its /cache route (Flash)."""
    return health is not None and ("prompt_cache" in health or "cache_counters" in health)


def _sha256_text(value: object) -> str | None:
    return hashlib.sha256(value.encode("utf-8")).hexdigest() if isinstance(value, str) else None


def halogen_identity(health: Mapping[str, JSONValue]) -> JSONObject:
    template = health.get("chat_template")
    identity: JSONObject = {
        "version": health.get("version"),
        "chat_template_sha256": template.get("sha256") if isinstance(template, dict) else None,
        "prompt_cache": health.get("prompt_cache"),
    }
    for key in _HALOGEN_IDENTITY:
        identity[key] = health.get(key)
    return identity


def llamacpp_identity(props: Mapping[str, JSONValue]) -> JSONObject:
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return {
        "build_info": props.get("build_info"),
        "model_path": props.get("model_path"),
        "n_ctx": n_ctx,
        "total_slots": props.get("total_slots"),
        "chat_template_sha256": _sha256_text(props.get("chat_template")),
    }


def generic_identity(models: Mapping[str, JSONValue] | None) -> JSONObject:
    if models is None:
        return {"model_ids": None}
    data = models.get("data")
    ids: list[JSONValue] = []
    if isinstance(data, list):
        names = {m.get("id") for m in data if isinstance(m, dict)}
        ids.extend(sorted(n for n in names if isinstance(n, str)))
    return {"model_ids": ids}


def vllm_identity(
    version: Mapping[str, JSONValue] | None, models: Mapping[str, JSONValue] | None
) -> JSONObject:
    """vLLM: its version, and each served model id with its `max_model_len`, by id."""
    raw = version.get("version") if version is not None else None
    served: dict[str, JSONValue] = {}
    data = models.get("data") if models is not None else None
    if isinstance(data, list):
        for model in data:
            if isinstance(model, dict) and isinstance(model.get("id"), str):
                length = model.get("max_model_len")
                served[str(model["id"])] = length if type(length) is int else None
    listed: list[JSONValue] = [
        {"id": name, "max_model_len": served[name]} for name in sorted(served)
    ]
    return {
        "version": raw if isinstance(raw, str) else None,
        "models": None if models is None else listed,
    }
