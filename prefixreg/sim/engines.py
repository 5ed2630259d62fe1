"""The simulator as the engines users run (`--engine vllm|sglang|trtllm|ollama`): their reply
shapes, routes, headers and metrics over the one cache model underneath. Pure.

Built from each engine's source, as recorded in tests/fixtures/engines/README.md:
- vLLM (reports 0.23.0, a build with #45171): usage `prompt_tokens, total_tokens,
  completion_tokens, prompt_tokens_details`; with `--enable-prompt-tokens-details` (`cache_report`)
  `{"cached_tokens": N}`, an explicit 0 included, else `null` (a stream's usage chunk drops
  the key: `exclude_none`). `/health` empty, `/version`, `/v1/models` (`owned_by` vllm,
  `max_model_len`, `permission`), `/metrics` (`vllm:` counters, labels model_name, engine).
- SGLang (0.5.9): `prompt_tokens_details` `{"cached_tokens": N}` only with
  `--enable-cache-report` *and* N > 0, else `null` (`_details_if_cached`); `reasoning_tokens`;
  a 32-hex id; `/server_info` (and `/get_server_info`) with the flags; `/model_info`;
  `/metrics` (`--enable-metrics`, on here).
- TensorRT-LLM (1.3.0rc23): `{"cached_tokens": N}` always (PR #7637); `/metrics` is a JSON list
  of iteration stats; the Prometheus text is at `/prometheus/metrics`; no flag to turn off.
- Ollama (0.34.4): usage `prompt_tokens, prompt_tokens_details, completion_tokens,
  total_tokens`, the details always; `--no-cache-report` serves 0.33.2, which sends none
  (the count ships from 0.33.3); `system_fingerprint` fp_ollama; ids `chatcmpl-<n>`; `GET /`
  `Ollama is running`, `/api/version`, `/api/tags`, `/api/ps`; no Prometheus route.
No engine sends Halogen's `timings` or `/cache`. Native routes (served by `sim.protocol`),
non-streamed only: SGLang `POST /generate` (`text`, `sampling_params.max_new_tokens`;
`meta_info.cached_tokens` always) and Ollama `POST /api/chat` (`stream: false` required;
`options.num_predict`; `prompt_eval_count` counts the cached tokens too,
`prompt_eval_cached_count` from 0.33.3). Not modelled: streamed native routes, each engine's
error envelope and block granularity (vLLM 16, TensorRT-LLM 32 tokens): the cache model is
Halogen Flash's. A token-ID `prompt` on `/v1/completions` (`TOKEN_PROMPTS`) is one sim token
per ID.
"""

from __future__ import annotations

import secrets
from typing import Any, Final

UVICORN: Final = frozenset({"vllm", "sglang", "trtllm"})  # FastAPI under uvicorn; Ollama is Go
# Engines whose `/v1/completions` takes a token-ID list as `prompt` (the OpenAI shape); Ollama's
# takes a string only, and so does Halogen dense's (halogen-api.md §3.11; Flash unverified).
TOKEN_PROMPTS: Final = frozenset({"vllm", "sglang", "trtllm"})
_VERSION: Final = {"vllm": "0.23.0", "sglang": "0.5.9", "trtllm": "1.3.0rc23", "ollama": "0.34.4"}


def version(engine: str, report: bool) -> str:
    """The version the engine reports: Ollama without the cache report is 0.33.2."""
    return "0.33.2" if engine == "ollama" and not report else _VERSION[engine]


def reply_id(engine: str) -> str:
    """A reply id: SGLang's bare request id, Ollama's `chatcmpl-<n>`, else `chatcmpl-<hex>`."""
    if engine == "sglang":
        return secrets.token_hex(16)
    return f"chatcmpl-{secrets.randbelow(1000) if engine == 'ollama' else secrets.token_hex(16)}"


def usage(engine: str, report: bool, n: int, k: int, cached: int) -> dict[str, Any]:
    """The usage object for `n` prompt, `k` completion and `cached` resumed tokens."""
    shown = report and (cached > 0 or engine != "sglang")
    details = {"cached_tokens": cached} if shown else None
    if engine == "ollama":
        out: dict[str, Any] = {"prompt_tokens": n}
        out |= {"prompt_tokens_details": details} if report else {}
        return out | {"completion_tokens": k, "total_tokens": n + k}
    out = {"prompt_tokens": n, "total_tokens": n + k, "completion_tokens": k}
    out["prompt_tokens_details"] = details
    return out | ({"reasoning_tokens": 0} if engine == "sglang" else {})


