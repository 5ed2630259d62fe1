"""The registry's heads as the gateway matches them: an in-memory index built once at start,
and the registration of a new head (`--register`: a frame, or a prefix for a head of system
text alone, source `gateway/<api>`) off the event loop.

A registered prefix matches a head with no tools and no settings by its sha; a registered
frame matches by its parts (system sha, the sha of its tools as `dumps_ordered` writes
them, its settings), so a frame whose tools file was written with other spacing still
matches. A frame with leading messages matches a request with those parts whose history
starts with those messages (compared as `dumps_ordered` writes them; the longest wins):
`extend` makes the head that frame, its messages' bytes part of the head's span. A head
registered here is stored as the gateway hashed it (its tools as `dumps_ordered` bytes), so
its frame sha is the head's sha.

Invariants:
- Never the loop's failure: a registry that cannot be opened or read, or a registration
  that fails, is logged and counted (`failures`); lookups then answer "unknown".
- Only the store touches registry paths: this module calls `Registry` methods only.
- Registration runs on one background thread, one head at a time, each head once; at most
  `MAX_QUEUED` heads wait for it (a slow or locked registry): the ones beyond are not
  registered, only counted (`dropped`, the `registrations_dropped` gauge), and a later call
  of the same head tries again.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import PrefixregError
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import dumps_ordered, loads_object
from prefixreg.core.prefix import text_bytes
from prefixreg.gateway.head import Head
from prefixreg.registry.store import Registry

log = logging.getLogger("prefixreg.gateway")
Key = tuple[str, str | None, str]
MAX_QUEUED: Final = 256  # heads waiting to be registered


def frame_key(frame: Frame) -> Key:
    tools = frame.tools
    tools_sha = None
    if tools is not None:
        tools_sha = hashlib.sha256(dumps_ordered(tools).encode("utf-8")).hexdigest()
    return frame.system.sha256, tools_sha, dumps_ordered(dict(sorted(frame.settings.items())))


class KnownHeads:
    """Which heads the registry holds, by parts; `name_of` answers (name or short sha)."""

    def __init__(self, root: Path | None, *, register: bool) -> None:
        self.root = root
        self.register_new = register
        self.failures = 0
        self.registered = 0
        self.dropped = 0  # registrations not queued: `MAX_QUEUED` were already waiting
        self._by_key: dict[Key, tuple[str, str | None]] = {}  # parts -> (sha, name)
        # parts -> (message count, their sha, frame sha, name) of frames with leading messages
        self._leads: dict[Key, list[tuple[int, str, str, str | None]]] = {}
        self._lead_names: dict[str, tuple[str, str | None]] = {}  # frame sha -> (sha, name)
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._registry: Registry | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._tools: dict[str, bytes] = {}  # a head's tools bytes, until it is registered

    def load(self) -> None:
        """Index the registry's prefixes and frames, each read verified: one that fails is
        left unnamed (and counted), the others are still indexed."""
        if self.root is None:
            return
        registry = Registry(self.root)
        self._registry = registry
        try:
            listed = registry.list_objects(frames=True) if registry.exists else []
        except (PrefixregError, OSError) as exc:
            self.failures += 1
            log.warning("registry: heads not listed (%s); they stay unnamed", type(exc).__name__)
            return
        for info in listed:
            name = info.names[0] if info.names else None
            try:
                if info.kind == "frame":
                    frame = registry.frame(info.sha256)
                    key = frame_key(frame)
                    if frame.lead:
                        self._index_lead(key, frame, name)
                        continue
                elif info.kind == "prefix" and not info.probe_slice:
                    key = (info.sha256, None, "{}")
                else:
                    continue
            except (PrefixregError, OSError) as exc:
                self.failures += 1
                log.warning(
                    "registry: head %s not indexed (%s)", info.sha256[:12], type(exc).__name__
                )
                continue
            with self._lock:
                if key not in self._by_key or name is not None:
                    self._by_key[key] = (info.sha256, name)

    def _index_lead(self, key: Key, frame: Frame, name: str | None) -> None:
        lead = frame.lead
        digest = hashlib.sha256(dumps_ordered(lead).encode("utf-8")).hexdigest()
        with self._lock:
            entries = [e for e in self._leads.get(key, []) if e[2] != frame.sha256]
            entries.append((len(lead), digest, frame.sha256, name))
            self._leads[key] = sorted(entries, key=lambda e: -e[0])  # the longest first
            if frame.sha256 not in self._lead_names or name is not None:
                self._lead_names[frame.sha256] = (frame.sha256, name)

    def extend(self, head: Head, history: list[Any]) -> Head:
        """`head` as the registered frame whose leading messages `history` starts with (the
        longest), or `head` itself."""
        with self._lock:
            entries = self._leads.get(head.parts_key)
        for count, digest, sha, _name in entries or ():
            if len(history) < count:
                continue
            try:
                sent = dumps_ordered(history[:count]).encode("utf-8")
            except (TypeError, ValueError):
                return head
            if hashlib.sha256(sent).hexdigest() == digest:
                size = text_bytes(history[:count])
                return replace(
                    head, sha256=sha, lead_sha256=digest, lead_bytes=size, base_sha256=head.sha256
                )
        return head

    def name_of(self, head: Head) -> tuple[str | None, str | None]:
        """(registered sha, name) of `head`, or (None, None) when the registry has neither."""
        with self._lock:
            if head.lead_sha256 is not None:
                return self._lead_names.get(head.sha256, (None, None))
            found = self._by_key.get(head.parts_key)
        return found if found is not None else (None, None)

    def maybe_register(self, head: Head, api: str) -> None:
        """With `--register`, add an unknown head as a frame (source `gateway/<api>`), in the
        background; a head already known or on its way is not sent again."""
        if not self.register_new or self._registry is None:
            return
        with self._lock:
            if head.parts_key in self._by_key or head.sha256 in self._pending:
                return
            if len(self._pending) >= MAX_QUEUED:
                self.dropped += 1
                self._tools.pop(head.sha256, None)
                return
            self._pending.add(head.sha256)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixreg-register")
        self._pool.submit(self._register, head, api, self._tools_of(head))

    def remember_tools(self, head: Head, tools: Any) -> None:
        """The tools bytes of a head to register (kept only until it is registered)."""
        if not self.register_new or tools in (None, []):
            return
        with self._lock:
            if head.sha256 not in self._tools and len(self._tools) < 1024:
                self._tools[head.sha256] = dumps_ordered(tools).encode("utf-8")

    def _tools_of(self, head: Head) -> bytes | None:
        with self._lock:
            return self._tools.pop(head.sha256, None)

    def _register(self, head: Head, api: str, tools: bytes | None) -> None:
        registry = self._registry
        assert registry is not None  # noqa: S101 -- checked before submitting
        try:
            source = f"gateway/{api}"
            system = registry.add(head.system, source=source, note=f"a head seen by the {source}")
            if head.tools_sha256 is not None and tools is None:
                raise PrefixregError("the head's tools were not kept")
            sha = system  # a head of system text alone is a prefix; else a frame over it
            if not head.is_prefix:
                settings = loads_object(head.settings_json)
                sha = registry.add_frame(system, tools=tools, settings=settings, note=source)
            with self._lock:
                self._by_key[head.parts_key] = (sha, None)
                self.registered += 1
            if sha != head.sha256:
                log.warning("registry: head %s registered as frame %s", head.sha256[:12], sha[:12])
        except (PrefixregError, OSError) as exc:
            self.failures += 1
            log.warning(
                "registry: could not register head %s (%s)", head.sha256[:12], type(exc).__name__
            )
        finally:
            with self._lock:
                self._pending.discard(head.sha256)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
