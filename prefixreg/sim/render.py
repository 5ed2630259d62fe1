"""What the simulator's chat template renders besides message text: tools and tool calls. Pure.

Like a Qwen-style template (and Halogen's front-end), the tool definitions are rendered into
the system turn, after the system content, so their tokens count in the system part and a
snapshot at `system_end` covers them; with `tool_choice: "none"` the tools are not rendered
at all (which changes the prefix: alternating it with "auto" costs a cache miss). An
assistant turn's `tool_calls` are rendered after its content, so two loops that called
different tools do not share that turn's tokens.

Invariants: the rendering is a pure function of the request body; a request without
`tools` renders exactly as before (the measured shapes of `tokenizer` are unchanged).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TOOLS_HEADER", "ToolsError", "with_tools"]

TOOLS_HEADER = "\n\n# Tools\n\nYou may call one or more of these functions:\n<tools>\n"
TOOLS_FOOTER = "\n</tools>"
TOOL_CHOICES = frozenset({"none", "auto", "required"})


class ToolsError(ValueError):
    """A malformed `tools`, `tool_choice` or `tool_calls` field: (location, message)."""

    def __init__(self, loc: str, msg: str) -> None:
        super().__init__(f"{loc}: {msg}")
        self.loc, self.msg = loc, msg


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _tools_block(body: Mapping[str, Any]) -> str:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is not None and not (choice in TOOL_CHOICES or isinstance(choice, dict)):
        raise ToolsError("body.tool_choice", f"must be one of {sorted(TOOL_CHOICES)} or an object")
    if tools is None:
        return ""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ToolsError("body.tools", "must be a list of objects")
    if not tools or choice == "none":
        return ""
    return TOOLS_HEADER + "\n".join(_compact(t) for t in tools) + TOOLS_FOOTER


def _calls_text(message: Mapping[str, Any], loc: str) -> str:
    calls = message.get("tool_calls")
    if calls is None:
        return ""
    if not isinstance(calls, list):
        raise ToolsError(f"{loc}.tool_calls", "must be a list")
    return "".join(f"\n<tool_call>\n{_compact(c)}\n</tool_call>" for c in calls)


def with_tools(
    body: Mapping[str, Any], messages: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The (role, content) pairs the template renders: the tools block folded into the
    system turn (one is opened for it when `messages[0]` is not a system turn), and each
    assistant turn's tool calls after its content.

    Raises:
        ToolsError: `tools`, `tool_choice` or a `tool_calls` field of the wrong shape.
    """
    raw = body.get("messages")
    raw_list = raw if isinstance(raw, list) else []
    out: list[tuple[str, str]] = []
    for i, (role, content) in enumerate(messages):
        message = raw_list[i] if i < len(raw_list) and isinstance(raw_list[i], dict) else {}
        out.append((role, content + _calls_text(message, f"body.messages.{i}")))
    block = _tools_block(body)
    if block:
        if out and out[0][0] in ("system", "developer"):
            out[0] = (out[0][0], out[0][1] + block)
        else:
            out.insert(0, ("system", block.lstrip("\n")))
    return out
