"""Byte identity of each request's system prefix against the registry, and the drift.

Per request read, `messages[0].content` is hashed (sha256 of its UTF-8 bytes, `read.py`)
and looked up by that sha. The batch's prefix is the registered one most requests carry
(ties: the first seen); when none is registered, the most common one, said to be
unregistered. A probe slice (`probe_slices`) is never preferred as the batch's prefix; a
batch that carries only probe slices is said to be one, not one of the user's prefixes.
A request whose first message is another prefix has *drifted*.

Invariants:

- Identity is by sha256 of the exact bytes, confirmed by the registry's verified read (the
  stored object re-hashed, and its length equal to the request's): never by token count.
- A sha is looked up once, however many requests carry it. A lookup raises on a corrupt
  object (the store fails closed); "not registered" is None, never an error.
- With no registry to ask, `registered` is None everywhere and the text says so.
- Nothing here holds prompt text: only shas, lengths, sources and names. Pure, given the
  lookup.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.verbs.audit.prompt import PromptSeen

__all__ = ["IdentityReport", "Lookup", "PromptIdentity", "check_identity"]

Lookup = Callable[[str, int], "tuple[str, ...] | None"]
"""(sha, byte length) -> the names of the registered object with exactly those bytes
(maybe none), or None when the registry holds no such object."""

Status = Literal["identical", "drifted", "no_text"]


@dataclass(frozen=True, slots=True)
class PromptIdentity:
    """One request's first message, judged against the batch's prefix."""

    source: str
    sha256: str | None
    size: int | None
    status: Status
    registered: bool | None
    names: tuple[str, ...]
    problem: str | None

    def to_dict(self) -> JSONObject:
        return {
            "source": self.source,
            "sha256": self.sha256,
            "bytes": self.size,
            "status": self.status,
            "registered": self.registered,
            "names": list(self.names),
            "problem": self.problem,
        }

    def describe(self) -> str:
        if self.sha256 is None:
            return self.problem or "no text first message"
        where = (
            "registry not consulted"
            if self.registered is None
            else (
                "registered" + (f" as {', '.join(self.names)}" if self.names else "")
                if self.registered
                else "not registered"
            )
        )
        return f"sha {self.sha256[:12]}, {self.size or 0:,} bytes, {where}"


@dataclass(frozen=True, slots=True)
class IdentityReport:
    """Every request's verdict and the batch's prefix (None: no request had text)."""

    prompts: tuple[PromptIdentity, ...]
    batch_sha: str | None
    batch_size: int | None
    batch_names: tuple[str, ...]
    batch_registered: bool | None
    batch_probe_slice: bool = False

    def of(self, status: Status) -> list[PromptIdentity]:
        return [p for p in self.prompts if p.status == status]

    def to_dict(self) -> JSONObject:
        calls: list[JSONValue] = [p.to_dict() for p in self.prompts]
        return {
            "requests": len(self.prompts),
            "batch_prefix": None
            if self.batch_sha is None
            else {
                "sha256": self.batch_sha,
                "bytes": self.batch_size,
                "names": list(self.batch_names),
                "registered": self.batch_registered,
                "probe_slice": self.batch_probe_slice,
            },
            "identical": len(self.of("identical")),
            "drifted": [p.source for p in self.of("drifted")],
            "no_text": [p.source for p in self.of("no_text")],
            "calls": calls,
        }

    def text_lines(self, *, limit: int = 10) -> list[str]:
        pad = " " * 15
        n = len(self.prompts)
        if self.batch_sha is None:
            lines = [f"system prefix  none of {n:,} requests has a text first message"]
        else:
            label = f"{', '.join(self.batch_names)} " if self.batch_names else ""
            if self.batch_probe_slice:
                state = "a probe slice, not one of the registry's prefixes"
            elif self.batch_registered:
                state = "registered, bytes verified"
            elif self.batch_registered is None:
                state = "no registry consulted"
            else:
                state = "NOT registered in this registry"
            lines = [
                f"system prefix  {len(self.of('identical')):,} of {n:,} requests byte-identical "
                f"to {label}sha {self.batch_sha} ({self.batch_size or 0:,} bytes; {state})"
            ]
        sections: tuple[tuple[Status, str], ...] = (
            ("drifted", "drifted"),
            ("no_text", "without a text message"),
        )
        for status, title in sections:
            items = self.of(status)
            if not items:
                continue
            lines.append(f"{pad}{title} ({len(items):,}):")
            lines.extend(f"{pad}  {p.source}: {p.describe()}" for p in items[:limit])
            if len(items) > limit:
                lines.append(f"{pad}  ... and {len(items) - limit:,} more (see --json)")
        return lines


def check_identity(
    prompts: Sequence[PromptSeen], lookup: Lookup | None, probe_slices: Collection[str] = ()
) -> IdentityReport | None:
    """Judge every request's first message; None when no request was read. `probe_slices`:
    the shas the registry marks as probe slices (never preferred as the batch's prefix)."""
    if not prompts:
        return None
    sizes: dict[str, int] = {}
    for p in prompts:
        if p.system.sha256 is not None and p.system.size is not None:
            sizes.setdefault(p.system.sha256, p.system.size)
    found: dict[str, tuple[str, ...] | None] = {}
    if lookup is not None:
        for sha, size in sizes.items():  # once per distinct prefix, in first-seen order
            found[sha] = lookup(sha, size)
    counts = Counter(p.system.sha256 for p in prompts if p.system.sha256 is not None)
    own = [sha for sha in sizes if sha not in probe_slices]
    registered = [sha for sha in own if found.get(sha) is not None]
    pool = registered or own or list(sizes)
    # max keeps the first of equals, and `pool` is in first-seen order.
    batch = max(pool, key=lambda sha: counts[sha]) if pool else None

    def known(sha: str) -> tuple[bool | None, tuple[str, ...]]:
        if lookup is None:
            return None, ()
        names = found.get(sha)
        return names is not None, names or ()

    judged = []
    for p in prompts:
        digest = p.system.sha256
        if digest is None:
            judged.append(
                PromptIdentity(p.source, None, None, "no_text", None, (), p.system.problem)
            )
            continue
        is_reg, names = known(digest)
        status: Status = "identical" if digest == batch else "drifted"
        judged.append(PromptIdentity(p.source, digest, p.system.size, status, is_reg, names, None))
    batch_reg, batch_names = known(batch) if batch is not None else (None, ())
    return IdentityReport(
        prompts=tuple(judged),
        batch_sha=batch,
        batch_size=sizes.get(batch) if batch is not None else None,
        batch_names=batch_names,
        batch_registered=batch_reg,
        batch_probe_slice=batch is not None and batch in probe_slices,
    )
