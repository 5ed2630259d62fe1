"""`doctor`'s reach check: Cmax from the latest probe of this build against the registered
prefixes' token spans. `diagnose_reach` is pure; `read_reach` asks the store for the receipts
and measurements (never a path of its own).

Cmax is the largest cached count a fresh-tail call (leg B) was served. When every B leg of the
probe resumed its prefix whole, Cmax is only a lower bound (the cache may reach further than the
largest size probed); otherwise it is the ceiling one entry resumes. A prefix's span is the
``span_tokens`` of its latest measurement on this build (its share of the prompt tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from prefixreg.core.errors import CorruptRecordError
from prefixreg.registry.store import Registry

__all__ = ["PrefixSpan", "ProbeReach", "Reach", "read_reach"]


@dataclass(frozen=True, slots=True)
class ProbeReach:
    """What the latest probe receipt of this build says about Cmax."""

    cmax: int | None
    whole: bool  # every B leg resumed whole: Cmax is a lower bound
    at: str
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixSpan:
    """A registered prefix and its token span on this build (None: never measured here)."""

    name: str
    sha256: str
    tokens: int | None


@dataclass(frozen=True, slots=True)
class Reach:
    probe: ProbeReach | None
    prefixes: tuple[PrefixSpan, ...]


def _int(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _probe_reach(raw: bytes, build_id: str) -> ProbeReach | None:
    try:
        receipt = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(receipt, dict):
        return None
    build = receipt.get("build")
    if not isinstance(build, dict) or build.get("build_id") != build_id:
        return None
    calls = receipt.get("calls")
    legs = [c for c in calls if isinstance(c, dict) and c.get("leg") == "B"] if calls else []
    options = receipt.get("options")
    sizes = options.get("sizes") if isinstance(options, dict) else None
    at = receipt.get("at")
    return ProbeReach(
        cmax=_int(receipt.get("cmax")),
        whole=bool(legs) and all(c.get("verdict") == "resumed" for c in legs),
        at=at if isinstance(at, str) else "?",
        sizes=tuple(s for s in sizes if type(s) is int) if isinstance(sizes, list) else (),
    )


def _span(registry: Registry, sha: str, build_id: str) -> int | None:
    try:
        records = registry.measurements(sha)
    except CorruptRecordError:
        return None
    for m in reversed(records):  # newest first
        if m.build.build_id != build_id:
            continue
        span = _int(m.body.get("span_tokens"))
        if span is None:
            span = _int(m.body.get("prompt_tokens"))
        if span is not None:
            return span
    return None


def read_reach(registry: Registry, build_id: str) -> Reach:
    """The latest probe of `build_id` and every named prefix's span on it."""
    probe = None
    for _path, raw in registry.probe_receipts():  # newest first
        probe = _probe_reach(raw, build_id)
        if probe is not None:
            break
    prefixes = tuple(
        PrefixSpan(name, sha, _span(registry, sha, build_id))
        for name, sha in registry.names().items()
    )
    return Reach(probe, prefixes)
