"""`Frame`: the verified head of the request a loop sends, and the drift of a call from it. Pure.

A prompt cache keys on the *rendered* token prefix, and the server renders more than
`messages[0]` into it: the tools, and the settings its chat template reads (`tool_choice:
"none"` removes the tools; `enable_thinking`, `reasoning_effort`, `chat_template_kwargs`
change the output). A frame names them all:

    {"format": "prefix-frame", "version": 1, "system": <sha>, "tools": <sha> | null,
     "settings": {<prompt setting>: <JSON value>, ...}[, "messages": <sha>]}

`messages`, only in a frame that has them, names the leading messages the loop sends after
its system message, identically on every call (few-shot examples, a static first user
message), as one object: a JSON list of message objects. A frame without them has exactly
the record (and the sha) it always had.

stored as canonical JSON (sorted keys, no spaces) and a newline; its sha is the sha256 of
exactly those bytes, so `sha256sum frames/<sha>.json` prints its own name.

Invariants:
- A `Frame` is only built from a record and parts just verified (the registry's frames
  part); it keeps the exact system and tools bytes it checked: those are the bytes sent.
- `body()` never lets a caller's keyword silently override a frame part: a conflicting
  `tools`, `tool_choice`, ... is a `UsageError` (send it through another frame instead).
- `drift()` compares only what changes the rendered prefix: `messages[0]`, the leading
  messages, the tools (in order: a reordered list renders differently) and `PROMPT_SETTINGS`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, cast

from prefixreg.core.digest import is_full_sha, sha256_hex
from prefixreg.core.errors import CorruptRecordError, IntegrityError, UsageError, check_type
from prefixreg.core.jsonio import dumps_canonical, dumps_ordered, loads
from prefixreg.core.prefix import (
    Drift,
    Prefix,
    check_history,
    check_params,
    system_drift,
    text_bytes,
)

FRAME_FORMAT: Final = "prefix-frame"
FRAME_VERSION: Final = 1
# Request fields a chat template reads (Halogen dense/flash, llama.cpp --jinja): changing one
# changes the rendered prompt, hence the cache key (sampling fields never do); each with the
# JSON type it takes (a string "False" would render as true in a template).
_SETTING_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "chat_template_kwargs": (dict,),
    "enable_thinking": (bool,),
    "parallel_tool_calls": (bool,),
    "preserve_thinking": (bool,),
    "reasoning_effort": (str,),
    "tool_choice": (str, dict),
}
PROMPT_SETTINGS: Final = tuple(_SETTING_TYPES)
# Fields the OpenAI SDK's `chat.completions.create` takes by name; the rest go in `extra_body`.
OPENAI_NAMED: Final = frozenset({"parallel_tool_calls", "reasoning_effort", "tool_choice", "tools"})
_RECORD_KEYS: Final = frozenset({"format", "version", "system", "tools", "settings"})
_LEAD_KEY: Final = "messages"  # present only in a frame with leading messages


def _ordered(value: object) -> str:
    """`dumps_ordered`, a `UsageError` for what is not JSON."""
    try:
        return dumps_ordered(value)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"not a JSON value: {exc}") from None


def _json_list(data: bytes, where: str, of: str) -> list[Any]:
    """A part's bytes as a non-empty JSON list (exact JSON: no duplicate keys, no NaN), else
    `UsageError` naming the part."""
    try:
        value = loads(data, exact=True)
    except CorruptRecordError as exc:
        raise UsageError(f"{where}: {exc}") from None
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where}: must be a non-empty JSON list of {of}")
    return value


def parse_tools(data: bytes, *, where: str = "tools") -> list[dict[str, Any]]:
    """`data`'s tools list (objects with a string `type`, key order kept), else `UsageError`."""
    value = _json_list(data, where, "tool objects")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise UsageError(f"{where}[{i}]: must be an object with a string 'type'")
    return cast(list[dict[str, Any]], value)


_JSON_TYPE: Final = {bool: "true or false", str: "a string", dict: "a JSON object"}


def parse_lead(data: bytes, *, where: str = "messages") -> list[dict[str, Any]]:
    """The leading messages a frame holds: a non-empty JSON list of message objects, each
    with a string `role` (the system message is the frame's own part, never one of them).
    Raises UsageError."""
    value = _json_list(data, where, "message objects")
    try:
        lead = check_history(value)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    if lead[0]["role"] in ("system", "developer"):
        raise UsageError(f"{where}: the first message is a system message: that is the frame's")
    return lead


