"""A real third-party loop for the gateway's client tests and benchmarks: mini-swe-agent
(PyPI) through litellm, pointed at a base URL and nothing else.

`run_mini_swe_agent(base_url, ...)` runs mini-swe-agent's own `DefaultAgent` (no
confirmation prompts) with its `mini` command's default templates (`config/mini.yaml`), its
`LitellmModel` (tool calls through `litellm.completion`) and its `LocalEnvironment`, and
returns what the server said about each of the loop's calls, read from the responses as
litellm hands them to the loop.

Invariants:
- No network but `base_url`: litellm reads its bundled cost map
  (`LITELLM_LOCAL_MODEL_COST_MAP`, set before litellm is imported), mini-swe-agent's global
  config lives in a temporary directory, its banner is off. (Checked with `strace -e
  connect`: the only address contacted is 127.0.0.1.)
- Deterministic enough to measure: temperature 0, a seed, a small `max_tokens`, a step
  limit; no cost limit (an unknown model costs 0: cost tracking ignores the missing price)
  and no limit on format errors (a 270M model's replies are rarely tool calls; each one
  still appends a turn, which is what a prompt cache sees).
- The agent's commands run in a scratch directory with `PATH` pointing at an empty
  directory: only shell builtins can run, so a small model's nonsense cannot touch the
  machine.
- The requests are the loop's own: the only additions are a hook after each model call
  (`after_call`, where a benchmark lets another tenant's prompts in, standing for tool time)
  and a record of each litellm response; neither changes a byte sent.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before litellm or mini-swe-agent is imported anywhere: no cost-map download, no banner,
# no config written to the user's home.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # a failure shows at once
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-config-"))

TASK = "List the files in this directory and print the first line of README."


@dataclass(frozen=True)
class LoopCall:
    """One model call of the loop as the server reported it (through litellm)."""

    prompt_tokens: int
    cached_tokens: int
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class LoopRun:
    """A whole run: every call in order, and the messages the agent ended with."""

    calls: list[LoopCall]
    messages: list[dict[str, Any]]
    exit_status: str

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.calls)

    @property
    def cached_tokens(self) -> int:
        return sum(c.cached_tokens for c in self.calls)

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def provider_headers(raw: Mapping[str, Any] | None) -> dict[str, str]:
    """The server's response headers from litellm's `_hidden_params["additional_headers"]`
    (litellm prefixes them `llm_provider-`), lower-cased."""
    return {
        str(k).removeprefix("llm_provider-").lower(): str(v)
        for k, v in (raw or {}).items()
        if str(k).startswith("llm_provider-")
    }


def call_of(response: Any, headers_from: Any = None) -> LoopCall:
    """A litellm response's counts, and the response headers of it (or of `headers_from`,
    a stream's wrapper)."""
    usage = response.usage
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) or 0
    hidden = getattr(headers_from if headers_from is not None else response, "_hidden_params", {})
    headers = provider_headers((hidden or {}).get("additional_headers"))
    return LoopCall(int(usage.prompt_tokens), int(cached), headers)


def mini_config() -> dict[str, Any]:
    """mini-swe-agent's `mini` command defaults (its packaged `config/mini.yaml`), read by its
    own loader."""
    from minisweagent.config import get_config_from_spec

    return get_config_from_spec("mini.yaml")


def run_mini_swe_agent(
    base_url: str,
    *,
    steps: int = 4,
    max_tokens: int = 16,
    seed: int = 1,
    task: str = TASK,
    after_call: Callable[[], None] | None = None,
    workdir: Path | None = None,
) -> LoopRun:
    """Run mini-swe-agent for `steps` model calls against the OpenAI-compatible `base_url`
    (the server root or its `/v1`), the only change a user would make."""
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True  # no "Provider List" banner for an unpriced model
    api_base = base_url.rstrip("/")
    api_base = api_base if api_base.endswith("/v1") else api_base + "/v1"
    config = mini_config()
    responses: list[Any] = []

    class RecordedModel(LitellmModel):
        def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
            response = super()._query(messages, **kwargs)
            responses.append(response)
            return response

    class PacedAgent(DefaultAgent):
        def query(self) -> dict[Any, Any]:
            try:
                return super().query()
            finally:
                if after_call is not None:
                    after_call()

    agent_config = {
        k: v for k, v in config["agent"].items() if k in ("system_template", "instance_template")
    }
    model_config = dict(config["model"])
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}),
        "api_base": api_base,
        "api_key": "none",  # llama-server takes any key; the gateway forwards its own
        "temperature": 0,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    with tempfile.TemporaryDirectory(prefix="mswea-work-") as scratch:
        cwd = workdir or Path(scratch)
        (cwd / "README").write_text("a scratch directory for the loop\n")
        empty_bin = Path(scratch) / "empty-bin"
        empty_bin.mkdir()
        agent = PacedAgent(
            RecordedModel(model_name="openai/peer", cost_tracking="ignore_errors", **model_config),
            LocalEnvironment(cwd=str(cwd), env={"PATH": str(empty_bin)}, timeout=5),
            **agent_config,
            step_limit=steps,
            cost_limit=0,
            max_consecutive_format_errors=0,
        )
        result = agent.run(task)
    return LoopRun(
        calls=[call_of(r) for r in responses],
        messages=agent.messages,
        exit_status=str(result.get("exit_status", "")),
    )


# -- a Claude-Code-like loop whose head carries a per-request nonce -------------------------------

STATIC = "You are a coding assistant in a terminal. Follow the house rules. " * 20
# Claude Code's billing block (`cch` changes every request). llama-server normalizes this
# very line itself (`normalize_anthropic_billing_header`), so to see what a nonce costs there
# the loops below also use a line it does not know (a per-request id, as other CLIs send).
BILLING = "x-anthropic-billing-header: cc_version=2.1.37.a1b; cc_entrypoint=cli; cch={};"
REQUEST_ID = "x-client-request: id={}; entrypoint=cli"
STRIP = r"(cch|id)=[0-9a-f]+;"  # the `--strip` rule that removes either nonce


def nonce_at(line: str) -> int:
    """The nonce's byte offset in `system[0]` when `line` is its template."""
    return line.index("{}")


def messages_loop(
    base_url: str, *, nonce: bool, turns: int, line: str = REQUEST_ID, max_tokens: int = 4
) -> list[Any]:
    """A Claude-Code-like loop over Anthropic Messages (`base_url`/v1/messages): `system[0]`
    is `line` with a fresh nonce each request when `nonce` (its first hex digit differs from
    the last request's, so the drift starts at `nonce_at(line)`), `system[1]` the static
    prompt; each turn appends the reply and a new user message. The httpx replies."""
    import secrets

    import httpx

    replies = []
    history: list[dict[str, Any]] = [{"role": "user", "content": "List the files."}]
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for turn in range(turns):
            cch = f"{turn % 16:x}{secrets.token_hex(2)}" if nonce else "00000"
            body = {
                "model": "peer",
                "max_tokens": max_tokens,
                "temperature": 0,
                "system": [
                    {"type": "text", "text": line.format(cch)},
                    {"type": "text", "text": STATIC},
                ],
                "messages": history,
            }
            reply = client.post(
                "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}
            )
            reply.raise_for_status()
            replies.append(reply)
            text = "".join(b.get("text", "") for b in reply.json().get("content", []))
            history = [
                *history,
                {"role": "assistant", "content": text or "ok"},
                {"role": "user", "content": f"Now step {turn + 2}."},
            ]
    return replies
