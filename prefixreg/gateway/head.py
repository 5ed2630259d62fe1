"""The head of a request, as the gateway sees it at the door. Pure.

A request's head is what every call of a loop sends first and identically: the system text
(chat: `messages[0]` when its role is system/developer; Anthropic Messages: `system`;
OpenAI Responses: `instructions`, else a leading system/developer input item), the tools,
and the prompt settings a template reads (`core.frame.PROMPT_SETTINGS`). It is hashed as a
frame is (`core.frame.encode_frame_record` over the system's sha, the tools' sha and the
settings), so a head registered with `--register` (tools kept as `dumps_ordered` bytes) has
the sha the gateway computes; a frame registered from a file matches by its parts
(`parts_key`). A head with no tools and no settings is a bare prefix: its sha is the system
text's, the sha `prefixreg add` prints for it.

Invariants:
- Nothing here keeps or returns prompt text but `Head.system` (for strip, drift and
  registering); every other field is a sha, a count or a setting value.
- `strip` applies each rule to the system text only (a text block that a rule empties is
  dropped: an API refuses empty blocks) and rewrites the body only if something matched.
- `drift_of` names the first part that differs and the first differing byte offset; its
  `excerpt` (a few escaped bytes each side) goes to the client that sent them, never to a log.
- A body this module cannot read (a system that is not text, tools that are not a list)
  has no head (`Head` is None) and a reason; it is never an exception.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import PROMPT_SETTINGS, encode_frame_record
from prefixreg.core.jsonio import dumps_ordered
from prefixreg.core.prefix import text_bytes
from prefixreg.gateway.apis import Api

_SYSTEM_ROLES: Final = ("system", "developer")
KEPT_BYTES: Final = 64 * 1024  # a session's last head keeps this much of its system text


@dataclass(frozen=True, slots=True)
class Head:
    """One request's head: its frame-style sha, its parts' shas and sizes."""

    sha256: str  # the frame's sha; with no tools and no settings, the prefix's (`system_sha256`)
    system_sha256: str
    tools_sha256: str | None
    settings_json: str
    system: bytes
    tools_bytes: int
    renders_tools: bool
    # A registered frame's leading messages this request sends after its system message
    # (`KnownHeads.extend`): then `sha256` is that frame's, `base_sha256` the head's without.
    lead_sha256: str | None = None
    lead_bytes: int = 0
    base_sha256: str | None = None

    @property
    def head_bytes(self) -> int:
        """What the judge compares the cached count with: system, rendered tools and leading
        messages' bytes."""
        return len(self.system) + (self.tools_bytes if self.renders_tools else 0) + self.lead_bytes

    @property
    def parts_key(self) -> tuple[str, str | None, str]:
        return self.system_sha256, self.tools_sha256, self.settings_json

    @property
    def is_prefix(self) -> bool:
        return self.tools_sha256 is None and self.settings_json == "{}"


def _text(content: object) -> str | None:
    """A system content's text: a string, or the text of its text parts; None otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, Mapping)]
        if all(isinstance(p, str) for p in parts) and parts:
            return "".join(p for p in parts if isinstance(p, str))
    return None


def system_text(api: Api, body: Mapping[str, Any]) -> str | None:
    """The system text of a request of `api`, or None when it has none it can read."""
    if api.name == "messages":
        return _text(body.get("system"))
    if api.name == "responses":
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            return instructions
        items = body.get("input")
        first = items[0] if isinstance(items, list) and items else None
    else:
        messages = body.get("messages")
        first = messages[0] if isinstance(messages, list) and messages else None
    if isinstance(first, Mapping) and first.get("role") in _SYSTEM_ROLES:
        return _text(first.get("content"))
    return None


def history(api: Api, body: Mapping[str, Any]) -> list[Any]:
    """The messages after the head: what a session's calls extend."""
    if api.name == "messages":
        items = body.get("messages")
    elif api.name == "responses":
        items = body.get("input")
        if not isinstance(items, list):
            return [items] if isinstance(items, str) else []
        if not isinstance(body.get("instructions"), str):
            return items[1:] if items and system_text(api, {"input": items[:1]}) else items
    else:
        items = body.get("messages")
        if isinstance(items, list) and items and system_text(api, body) is not None:
            return items[1:]
    return items if isinstance(items, list) else []


def head_of(api: Api, body: Mapping[str, Any]) -> tuple[Head | None, str]:
    """(the head of `body`, "") or (None, why it has none)."""
    if api.name == "completions":
        return None, "a completions prompt has no head"
    text = system_text(api, body)
    if not text:
        return None, "no system text: no head"
    system = text.encode("utf-8", "surrogatepass")
    tools = body.get("tools")
    tools_sha, tools_len = None, 0
    if tools is not None and tools != []:
        if not isinstance(tools, list):
            return None, "tools is not a list: no head"
        try:
            data = dumps_ordered(tools).encode("utf-8")
        except (TypeError, ValueError):
            return None, "tools are not JSON: no head"
        tools_sha, tools_len = hashlib.sha256(data).hexdigest(), len(data)
    settings = {k: body[k] for k in PROMPT_SETTINGS if body.get(k) is not None}
    system_sha = hashlib.sha256(system).hexdigest()
    try:
        record = encode_frame_record(system_sha, tools_sha, settings)
    except UsageError:
        return None, "a prompt setting of the wrong type: no head"
    settings_json = dumps_ordered(dict(sorted(settings.items())))
    # A head of system text alone is a bare prefix: its sha is the prefix's, as `add` prints.
    bare = tools_sha is None and not settings
    sha = system_sha if bare else hashlib.sha256(record).hexdigest()
    renders = tools_sha is not None and settings.get("tool_choice") != "none"
    head = Head(sha, system_sha, tools_sha, settings_json, system, tools_len, renders)
    return head, ""