def encode_frame_record(
    system: str,
    tools: str | None,
    settings: Mapping[str, object],
    *,
    typed: bool = True,
    messages: str | None = None,
) -> bytes:
    """The exact bytes of a frame record (canonical JSON and a newline); its sha names it.
    Raises UsageError: a part is not a sha, a setting is not one of `PROMPT_SETTINGS`, or
    (`typed`: a new record) not of its JSON type."""
    for part in (system, tools, messages):
        if part is not None and not is_full_sha(part):
            raise UsageError(f"not a sha256: {part!r}")
    unknown = sorted(set(settings) - set(PROMPT_SETTINGS))
    if unknown:
        raise UsageError(
            f"not a prompt setting: {', '.join(unknown)}",
            hint=f"a frame holds what the template renders: {', '.join(PROMPT_SETTINGS)}",
        )
    kwargs = settings.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise UsageError("chat_template_kwargs must be a JSON object")
    for key, value in settings.items() if typed else ():  # new frames; stored ones read as is
        if value is not None and not isinstance(value, _SETTING_TYPES[key]):
            want = " or ".join(_JSON_TYPE[t] for t in _SETTING_TYPES[key])
            raise UsageError(f"setting {key} must be {want}, not {value!r}")
    record = {"format": FRAME_FORMAT, "version": FRAME_VERSION, "system": system}
    record |= {"tools": tools, "settings": dict(settings)}
    if messages is not None:
        record[_LEAD_KEY] = messages
    try:  # the settings' JSON round trip refuses what cannot travel (NaN, big ints, depth)
        return dumps_canonical(record) + b"\n"
    except (TypeError, ValueError) as exc:
        raise UsageError(f"settings are not JSON: {exc}") from None


def parse_frame_record(sha: str, raw: bytes) -> tuple[str, str | None, dict[str, Any], str | None]:
    """(system sha, tools sha or None, settings, leading messages' sha or None) of a frame
    record, after checking its sha.
    Raises IntegrityError: the bytes do not hash to `sha`; CorruptRecordError: they do, but
    are not the canonical record of a frame."""
    actual = sha256_hex(raw)
    if actual != sha:
        raise IntegrityError(
            f"frame {sha}: record hashes to {actual}; refusing to use it",
            expected=sha,
            actual=actual,
        )
    try:
        record = loads(raw, exact=True)
    except CorruptRecordError:
        raise CorruptRecordError(f"frame {sha}: not JSON by the project's rules") from None
    if not isinstance(record, dict) or set(record) - {_LEAD_KEY} != _RECORD_KEYS:
        raise CorruptRecordError(f"frame {sha}: not a frame record")
    if record["format"] != FRAME_FORMAT or record["version"] != FRAME_VERSION:
        raise CorruptRecordError(f"frame {sha}: unknown frame format or version")
    system, tools, settings = record["system"], record["tools"], record["settings"]
    if not isinstance(system, str) or not isinstance(tools, str | None):
        raise CorruptRecordError(f"frame {sha}: 'system' or 'tools' is not a sha256")
    lead = record.get(_LEAD_KEY)
    if _LEAD_KEY in record and not isinstance(lead, str):
        raise CorruptRecordError(f"frame {sha}: 'messages' is not a sha256")
    lead = lead if isinstance(lead, str) else None
    if not isinstance(settings, dict):
        raise CorruptRecordError(f"frame {sha}: 'settings' is not an object")
    try:  # the parts' shas and the settings are checked as when the record was written
        canonical = encode_frame_record(system, tools, settings, typed=False, messages=lead)
    except UsageError as exc:
        raise CorruptRecordError(f"frame {sha}: {exc}") from None
    if canonical != raw:
        raise CorruptRecordError(f"frame {sha}: record is not in canonical form")
    return system, tools, settings, lead


