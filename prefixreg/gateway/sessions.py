"""Sessions: which earlier calls a call continues. Not thread-safe: the event loop owns it.

A session is known, first that applies, by:
1. the body's `prompt_cache_key` (OpenAI clients), then `metadata.user_id` is NOT used (it
   names a user, not a conversation);
2. a session header a client sends (`x-session-id`, `x-claude-code-session-id`,
   `session-id`, `x-dynamo-session-id`, `x-prefixreg-session`);
3. else the history it extends: a chain hash over the messages after the head, on the same
   head first, else on any head (a loop whose head carries a per-request nonce). A match
   across heads names the drift with this request's own bytes only and is never refused:
   it proves no one caller sent both calls.

A key or header is a hint, not proof that one caller sent both calls: `owner_of` names the
caller (a hash of its credential and session header), and a drift counts as the session's
own (refusable) only when the session header, or the same owner, says so (`door`).

Invariants:
- Bounded: at most `max_sessions` (the least recently used goes first) and idle ones expire
  after `idle_s`; each keeps hashes, counts and its last head (sha and the system bytes,
  kept in memory only, for the drift excerpt), never a log line of text.
- A session id is a hash: a client's key or header value is never echoed, logged or used
  as a header value as it came.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from prefixreg.gateway.head import Head

SESSION_HEADERS: Final = (
    "x-prefixreg-session",
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "x-dynamo-session-id",
)
_CREDENTIALS: Final = ("authorization", "x-api-key", "api-key")


@dataclass
class Session:
    """What the gateway remembers of one session between its calls."""

    id: str
    source: str  # "key", "header" or "history"
    head: Head | None = None
    worker: str | None = None
    calls: int = 0
    last_seen: float = 0.0
    keys: list[str] = field(default_factory=list)  # its index keys: last chain, on its head

    def extends(self, chain: Sequence[str]) -> int:
        """How many leading messages of a call with `chain` its last call sent (0: none)."""
        last = self.keys[0] if self.keys else None
        return chain.index(last) + 1 if last is not None and last in chain else 0

    owner: str | None = None  # `owner_of` its last call (None: no credential, no header)
    first_user: str | None = None  # the first user message's text (the dynamic-first check)
    slot: int | None = None
    prompt_tokens: int | None = None


def _message_hash(message: object) -> bytes:
    try:
        data = orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        data = repr(message).encode("utf-8", "replace")
    return hashlib.sha256(data).digest()


def _is_reply(message: object) -> bool:
    """Whether a history entry is the model's reply (role `assistant`)."""
    return isinstance(message, Mapping) and message.get("role") == "assistant"


def chain_hashes(messages: Sequence[object]) -> list[str]:
    """h_i = sha256(h_{i-1} || sha256(message_i)) for each message: h_k names the first k."""
    out: list[str] = []
    h = b""
    for message in messages:
        h = hashlib.sha256(h + _message_hash(message)).digest()
        out.append(h.hex())
    return out


def key_of(body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[str, str] | None:
    """(session id, source) from the body's cache key or a session header; else None."""
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return hashlib.sha256(b"key\0" + key.encode("utf-8", "replace")).hexdigest()[:32], "key"
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            raw = value.encode("utf-8", "replace")
            return hashlib.sha256(b"header\0" + raw).hexdigest()[:32], "header"
    return None


def owner_of(headers: Mapping[str, str]) -> str | None:
    """A hash naming the caller: its credential and session header, or None without both."""
    parts = [headers.get(n, "") for n in (*_CREDENTIALS, *SESSION_HEADERS)]
    if not any(parts):
        return None
    raw = "\0".join(parts).encode("utf-8", "replace")
    return hashlib.sha256(b"owner\0" + raw).hexdigest()[:32]


class Sessions:
    """The live sessions (see the module docstring)."""

    def __init__(self, *, max_sessions: int, idle_s: float) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._live: OrderedDict[str, Session] = OrderedDict()
        self._by_chain: dict[str, str] = {}  # chain hash (alone, or "head:chain") -> its id
        self.expired = 0
        self._dropped: list[Session] = []  # expired or pushed out, until `take_dropped`

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> list[Session]:
        return list(self._live.values())

    def find(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        history: Sequence[object],
        head_sha: str | None,
    ) -> tuple[Session, list[str]]:
        """The session this call continues (a new one if none), and its history's chain: by
        key or header, else the longest earlier history it extends (its own head first)."""
        now = time.monotonic()
        self.expire(now)
        chain = chain_hashes(history)
        keyed = key_of(body, headers)
        session: Session | None = None
        if keyed is not None:
            session = self._live.get(keyed[0]) or Session(keyed[0], keyed[1])
        else:
            earlier = list(reversed(chain))  # the whole history first: a retry is its session
            # Its own head first; then any head, so a loop whose head changes every call (a
            # per-request nonce) has its drift named: only an earlier call's whole history
            # that this one continues with a reply (an assistant message after it), never an
            # equal history. Named with this request's own bytes, never refused (`door`).
            tries = [f"{head_sha}:{h}" for h in earlier]
            tries += [h for i, h in enumerate(chain[:-1]) if _is_reply(history[i + 1])][::-1]
            for key in tries:
                sid = self._by_chain.get(key)
                if sid is not None and sid in self._live:
                    session = self._live[sid]
                    break
            if session is None:
                seed = chain[0] if chain else hashlib.sha256(repr(now).encode()).hexdigest()
                made = hashlib.sha256(b"history\0" + seed.encode() + repr(now).encode())
                session = Session(made.hexdigest()[:32], "history")
        session.last_seen = now
        self._live[session.id] = session
        self._live.move_to_end(session.id)
        while len(self._live) > self.max_sessions:
            self._drop(next(iter(self._live)))
        return session, chain

    def record(self, session: Session, chain: list[str], head_sha: str | None) -> None:
        """After a call: its history's chain (alone, and on its head) names the session."""
        self._unindex(session)
        last = chain[-1] if chain else None
        session.keys = [] if last is None else [last, f"{head_sha}:{last}"]
        if session.id in self._live:
            for key in session.keys:
                self._by_chain[key] = session.id

    def _unindex(self, session: Session) -> None:
        for key in session.keys:
            if self._by_chain.get(key) == session.id:
                del self._by_chain[key]

    def expire(self, now: float | None = None) -> list[Session]:
        """Drop sessions idle for longer than `idle_s`; the ones dropped."""
        now = time.monotonic() if now is None else now
        gone = []
        while self._live:
            sid, first = next(iter(self._live.items()))
            if now - first.last_seen <= self.idle_s:
                break
            gone.append(first)
            self._drop(sid)
            self.expired += 1
        return gone

    def take_dropped(self) -> list[Session]:
        """The sessions dropped since the last call (their slots, their keepers go too)."""
        out, self._dropped = self._dropped, []
        return out

    def _drop(self, sid: str) -> None:
        session = self._live.pop(sid, None)
        if session is not None:
            self._unindex(session)
            if len(self._dropped) < 4 * self.max_sessions:
                self._dropped.append(session)
