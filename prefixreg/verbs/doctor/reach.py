"""`doctor`'s reach: the best Cmax this build's probe receipts prove, and the registered
heads' spans on it. Reads receipts and measurements through the store, never a path.

Cmax is the largest cached count a fresh-tail call (leg B) was served, of the B legs whose
counts the judge took (not `unverified`). Every receipt of the build is weighed and the best
evidence wins: the largest Cmax, so a later, smaller probe (a 16k `--survival` run) never
lowers what an earlier one proved; at equal Cmax a ceiling beats a lower bound. When every
B leg of that receipt resumed whole, Cmax is a lower bound (the cache may reach further).
A head's span is that of its latest warm on this build, a resumed one first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from prefixreg.core.errors import PrefixregError
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import loads_object
from prefixreg.core.records import strict_count
from prefixreg.registry.store import Registry
from prefixreg.verbs.measure.calls import head_warms

JUDGED = ("resumed", "partial", "cold")


@dataclass(frozen=True, slots=True)
class ProbeReach:
    """What the best probe receipt of this build says about Cmax."""

    cmax: int
    whole: bool  # every B leg resumed whole: Cmax is a lower bound
    at: str
    sizes: tuple[int, ...]
    receipts: int = 1  # receipts of this build with a Cmax, weighed together


@dataclass(frozen=True, slots=True)
class PrefixSpan:
    """A registered head and its token span on this build (None: never measured here)."""

    name: str
    sha256: str
    tokens: int | None
    error: str | None = None  # the head failed verification


@dataclass(frozen=True, slots=True)
class Reach:
    probe: ProbeReach | None
    prefixes: tuple[PrefixSpan, ...]


def _receipt_reach(path: Path, raw: bytes, build_id: str) -> ProbeReach | None:
    try:
        receipt = loads_object(raw, path=path)
    except PrefixregError:
        return None  # an unreadable receipt proves nothing
    build, calls, options = receipt.get("build"), receipt.get("calls"), receipt.get("options")
    if not isinstance(build, dict) or build.get("build_id") != build_id:
        return None
    calls = calls if isinstance(calls, list) else []
    legs = [c for c in calls if isinstance(c, dict) and c.get("leg") == "B"]
    counts = [
        strict_count(ev.get("cached_tokens"))
        for c in legs
        if c.get("verdict") in JUDGED and isinstance(ev := c.get("evidence"), dict)
    ]
    valid = [n for n in counts if n is not None]
    if not valid:
        return None
    sizes = options.get("sizes") if isinstance(options, dict) else None
    at = receipt.get("at")
    return ProbeReach(
        cmax=max(valid),
        whole=all(c.get("verdict") == "resumed" for c in legs),
        at=at if isinstance(at, str) else "?",
        sizes=tuple(s for s in sizes if type(s) is int) if isinstance(sizes, list) else (),
    )


def _span(registry: Registry, head: Head, build_id: str) -> int | None:
    try:
        warms = head_warms(registry, head, build_id)
    except PrefixregError:
        return None
    spans = [
        (m.outcome.verdict == "resumed", i, span)
        for i, m in enumerate(warms)
        if (span := m.outcome.span_tokens)
    ]
    return max(spans)[2] if spans else None


def read_reach(registry: Registry, build_id: str) -> Reach:
    """The best probe evidence of `build_id` and every named head's span on it."""
    found = [
        r for path, raw in registry.probe_receipts() if (r := _receipt_reach(path, raw, build_id))
    ]
    best = max(found, key=lambda r: (r.cmax, not r.whole), default=None)
    spans = []
    for name, sha in registry.names().items():
        try:
            head = registry.head(name)
        except PrefixregError as exc:
            spans.append(PrefixSpan(name, sha, None, str(exc)))
            continue
        spans.append(PrefixSpan(name, head.sha256, _span(registry, head, build_id)))
    return Reach(None if best is None else replace(best, receipts=len(found)), tuple(spans))
