"""What each request sent, against the registry and `--frame`. Pure, given the lookup.

Identity: `messages[0].content` is hashed (sha256 of its exact UTF-8 bytes; content that is
not a string has a `problem`, never a sha) and looked up once per sha; a match is the
registry's verified read (re-hashed, same length), never a token count, and a corrupt
object raises. The batch's prefix is the registered one most requests carry (ties: the
first seen), else the most common, said unregistered; never a probe slice unless all are.
Drift: what the head's `drift` names; an event starts where a call's drift differs from the
previous call's and counts the cold calls up to the next change. No prompt text is kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import groupby
from typing import Literal

from prefixreg.core.digest import sha256_hex
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.prefix import Drift

# (sha, byte length) -> the names of the registered object with exactly those bytes (maybe
# none), or None when the registry holds no such object.
Lookup = Callable[[str, int], "tuple[str, ...] | None"]
Status = Literal["identical", "drifted", "no_text"]
_PAD = " " * 15  # the text report's label column


@dataclass(frozen=True, slots=True)
class SystemPrompt:
    """`messages[0]` of a request: its content's UTF-8 sha256 and length, or why not (`problem`)."""

    sha256: str | None
    bytes: int | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class PromptSeen:
    """A request read, its first message, its drift from the frame (None: no frame, or no way to
    compare its head)."""

    source: str
    system: SystemPrompt
    drift: tuple[Drift, ...] | None = None


def system_prompt(request: Mapping[str, object]) -> SystemPrompt:
    """The identity of a request's first message (content parts are not joined: no join is
    the bytes the model saw)."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return SystemPrompt(None, None, "no messages")
    if not isinstance(messages[0], dict):
        return SystemPrompt(None, None, "messages[0] is not an object")
    content = messages[0].get("content")
    if not isinstance(content, str):
        return SystemPrompt(None, None, "messages[0].content is not a string")
    try:
        data = content.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: not UTF-8 text
        return SystemPrompt(None, None, "messages[0].content is not valid UTF-8")
    return SystemPrompt(sha256_hex(data), len(data))


def listing(title: str, items: Sequence[str], limit: int, indent: str = "") -> list[str]:
    """`title (n):` and the first `limit` items under it (nothing when there are none)."""
    if not items:
        return []
    lines = [f"{indent}{title} ({len(items):,}):", *(f"{indent}  {i}" for i in items[:limit])]
    if len(items) > limit:
        lines.append(f"{indent}  ... and {len(items) - limit:,} more (see --json)")
    return lines


@dataclass(frozen=True, slots=True)
class IdentityReport:
    """Every request's first message against the batch's prefix (`batch_sha`; None: no
    request had text). `found`: sha -> the names of the registered object with those bytes,
    or None when not registered; `found` itself is None when no registry was consulted."""

    prompts: tuple[PromptSeen, ...]
    found: Mapping[str, tuple[str, ...] | None] | None
    batch_sha: str | None
    batch_probe_slice: bool = False

    def status(self, p: PromptSeen) -> Status:
        sha = p.system.sha256
        return "no_text" if sha is None else "identical" if sha == self.batch_sha else "drifted"

    def of(self, status: Status) -> list[PromptSeen]:
        return [p for p in self.prompts if self.status(p) == status]

    def registered(self, sha: str | None) -> tuple[bool | None, tuple[str, ...]]:
        """(registered, names) of `sha`; registered is None when no registry was consulted."""
        if self.found is None or sha is None:
            return None, ()
        names = self.found.get(sha)
        return names is not None, names or ()

    def _describe(self, p: PromptSeen) -> str:
        if p.system.sha256 is None:
            return p.system.problem or "no text first message"
        registered, names = self.registered(p.system.sha256)
        where = {None: "registry not consulted", False: "not registered"}.get(registered)
        where = where or "registered" + (f" as {', '.join(names)}" if names else "")
        return f"sha {p.system.sha256[:12]}, {p.system.bytes or 0:,} bytes, {where}"

    def to_dict(self) -> JSONObject:
        calls: list[JSONValue] = []
        for p in self.prompts:
            registered, names = self.registered(p.system.sha256)
            row = {"source": p.source, "status": self.status(p), "names": list(names)}
            calls.append(row | asdict(p.system) | {"registered": registered})
        registered, names = self.registered(self.batch_sha)
        identical = self.of("identical")
        batch: JSONObject = {
            "sha256": self.batch_sha,
            "bytes": identical[0].system.bytes if identical else None,
            "names": list(names),
            "registered": registered,
            "probe_slice": self.batch_probe_slice,
        }
        return {
            "requests": len(self.prompts),
            "batch_prefix": None if self.batch_sha is None else batch,
            "identical": len(identical),
            "drifted": [p.source for p in self.of("drifted")],
            "no_text": [p.source for p in self.of("no_text")],
            "calls": calls,
        }

    def text_lines(self, *, limit: int = 10) -> list[str]:
        n, identical = len(self.prompts), self.of("identical")
        lines = [f"system prefix  none of {n:,} requests has a text first message"]
        if self.batch_sha is not None:
            registered, names = self.registered(self.batch_sha)
            states = {None: "no registry consulted", True: "registered, bytes verified"}
            state = states.get(registered, "NOT registered in this registry")
            if self.batch_probe_slice:
                state = "a probe slice, not one of the registry's prefixes"
            label = f"{', '.join(names)} " if names else ""
            size = identical[0].system.bytes or 0
            lines = [
                f"system prefix  {len(identical):,} of {n:,} requests byte-identical to "
                f"{label}sha {self.batch_sha} ({size:,} bytes; {state})"
            ]
        titles: dict[Status, str] = {"drifted": "drifted", "no_text": "without a text message"}
        for status, title in titles.items():
            items = [f"{p.source}: {self._describe(p)}" for p in self.of(status)]
            lines += listing(title, items, limit, _PAD)
        return lines


def check_identity(
    prompts: Sequence[PromptSeen], lookup: Lookup | None, probe_slices: Collection[str] = ()
) -> IdentityReport | None:
    """Judge every request's first message; None when no request was read."""
    if not prompts:
        return None
    sizes: dict[str, int] = {}  # once per distinct prefix, in first-seen order
    for p in prompts:
        if p.system.sha256 is not None and p.system.bytes is not None:
            sizes.setdefault(p.system.sha256, p.system.bytes)
    found = None if lookup is None else {sha: lookup(sha, n) for sha, n in sizes.items()}
    counts = Counter(p.system.sha256 for p in prompts)
    own = [sha for sha in sizes if sha not in probe_slices]
    pool = [sha for sha in own if (found or {}).get(sha) is not None] or own or list(sizes)
    batch = max(pool, key=lambda sha: counts[sha]) if pool else None  # the first of equals
    return IdentityReport(tuple(prompts), found, batch, batch in probe_slices)


