"""Frames against a real prompt-caching engine: llama.cpp's llama-server with `--jinja`.

A loop's calls go through `Worker.chat(frame, history=...)` after `prefixreg warm FRAME`,
with a growing history (assistant turns, a tool call and its result). Each call's
`usage.prompt_tokens_details.cached_tokens` must cover the head the frame owns, measured
here independently of prefixreg's own estimate: the server renders the request
(`POST /apply-template`) and tokenizes it (`POST /tokenize`), so the spans are the
server's tokens, not byte shares.

Two templates, each a real server:
- `model-template`: Gemma 3 270M's own template. It does not render tools (`/props`
  says `supports_tools: false`, and the rendering with and without tools is identical):
  the test records that in a note and its messages, checks that the tools indeed leave the
  prompt alone, and checks the system prefix's span. It never skips.
- `tools-template`: a ChatML template that renders the tools after the system message
  (`--chat-template-file`), so the frame's whole head (system + tools) must be covered.

Prefixes are ~1,000 tokens: a cold prefill takes seconds on two busy cores.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from prefixreg.core.frame import Frame
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.loop import LoopJudge
from tests.conftest import run_cli
from tests.peer.fixtures import serve
from tests.peer.llama_peer import DEFAULT_FLAGS, PeerServer

pytestmark = pytest.mark.timeout(900)

USAGE_SOURCE = "usage.prompt_tokens_details.cached_tokens"
# Tokenizing a cut-off prefix of the rendered text may split its last token differently
# from the whole prompt; the server's cached count is exact, so this is the only slack.
BOUNDARY_SLACK = 2
CALLS = 3

_WORDS = (
    *("ledger", "harbor", "quartz", "violet", "meadow", "copper", "signal", "lantern"),
    *("orbit", "willow", "granite", "falcon", "ember", "tundra", "saffron", "beacon"),
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{what} in the working tree; returns its output as text.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "a relative path"}},
                "required": ["path"],
            },
        },
    }
    for name, what in (("read_file", "Read a file"), ("run_tests", "Run the tests"))
]
SETTINGS = {"tool_choice": "auto"}
# ChatML that renders the tools into the first (system) message, and tool calls into the
# assistant turn: what a tool-aware template does, small enough to read.
TOOLS_TEMPLATE = """\
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\\n' -}}
{%- if message.content is string -%}{{- message.content -}}{%- endif -%}
{%- if loop.first and tools -%}
{{- '\\n# Tools\\n' -}}
{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}
{%- endif -%}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{{- '<tool_call>' + call.function.name + ' ' + call.function.arguments + '</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def system_prompt() -> str:
    """About 1,000 tokens of deterministic text (Gemma's tokenizer: ~1.1 tokens a word)."""
    rng = random.Random(17)
    words = [f"{rng.choice(_WORDS)}{'.' if i % 12 == 11 else ''}" for i in range(900)]
    return "You are a coding agent. House rules: " + " ".join(words) + "\n"


@pytest.fixture(scope="module", params=["model-template", "tools-template"])
def peer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PeerServer]:
    log_dir = tmp_path_factory.mktemp(f"llama-{request.param}")
    flags: tuple[str, ...] = (*DEFAULT_FLAGS, "--jinja")
    if request.param == "tools-template":
        template = log_dir / "tools.jinja"
        template.write_text(TOOLS_TEMPLATE)
        flags = (*flags, "--chat-template-file", str(template))
    with serve(flags, log_dir) as server:
        yield server


def post(server: PeerServer, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(server.url + path, json=payload, timeout=120)
    assert reply.status_code == 200, (path, reply.status_code, reply.content[:300])
    out: dict[str, Any] = orjson.loads(reply.content)
    return out


def rendered(server: PeerServer, body: dict[str, Any]) -> str:
    """The prompt text the server renders for a chat `body` (its own template, --jinja)."""
    prompt = post(server, "/apply-template", body)["prompt"]
    assert isinstance(prompt, str)
    return prompt


def tokens(server: PeerServer, text: str) -> int:
    """The server's token count for `text`, BOS included, special tokens parsed (as a chat)."""
    out = post(server, "/tokenize", {"content": text, "add_special": True, "parse_special": True})
    return len(out["tokens"])


def common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def add_turn(history: list[dict[str, Any]], i: int) -> None:
    """An assistant tool call, the tool's result, the next user line."""
    call_id = f"call_{i}"
    history.append(
        {
            "role": "assistant",
            "content": f"I will run the tests in t{i}.",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "run_tests", "arguments": json.dumps({"path": f"t{i}"})},
                }
            ],
        }
    )
    history.append({"role": "tool", "tool_call_id": call_id, "content": f"{i + 1} failed. " * 4})
    history.append({"role": "user", "content": f"Step {i}: fix the first failure."})