def rest_bytes(api: Api, body: Mapping[str, Any]) -> int:
    """Text bytes the request sends beyond its head (the judge's `rest_bytes`)."""
    return text_bytes(history(api, body))


def compile_rules(rules: Sequence[str]) -> list[re.Pattern[str]]:
    return [re.compile(rule, re.MULTILINE) for rule in rules]


def _strip_text(text: str, rules: Sequence[re.Pattern[str]]) -> tuple[str, int]:
    count = 0
    for rule in rules:
        text, n = rule.subn("", text)
        count += n
    return text, count


def strip(api: Api, body: dict[str, Any], rules: Sequence[re.Pattern[str]]) -> int:
    """Apply `rules` to `body`'s system text in place; how many matches were removed."""
    if not rules:
        return 0
    if api.name == "messages":
        holder, key = body, "system"
    elif api.name == "responses" and isinstance(body.get("instructions"), str):
        holder, key = body, "instructions"
    else:
        items = body.get("input" if api.name == "responses" else "messages")
        first = items[0] if isinstance(items, list) and items else None
        if not isinstance(first, dict) or first.get("role") not in _SYSTEM_ROLES:
            return 0
        holder, key = first, "content"
    value = holder.get(key)
    if isinstance(value, str):
        holder[key], n = _strip_text(value, rules)
        return n
    if not isinstance(value, list):
        return 0
    total, kept = 0, []
    for block in value:
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            text, n = _strip_text(block["text"], rules)
            total += n
            if n and not text.strip():
                continue  # a block the rules emptied is dropped: APIs refuse empty text
            block = {**block, "text": text} if n else block
        kept.append(block)
    if total:
        holder[key] = kept
    return total


def kept(head: Head) -> Head:
    """The head as a session keeps it between calls: its system text cut to `KEPT_BYTES`
    (drift past them is still found by the sha, its offset then not named): ten thousand
    sessions never hold ten thousand long system prompts."""
    if len(head.system) <= KEPT_BYTES:
        return head
    return replace(head, system=head.system[:KEPT_BYTES])


@dataclass(frozen=True, slots=True)
class HeadDrift:
    """Where a head differs from the one before: the part, the first differing byte offset
    (system only), and, for the client alone, a short escaped excerpt of the new side only:
    the head before may have come from another caller (a shared `prompt_cache_key`), so
    its bytes never go into a reply."""

    part: str
    offset: int | None
    excerpt: str

    def log_view(self) -> dict[str, Any]:
        return {"part": self.part, "offset": self.offset}

    def header(self) -> str:
        where = f" at byte {self.offset}" if self.offset is not None else ""
        return f"{self.part}{where}"


def _first_diff(a: bytes, b: bytes) -> int:
    """The first offset where `a` and `b` differ (the shorter one's length if one is the
    other's prefix); compared in blocks, then byte by byte in the first unequal block."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + 4096] == b[i : i + 4096]:
        i += 4096
    if i >= n:
        return n
    end = min(i + 4096, n)
    return next((j for j in range(i, end) if a[j] != b[j]), end)


def _show(data: bytes, at: int) -> str:
    return repr(data[at : at + 16])[2:-1][:64]


def drift_of(before: Head, now: Head) -> HeadDrift | None:
    """The first part of `now` that differs from `before` (system, tools, settings, the
    leading messages)."""
    if before.sha256 == now.sha256:
        return None
    if before.system_sha256 != now.system_sha256:
        at = _first_diff(before.system, now.system)
        if at >= KEPT_BYTES:  # the kept part agrees: the difference is further on
            return HeadDrift("system", None, f"the text differs after its first {KEPT_BYTES} bytes")
        excerpt = f"now '{_show(now.system, at)}' at byte {at}"
        return HeadDrift("system", at, excerpt)
    if before.tools_sha256 != now.tools_sha256:
        return HeadDrift("tools", None, "the tools list changed")
    if before.settings_json != now.settings_json:
        return HeadDrift("settings", None, "the settings changed")
    return HeadDrift("messages", None, "the leading messages of the frame changed")


def dynamic_first(before: str, now: str) -> bool:
    """Whether two first user messages differ early and agree after: dynamic text placed
    before static text (the static part cannot be cached past the dynamic bytes)."""
    a, b = before.encode("utf-8", "replace"), now.encode("utf-8", "replace")
    if a == b:
        return False
    lead = _first_diff(a, b)
    tail = min(_first_diff(a[::-1], b[::-1]), min(len(a), len(b)) - lead)
    return tail > max(lead, 64)
