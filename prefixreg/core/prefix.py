"""`Prefix`: the verified text of one registered prefix, ready to send. Pure.

A `Prefix` is only ever built from bytes that were just hashed and matched their sha
(`Registry.get`), and it keeps the decoded text of exactly those bytes, so the bytes checked
are the bytes sent: nothing re-reads the file between the check and the request.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefixreg.core.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    CorruptRecordError,
    UsageError,
    check_type,
)


class Prefix(NamedTuple):
    """A verified prefix: sha256, exact bytes, the name it was reached by. A tuple (the cheapest
    immutable record) keeps `Registry.get` as cheap as its read and hash; `text` decodes."""

    sha256: str
    data: bytes
    name: str | None = None

    @classmethod
    def from_text(cls, sha256: str, text: str, name: str | None = None) -> Prefix:
        """For callers that hold the text of a sha they verified."""
        return cls(sha256=sha256, data=text.encode("utf-8"), name=name)

    @property
    def text(self) -> str:
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptRecordError(f"prefix {self.sha256} is not valid UTF-8") from None

    @property
    def size(self) -> int:
        return len(self.data)

    # The head protocol, shared with `Frame`: what every verb needs of the head it sends.
    @property
    def kind(self) -> str:
        return "prefix"

    @property
    def system(self) -> Prefix:
        return self  # a bare prefix is its own system prefix

    @property
    def head_bytes(self) -> int:
        return len(self.data)

    @property
    def renders_tools(self) -> bool:
        return False  # a bare prefix sends no tools

    @property
    def frame_sha256(self) -> str | None:
        """The frame a measurement of this head names: none (a frame's own sha)."""
        return None

    def body(self, history: Sequence[Mapping[str, Any]], **params: Any) -> dict[str, Any]:
        """The chat body a loop sends: `params`, then `messages` = this prefix + history."""
        if "messages" in params:
            raise UsageError("body() builds 'messages' itself; pass the history instead")
        check_params(params, "body()")
        system = {"role": "system", "content": self.text}
        return {**params, "messages": [system, *check_history(history)]}

    def drift(self, body: Mapping[str, Any]) -> list[Drift]:
        """Whether a request `body` sent this prefix as `messages[0]` (empty: it did)."""
        return system_drift(self, body)

    def messages(self, tail: str, *, role: str = "system") -> list[dict[str, str]]:
        """The chat messages for one call: this prefix as `messages[0]`, then the user tail."""
        system = {"role": check_text(role, "the role"), "content": self.text}
        return [system, {"role": "user", "content": check_text(tail, "the tail")}]


def check_text(value: object, what: str) -> str:
    """`value` if it is a str that encodes as UTF-8 (no lone surrogates), else `UsageError`."""
    if not isinstance(value, str):
        raise UsageError(f"{what} must be text, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(
            f"{what} is not valid UTF-8 text (lone surrogate at character {exc.start})"
        ) from None
    return value


def check_params(params: Mapping[str, Any], where: str) -> None:
    """Refuse a request field no worker can read (`ArgumentValueError`): a NaN or infinite
    number anywhere in it (JSON has none; it would go out as null or be refused there)."""
    for key, value in params.items():
        stack, seen = [value], set()  # iterative, each container once: a cycle ends too
        while stack:
            item = stack.pop()
            if isinstance(item, float) and not math.isfinite(item):
                raise ArgumentValueError(f"{where}: {key} is not a finite number ({item})")
            if isinstance(item, Mapping | list | tuple) and id(item) not in seen:
                seen.add(id(item))
                stack.extend(item.values() if isinstance(item, Mapping) else item)


def check_history(history: object) -> list[dict[str, Any]]:
    """A copy of `history`: message objects each with a string `role`, else `UsageError`."""
    if isinstance(history, str | bytes) or not isinstance(history, Sequence):
        raise UsageError("history must be a list of message objects")
    for i, message in enumerate(history):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise UsageError(f"history[{i}] must be a message object with a string 'role'")
    return [dict(m) for m in history]


def text_bytes(value: object) -> int:
    """UTF-8 bytes of every string in `value` (messages, a message, a string): what a chat
    template renders of it, less the JSON syntax. Iterative: any nesting depth is read."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "replace"))
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def rest_bytes(body: Mapping[str, Any]) -> int:
    """What a request `body` sends beyond its head: the `text_bytes` of its messages after
    the first (the judge's `rest_bytes`). Raises UsageError: not a request body."""
    given: object = body  # callers outside the type checker pass anything
    messages = given.get("messages") if isinstance(given, Mapping) else None
    if not isinstance(messages, list):
        raise UsageError("rest_bytes() reads a request body with a 'messages' list")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            got = type(message).__name__
            raise ArgumentTypeError(f"rest_bytes: body['messages'][{i}] is a message, not {got}")
    return text_bytes(messages[1:])


def fresh_tail(nonce: str | None = None) -> str:
    """A user tail the server has never seen: only its nonce (16 random hex digits, else
    `nonce`) changes, so on a deterministic tokenizer its token count is fixed."""
    check_type(nonce, (str, type(None)), "fresh_tail: nonce", "a str or None")
    token = nonce if nonce is not None else os.urandom(8).hex()
    return f"prefixreg resume check {token}. Reply with one word."


@dataclass(frozen=True, slots=True)
class Drift:
    """One part of a call that differs from its head: `system`, `tools` or a setting name."""

    part: str
    detail: str

    def __str__(self) -> str:
        return f"{self.part}: {self.detail}"


def system_drift(system: Prefix, body: Mapping[str, Any]) -> list[Drift]:
    """The drift of a request's `messages[0]` from `system` (a list of at most one);
    `UsageError` when `body` is not a mapping."""
    if not isinstance(body, Mapping):
        raise UsageError(f"drift() reads a request body (a mapping), not {type(body).__name__}")
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if not isinstance(first, Mapping) or first.get("role") not in ("system", "developer"):
        return [Drift("system", "messages[0] is not a system message")]
    content = first.get("content")
    if isinstance(content, list):  # content parts: only text parts render into the prompt
        content = "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else b""
    if data == system.data:
        return []
    digest = hashlib.sha256(data).hexdigest()[:12]
    return [Drift("system", f"messages[0] is {digest}, the head has {system.sha256[:12]}")]