def test_history_through_the_api_resumes_the_frames_head(
    peer: PeerServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    facts: dict[str, object] = {}  # printed (pytest -rP shows them): what this peer did
    reg_path = tmp_path / "reg"
    reg = Registry(reg_path)
    reg.add(system_prompt(), name="system")
    reg.add_frame("system", tools=json.dumps(TOOLS), settings=SETTINGS, name="loop")
    frame: Frame = reg.frame("loop")

    # What the server makes of the frame, measured with its own template and tokenizer.
    probe_a = frame.body([{"role": "user", "content": "Alpha: start."}])
    probe_b = frame.body([{"role": "user", "content": "Beta: start."}])
    with_tools = rendered(peer, probe_a)
    without_tools = rendered(
        peer, {k: v for k, v in probe_a.items() if k not in ("tools", "tool_choice")}
    )
    system_text = frame.system.text
    assert system_text in with_tools, "the system bytes must reach the prompt verbatim"
    system_end = with_tools.index(system_text) + len(system_text)
    system_span = tokens(peer, with_tools[:system_end])
    # The head the frame owns: what every history shares (system, tools, template tokens).
    head_text = common_prefix(with_tools, rendered(peer, probe_b))
    head_span = tokens(peer, head_text)
    template = request.node.callspec.params["peer"]
    caps = orjson.loads(peer.get("/props")[1]).get("chat_template_caps", {})
    tools_rendered = with_tools != without_tools
    facts["tools_rendered"] = tools_rendered
    facts["system_span"] = system_span
    facts["head_span"] = head_span
    if tools_rendered:
        note = f"the template renders tools: the head is {head_span} tokens (system {system_span})"
        assert TOOLS[0]["function"]["name"] in head_text[system_end:], note
        assert head_span > system_span + 20, note  # the tools are inside the head
    else:
        note = (
            "this peer's template does not render tools (/props chat_template_caps "
            f"supports_tools={caps.get('supports_tools')!r}; /apply-template is identical "
            "with and without them): only the system prefix's span is checked; the tools "
            "leave the prompt unchanged"
        )
        assert TOOLS[0]["function"]["name"] not in with_tools, note
    # Each server's template is known: a change in what it renders fails here, by name.
    assert tools_rendered is (template == "tools-template"), (template, note)
    assert system_span >= 800, (system_span, note)  # the ~1k-token system prompt

    peer.erase_slots()  # nothing cached: the warm starts from zero
    res = run_cli("warm", "loop", "--worker", peer.url, "--registry", str(reg_path), "--json")
    receipt = orjson.loads(res.stdout)
    assert receipt["body"]["frame"] == frame.sha256
    if tools_rendered:
        assert res.returncode == 0, (res.stdout, res.stderr, note)
        assert receipt["body"]["verdict"] == "resumed", (receipt["body"]["reason"], note)
    else:
        # The head's span is cached, but the tools the loop sends never reached the prompt:
        # not resumed for its tools, and the verdict says why (exit 4).
        assert res.returncode == 4, (res.stdout, res.stderr, note)
        assert receipt["body"]["verdict"] == "unverified", note
        assert "tools add no prompt tokens" in receipt["body"]["reason"], receipt["body"]
    facts["warm"] = f"{receipt['body']['span_tokens']} span, {receipt['body']['coverage']}"

    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing tests."}]
    previous_prompt: int | None = None
    with Worker(peer.url) as worker:
        judge = LoopJudge.for_worker(reg, frame, worker)
        for i in range(CALLS):
            _, ev = worker.chat(frame, history=history, max_tokens=4, temperature=0)
            where = f"call {i} ({len(history)} history messages): {ev}; {note}"
            assert ev.cached_source == USAGE_SOURCE, where
            assert ev.cached_tokens is not None and ev.prompt_tokens is not None, where
            # The system prefix's span, then the frame's whole head (tools included where
            # the template renders them), came from the cache on every call.
            assert ev.cached_tokens >= system_span - BOUNDARY_SLACK, where
            assert ev.cached_tokens >= head_span - BOUNDARY_SLACK, where
            if previous_prompt is not None:
                # The history grows by appending: the last call's prompt is resumed too.
                assert ev.cached_tokens >= previous_prompt - BOUNDARY_SLACK, where
            verdict, detail = judge.observe(ev, frame.body(history))
            if tools_rendered:
                assert verdict == "resumed", (verdict, detail, note)
            else:  # the loop's calls as the warm: never resumed for tools the prompt lacks
                assert verdict == "unverified", (verdict, detail, note)
                assert "tools add no prompt tokens" in detail, detail
            facts[f"call{i}"] = f"{ev.cached_tokens}/{ev.prompt_tokens} cached"
            previous_prompt = ev.prompt_tokens
            add_turn(history, i)
    assert len(judge.calls) == CALLS
    print(f"note: {note}", *(f"{k}: {v}" for k, v in facts.items()), sep="\n")
