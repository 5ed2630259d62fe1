"""What the heads' sessions share beyond the head: the leading messages every session of a
head sends identically (a few-shot block, a static first user message: a head part the
registry could hold), and a first user message whose static text follows dynamic text.

A session's first call is observed (`observe`): its history's message hashes are cut to the
run they share with the head's earlier sessions (`shared`), and its first user message is
compared with the previous session's (`head.dynamic_first`).

Invariants: bounded (at most `MAX_HEADS` heads, the oldest forgotten first; the first user
text kept is cut to `MAX_TEXT` characters, in memory only, never logged); a proposal needs
at least two sessions, and never includes a session's last message (the call's own turn).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from prefixreg.core.prefix import text_bytes
from prefixreg.gateway.head import dynamic_first

MAX_HEADS: Final = 1000
MAX_TEXT: Final = 8192


@dataclass
class Lead:
    sessions: int = 0
    shared: list[str] | None = None  # message hashes every session so far began with
    shared_bytes: int = 0
    shared_count: int = -1  # how many messages `shared_bytes` counts
    first_user: str | None = None
    dynamic_first: int = 0  # sessions whose first user message led with dynamic text


def _hash(message: object) -> str:
    try:
        return hashlib.sha256(orjson.dumps(message, option=orjson.OPT_SORT_KEYS)).hexdigest()
    except TypeError:
        return ""


def _first_user(history: Sequence[Any]) -> str | None:
    for message in history:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content[:MAX_TEXT] if isinstance(content, str) else None
    return None


class Leads:
    def __init__(self) -> None:
        self._heads: OrderedDict[str, Lead] = OrderedDict()

    def observe(self, head_sha: str, history: Sequence[Any]) -> bool:
        """A session's first call of `head_sha`; True when its first user message leads with
        dynamic text before text the previous session's also had."""
        lead = self._heads.get(head_sha)
        if lead is None:
            lead = self._heads[head_sha] = Lead()
            while len(self._heads) > MAX_HEADS:
                self._heads.popitem(last=False)
        self._heads.move_to_end(head_sha)
        lead.sessions += 1
        hashes = [_hash(m) for m in history[:-1]]
        if lead.shared is None:
            lead.shared = hashes
        else:
            n = 0
            while n < min(len(lead.shared), len(hashes)) and lead.shared[n] == hashes[n]:
                n += 1
            lead.shared = lead.shared[:n]
        if lead.sessions <= 2 or len(lead.shared) != lead.shared_count:  # it shrank: recount
            lead.shared_bytes = text_bytes(list(history[: len(lead.shared)]))
            lead.shared_count = len(lead.shared)
        first = _first_user(history)
        dynamic = (
            first is not None
            and lead.first_user is not None
            and dynamic_first(lead.first_user, first)
        )
        lead.dynamic_first += int(dynamic)
        lead.first_user = first
        return dynamic

    def view(self, head_sha: str) -> dict[str, Any] | None:
        lead = self._heads.get(head_sha)
        if lead is None:
            return None
        proposed = len(lead.shared or []) if lead.sessions >= 2 else 0
        return {
            "sessions": lead.sessions,
            "shared_leading_messages": proposed,
            "shared_leading_bytes": lead.shared_bytes if proposed else 0,
            "dynamic_first_user_message": lead.dynamic_first,
        }

    def heads(self) -> list[str]:
        return list(self._heads)
