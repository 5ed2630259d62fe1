"""A request's system prefix, as the audit keeps it: sha256 and length, never the text.

Invariant: the sha is of the exact UTF-8 bytes of `messages[0].content` when that content
is a string; anything else (content parts, no messages, text that is not UTF-8) carries a
`problem` instead of a sha, so it can never be called identical to a registered prefix.
Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefixreg.core.digest import sha256_hex

__all__ = ["PromptSeen", "SystemPrompt", "system_prompt"]


@dataclass(frozen=True, slots=True)
class SystemPrompt:
    """`messages[0]` of a request: the sha256 and length of its content's UTF-8 bytes, or
    the reason there is nothing to compare (`problem`)."""

    sha256: str | None
    size: int | None
    role: str | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class PromptSeen:
    """A request read (alone or paired with its response) and its first message."""

    source: str
    system: SystemPrompt
    paired: bool


def system_prompt(request: Mapping[str, object]) -> SystemPrompt:
    """The identity of a request's first message: sha256 of the UTF-8 bytes of its content
    (a string; content parts are not joined, since no join is the bytes the model saw)."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return SystemPrompt(None, None, None, "no messages")
    first = messages[0]
    if not isinstance(first, dict):
        return SystemPrompt(None, None, None, "messages[0] is not an object")
    role = first.get("role")
    role_s = role if isinstance(role, str) else None
    content = first.get("content")
    if not isinstance(content, str):
        return SystemPrompt(None, None, role_s, "messages[0].content is not a string")
    try:
        data = content.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: not UTF-8 text
        return SystemPrompt(None, None, role_s, "messages[0].content is not valid UTF-8")
    return SystemPrompt(sha256_hex(data), len(data), role_s)