@dataclass(frozen=True, slots=True)
class DriftEvent:
    """Calls `index` onwards drifted from the frame in `drift`; of the `calls` calls from
    there to the next change, `answered` carried a server answer and `cold_after` were cold."""

    index: int
    drift: tuple[Drift, ...]
    cold_after: int
    calls: int
    answered: int

    def __str__(self) -> str:
        parts = "; ".join(str(d) for d in self.drift)
        known = "" if self.answered == self.calls else f" ({self.answered} with a server answer)"
        return (
            f"call {self.index}: {parts} — {self.cold_after} of the {self.calls} calls "
            f"that follow were cold{known}"
        )


def drift_events(rows: Sequence[tuple[tuple[Drift, ...], str | None]]) -> list[DriftEvent]:
    """Each change of drift along (drift, call state or None) rows in call order."""
    events: list[DriftEvent] = []
    start = 0
    for drift, run in groupby(rows, key=lambda row: row[0]):
        states = [state for _, state in run]
        if drift:
            answered = len(states) - states.count(None)
            events.append(DriftEvent(start, drift, states.count("cold"), len(states), answered))
        start += len(states)
    return events


@dataclass(frozen=True, slots=True)
class FrameAudit:
    """The requests read against one frame, in call order: (source, drift, the judge's
    state of its call when its response was read with it, else None)."""

    frame: Head
    rows: tuple[tuple[str, tuple[Drift, ...], str | None], ...]

    def events(self) -> list[DriftEvent]:
        return drift_events([(drift, state) for _, drift, state in self.rows])

    def to_dict(self) -> JSONObject:
        drifted = sum(1 for _, drift, _ in self.rows if drift)
        calls: list[JSONValue] = [
            {"source": s, "drift": [asdict(d) for d in drift], "cache_state": state}
            for s, drift, state in self.rows
        ]
        return {
            "frame": self.frame.sha256,
            "name": self.frame.name,
            "requests": len(self.rows),
            "in_line": len(self.rows) - drifted,
            "drifted": drifted,
            "events": [asdict(e) for e in self.events()],
            "calls": calls,
        }

    def text_lines(self, *, limit: int = 10) -> list[str]:
        name = f"{self.frame.name} " if self.frame.name else ""
        drifted = [
            f"{s}: {', '.join(d.part for d in drift)}" + (f" [{st}]" if st else "")
            for s, drift, st in self.rows
            if drift
        ]
        return [
            f"frame          {len(self.rows) - len(drifted):,} of {len(self.rows):,} requests "
            f"in line with frame {name}{self.frame.sha256[:16]}",
            *listing("drift changes", [str(e) for e in self.events()], limit, _PAD),
            *listing("drifted requests", drifted, limit, _PAD),
        ]