@dataclass(frozen=True, slots=True)
class Frame:
    """A verified frame: its sha, system prefix, tools bytes and prompt settings (canonical JSON:
    immutable). Its parts are parsed once, when built; `settings`, `tools` and `lead` hand out
    copies."""

    sha256: str
    system: Prefix
    tools_sha256: str | None
    tools_data: bytes | None
    settings_json: bytes
    name: str | None = None
    lead_sha256: str | None = None  # the leading messages' object, when the frame has them
    lead_data: bytes | None = None
    _tools: list[dict[str, Any]] | None = field(default=None, init=False, repr=False, compare=False)
    _lead: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False, compare=False)
    _settings: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    kind: ClassVar[str] = "frame"

    def __post_init__(self) -> None:
        value = loads(self.settings_json)  # canonical JSON of an object, checked when read
        assert isinstance(value, dict)  # noqa: S101 -- the record's reader made it one
        object.__setattr__(self, "_settings", value)
        if self.tools_data is not None:
            tools = parse_tools(self.tools_data, where=f"tools {self.tools_sha256}")
            object.__setattr__(self, "_tools", tools)
        if self.lead_data is not None:
            lead = parse_lead(self.lead_data, where=f"messages {self.lead_sha256}")
            object.__setattr__(self, "_lead", lead)

    @property
    def settings(self) -> dict[str, Any]:
        """The prompt settings (a copy: a caller's edit never reaches the next body)."""
        return copy.deepcopy(self._settings)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return copy.deepcopy(self._tools)

    @property
    def lead(self) -> list[dict[str, Any]]:
        """The leading messages (a copy; empty when the frame has none)."""
        return copy.deepcopy(self._lead)

    @property
    def renders_tools(self) -> bool:
        """Whether the tools reach the prompt (`tool_choice: "none"` removes them)."""
        return self.tools_data is not None and self._settings.get("tool_choice") != "none"

    @property
    def frame_sha256(self) -> str | None:
        return self.sha256

    @property
    def head_bytes(self) -> int:
        """Bytes of the rendered head the frame owns: system content, the tools JSON and the
        leading messages' text."""
        tools = len(self.tools_data) if self.tools_data is not None and self.renders_tools else 0
        return self.system.size + tools + text_bytes(self._lead)

    def head(self) -> dict[str, Any]:
        """The request fields the frame fixes, `messages` aside: tools and settings."""
        tools, settings = self.tools, self.settings
        return settings if tools is None else {**settings, "tools": tools}

    def messages(self, history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The verified system message, the leading messages, then the loop's own history
        (copied, unchanged)."""
        system = {"role": "system", "content": self.system.text}
        return [system, *self.lead, *check_history(history)]

    def body(self, history: Sequence[Mapping[str, Any]], **params: Any) -> dict[str, Any]:
        """The full chat body: `params` (model, max_tokens, ...), the frame's tools and
        settings, and `messages` = system + history. Raises UsageError: `params` sets
        `messages`, or a frame part to another value."""
        if "messages" in params:
            raise UsageError("body() builds 'messages' itself; pass the history instead")
        check_params(params, "body()")
        head = self.head()
        for key in ("tools", *PROMPT_SETTINGS):
            if key in params and (key not in head or _ordered(params[key]) != _ordered(head[key])):
                raise UsageError(
                    f"{key!r} is part of frame {self.sha256[:12]}; a different value would "
                    "miss the warmed prefix",
                    hint="register another frame for that head",
                )
        return {**params, **head, "messages": self.messages(history)}

    def openai_kwargs(self, history: Sequence[Mapping[str, Any]], **params: Any) -> dict[str, Any]:
        """`body()` as `OpenAI().chat.completions.create` kwargs, unnamed fields in `extra_body`."""
        if "extra_body" in params:  # merged with the frame's settings: a mapping of fields
            check_type(params["extra_body"], Mapping, "openai_kwargs: extra_body", "a mapping")
        body = self.body(history, **params)
        named = {"messages", "model", "stream", *OPENAI_NAMED}
        extra = {k: body.pop(k) for k in list(body) if k in PROMPT_SETTINGS and k not in named}
        if extra:
            body["extra_body"] = {**body.get("extra_body", {}), **extra}
        return body

    def drift(self, body: Mapping[str, Any]) -> list[Drift]:
        """Which parts of a request `body` differ from this frame (empty: none drifted)."""
        out = system_drift(self.system, body)
        if self._lead:
            sent = body.get("messages")
            got = sent[1 : 1 + len(self._lead)] if isinstance(sent, list) else None
            if got is None or _ordered(got) != _ordered(self._lead):
                n = len(self._lead)
                out.append(Drift("messages", f"the {n} leading messages differ from the frame's"))
        sent_tools, mine = body.get("tools"), self._tools
        if sent_tools is None and mine is not None:
            out.append(Drift("tools", f"dropped (frame has {len(mine)} tools)"))
        elif sent_tools is not None and mine is None:
            out.append(Drift("tools", "added (the frame has none)"))
        elif sent_tools is not None and _ordered(sent_tools) != _ordered(mine):
            sha = sha256_hex(_ordered(sent_tools).encode("utf-8"))[:12]
            mine_sha = (self.tools_sha256 or "")[:12]
            out.append(Drift("tools", f"changed (call's tools {sha}, frame's {mine_sha})"))
        settings = self._settings
        for key in PROMPT_SETTINGS:
            have, sent = key in settings, key in body and body[key] is not None
            if have and not sent:
                out.append(Drift(key, f"dropped (frame: {_ordered(settings[key])})"))
            elif sent and not have:
                out.append(Drift(key, f"added ({_ordered(body[key])}; the frame has none)"))
            elif have and _ordered(body[key]) != _ordered(settings[key]):
                note = ", which removes the tools from the prompt" if body[key] == "none" else ""
                out.append(Drift(key, f"{_ordered(settings[key])} -> {_ordered(body[key])}{note}"))
        return out


# What a verb sends as the head of its calls: a verified prefix or a verified frame.
Head = Prefix | Frame


def beyond_prefix(head: Head, body: Mapping[str, Any]) -> list[str]:
    """The prompt-shaping fields request `body` (as the worker reads it: `extra_body` merged)
    sends that a bare prefix cannot re-send: tools and the template settings
    (`PROMPT_SETTINGS`). A frame's drift check compares them; for a frame: none."""
    if isinstance(head, Frame):
        return []
    extra = ["tools"] if body.get("tools") not in (None, []) else []
    return extra + [key for key in PROMPT_SETTINGS if body.get(key) is not None]


def not_a_prefix_call(head: Head, fields: Sequence[str], harm: str) -> str:
    """Why a request with `fields` (`beyond_prefix`) is refused for bare prefix `head`."""
    return (
        f"the body sends prefix {head.sha256[:12]} with {', '.join(fields)}, which a bare "
        f"prefix cannot re-send (kept without them, {harm}): register them with the prefix "
        "as a frame (`prefixreg frame SYSTEM --tools FILE`) and use the frame"
    )