_MESSAGE: Final[dict[str, dict[str, Any]]] = {
    "vllm": {"refusal": None, "annotations": None, "audio": None, "function_call": None,
             "tool_calls": [], "reasoning": None},
    "sglang": {"reasoning_content": None, "tool_calls": None},
    "trtllm": {"reasoning_content": "", "reasoning": None, "tool_calls": []},
    "ollama": {},
}  # fmt: skip
# A choice's fields after its message, in the engine's order (`finish_reason` comes from the call).
_CHOICE: Final[dict[str, dict[str, Any]]] = {
    "vllm": {"logprobs": None, "finish_reason": None, "stop_reason": None, "token_ids": None},
    "sglang": {"logprobs": None, "finish_reason": None, "matched_stop": None},
    "trtllm": {"logprobs": None, "finish_reason": None, "stop_reason": None,
               "mm_embedding_handle": None, "disaggregated_params": None,
               "avg_decoded_tokens_per_iter": None},
    "ollama": {"finish_reason": None},
}  # fmt: skip
# Top-level fields before and after `choices` (stream chunks: Ollama's before only), and last.
_BEFORE: Final = {"ollama": {"system_fingerprint": "fp_ollama"}}
_AFTER: Final = {"vllm": {"service_tier": None, "system_fingerprint": None}}
_TAIL: Final[dict[str, dict[str, Any]]] = {
    "vllm": {"prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None},
    "sglang": {"metadata": {"weight_version": "default"}},
    "trtllm": {"prompt_token_ids": None},
}


def dress(engine: str, body: dict[str, Any]) -> dict[str, Any]:
    """A Halogen-shaped reply in the engine's key order, with the engine's extra fields."""
    chunk = str(body.get("object", "")).endswith(".chunk")
    choices = []
    for choice in body["choices"]:
        if "message" in choice:
            extra = _CHOICE[engine] | {"finish_reason": choice.get("finish_reason")}
            message = choice["message"] | _MESSAGE[engine]
            choice = {"index": choice.get("index", 0), "message": message} | extra
        elif "delta" in choice and engine == "vllm":  # set fields kept, null or not
            finish = choice.get("finish_reason")
            delta = choice["delta"] or {"content": ""}  # the finish chunk's empty piece
            choice = {"index": choice.get("index", 0), "delta": delta, "logprobs": None}
            choice |= {"finish_reason": finish} | ({"stop_reason": None} if finish else {})
        choices.append(choice)
    out = {key: body[key] for key in ("id", "object", "created", "model")}
    out |= _BEFORE.get(engine, {})
    out["choices"] = choices
    out |= {} if chunk else _AFTER.get(engine, {})
    if "usage" in body:
        out["usage"] = body["usage"]
    out |= {} if chunk else _TAIL.get(engine, {})
    if chunk and engine == "vllm":  # usage unset on a piece; the usage chunk: exclude_none
        usage = out.pop("usage", None)
        if isinstance(usage, dict):
            out["usage"] = {k: v for k, v in usage.items() if v is not None}
    return out


def models(engine: str, model: str, created: int, ctx: int) -> dict[str, Any]:
    """`/v1/models` as the engine lists itself."""
    card: dict[str, Any] = {"id": model, "object": "model", "created": created}
    if engine == "vllm":
        permission = {"id": f"modelperm-{model}", "object": "model_permission", "created": created}
        card |= {"owned_by": "vllm", "root": model, "parent": None, "max_model_len": ctx}
        card["permission"] = [permission | {"allow_sampling": True, "organization": "*"}]
    elif engine == "sglang":
        card |= {"owned_by": "sglang", "root": model, "max_model_len": ctx}
    else:
        card["owned_by"] = "tensorrt_llm" if engine == "trtllm" else "library"
    return {"object": "list", "data": [card]}


def server_info(model: str, report: bool, ctx: int, radix: bool) -> dict[str, Any]:
    """SGLang's `/server_info`: its server args (the ones that matter here), then its state."""
    args = {"model_path": model, "tokenizer_path": model, "page_size": 1}
    args |= {"enable_metrics": True, "served_model_name": model, "enable_cache_report": report}
    args |= {"enable_hierarchical_cache": False, "disable_radix_cache": not radix}
    state = {"status": "ready", "max_total_num_tokens": ctx, "max_req_input_len": ctx - 6}
    internal = [args | {"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 1}]
    return args | state | {"internal_states": internal, "version": _VERSION["sglang"]}


# The GET routes each engine answers besides `/v1/models` (each one's body: `Engine.engine_get`).
GET_ROUTES: Final = {
    "vllm": {"/health", "/version", "/metrics", "/load"},
    "sglang": {"/health", "/server_info", "/get_server_info", "/model_info", "/metrics"},
    "trtllm": {"/health", "/version", "/metrics", "/prometheus/metrics"},
    "ollama": {"/", "/api/version", "/api/tags", "/api/ps"},
}


def metrics(engine: str, model: str, prompt: int, cached: int, requests: int) -> str:
    """Prometheus text over every prompt token, the `cached` ones and the `requests` served."""
    if engine == "vllm":
        labels = f'{{model_name="{model}",engine="0"}}'
        series = [
            ("vllm:prefix_cache_queries", prompt,
             "Prefix cache queries, in terms of number of queried tokens."),
            ("vllm:prefix_cache_hits", cached,
             "Prefix cache hits, in terms of number of cached tokens."),
            ("vllm:prompt_tokens", prompt, "Number of prefill tokens processed."),
            ("vllm:prompt_tokens_cached", cached,
             "Number of cached prompt tokens (local + external)."),
        ]  # fmt: skip
        return _text((f"{n}_total", labels, v, h) for n, v, h in series)
    if engine == "sglang":
        plain = f'{{model_name="{model}"}}'
        source = f'{{model_name="{model}",cache_source="device"}}'
        return _text([
            ("sglang:prompt_tokens_total", plain, prompt, "Number of prefill tokens processed."),
            ("sglang:cached_tokens_total", source, cached,
             "Number of cached prompt tokens by source (device/host/storage)."),
            ("sglang:num_requests_total", plain, requests, "Number of requests processed."),
        ])  # fmt: skip
    labels = f'{{model_name="{model}",engine_type="trtllm"}}'
    return _text([
        ("trtllm_prompt_tokens_total", labels, prompt,
         "Cumulative number of prompt (input) tokens processed."),
        ("trtllm_prompt_cached_tokens_total", labels, cached,
         "Total prompt tokens served from KV cache."),
    ])  # fmt: skip


def _text(series: Any) -> str:
    lines: list[str] = []
    for name, labels, value, text in series:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name}{labels} {value}.0"]
    return "\n".join(lines) + "\n"
