"""`audit`: token and time accounting over a batch of call outputs. Reads only; writes nothing.

The question it answers: is prompt caching even the lever for this batch? (Measured on one
night: decode was 73% of the time, prefill 27%.) So it reports how much of the prompt came
from the cache, the prefill and decode time the batch implies, which of the two dominates,
how closely that model closes to the measured wall time, and which registered prefix the
batch shares.

Inputs (`read_outputs`): JSON files holding one response or a list of them; JSON-lines
files (`.jsonl`, `.ndjson`), one response per line; directories, recursively (`*.json`,
`*.jsonl`, `*.ndjson`; symlinked directories are not followed). A response may sit inside
wrappers (`response`, `body`, nested as in OpenAI batch output), and a wrapper or the
response may carry a wall time (`wall_s`, `elapsed_s`, `duration_s`, `latency_s`).
prefixreg measurement records (envelope `sha256`, `kind`, `build`, `body.calls`) count
every call inside, with its recorded `wall_s`, its prefix sha and its server build.

Invariants:

- Counts come from the server only: responses go through `evidence_from_response`
  (DESIGN §4: strict integer counts, cold/reused/unverified), measurement calls through
  `CallEvidence.from_dict`. A missing count is never zero: a call without usage is
  counted as a call and as unverified, and adds nothing to any total; every total carries
  the number of calls it covers.
- Nothing read is fatal: a file or line that is not JSON, is not a call output, or is a
  corrupt measurement record is listed under `malformed` with a reason, and the run goes
  on. Unverified calls are listed with their reason.
- Per call, server `timings` win (`prompt_ms` -> prefill, `predicted_ms` -> decode);
  otherwise rates: prefill = (prompt - cached) / prefill_tps, decode = completion /
  decode_tps. Each figure records its source. Shares and totals are taken over the calls
  where both figures are known; closure = modelled / wall over the calls where the wall
  time is known too.
- A shared prefix is named from measurements (registry or records read) of the batch's own
  server build(s) (DESIGN §3 rule 3). When the batch carries no build (plain responses),
  every build is searched and the answer says the build it matched is not known to be the
  batch's. When every call comes from measurement records of one prefix, their sha names
  it directly.
- Nothing here keeps output text: only counts, times, paths and shas.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

import orjson

from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.records import CallEvidence, Measurement, strict_count
from prefixreg.server.evidence import evidence_from_response

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry

__all__ = [
    "DEFAULT_DECODE_TPS",
    "DEFAULT_PREFILL_TPS",
    "JSONL_SUFFIXES",
    "JSON_SUFFIXES",
    "WALL_KEYS",
    "AuditCall",
    "AuditInput",
    "AuditReport",
    "CallTime",
    "Malformed",
    "PrefixMatch",
    "PrefixSpan",
    "TokenStat",
    "audit_calls",
    "call_time",
    "match_prefix",
    "prefix_spans",
    "read_outputs",
    "run_audit",
    "span_tolerance",
]

# The measured Halogen Flash lane (the simulator's defaults model the same lane).
DEFAULT_PREFILL_TPS: Final = 1180.0
DEFAULT_DECODE_TPS: Final = 60.0
WALL_KEYS: Final = ("wall_s", "elapsed_s", "duration_s", "latency_s")
WRAPPER_KEYS: Final = ("response", "body")
JSON_SUFFIXES: Final = (".json",)
JSONL_SUFFIXES: Final = (".jsonl", ".ndjson")
# Tolerance of the prefix match: the batch's mean cached count against a measured span.
MATCH_MIN_TOKENS: Final = 64
MATCH_FRACTION: Final = 0.02
_MAX_WRAP_DEPTH: Final = 4

Source = Literal["timings", "rates"]
Dominant = Literal["prefill", "decode", "even"]


# --------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True, slots=True)
class Malformed:
    """Something read that is not a call: where (`path`, `path:line`, `path[i]`) and why."""

    source: str
    reason: str

    def to_dict(self) -> JSONObject:
        return {"source": self.source, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class AuditCall:
    """One call read: its evidence, and the prefix and build when a record named them."""

    source: str
    evidence: CallEvidence
    sha256: str | None = None
    build_id: str | None = None

    @property
    def wall_s(self) -> float | None:
        return self.evidence.wall_s


@dataclass(slots=True)
class AuditInput:
    """Everything `read_outputs` found: calls, what was not a call, records and files read."""

    calls: list[AuditCall] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    files: int = 0


def _wall(obj: Mapping[str, object]) -> float | None:
    for key in WALL_KEYS:
        value = obj.get(key)
        # bool is an int subclass: `"wall_s": true` is not a duration.
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
            if math.isfinite(number) and number >= 0:
                return number
    return None


def _looks_like_response(obj: Mapping[str, object]) -> bool:
    """A chat/completions reply (or an error reply in its place), not a wrapper around one."""
    if any(key in obj for key in ("choices", "usage", "timings")):
        return True
    kind = obj.get("object")
    if isinstance(kind, str) and kind.startswith(("chat.completion", "text_completion")):
        return True
    return obj.get("error") is not None and not any(
        isinstance(obj.get(key), dict) for key in WRAPPER_KEYS
    )


def _looks_like_measurement(obj: Mapping[str, object]) -> bool:
    body = obj.get("body")
    return (
        all(key in obj for key in ("sha256", "kind", "build"))
        and isinstance(body, dict)
        and "calls" in body
    )


def _alignment_of(record: Measurement) -> int:
    """The server's snapshot alignment, from the record's body or its build identity."""
    value = strict_count(record.body.get("alignment"))
    return record.build.snapshot_align if value is None else value


class _Reader:
    """Accumulates calls and problems while walking the inputs."""

    def __init__(self) -> None:
        self.out = AuditInput()

    def bad(self, source: str, reason: str) -> None:
        self.out.malformed.append(Malformed(source, reason))

    def take(self, value: object, source: str, *, top: bool = True) -> None:
        """One decoded JSON document: a response (maybe wrapped), a record, or a list."""
        if isinstance(value, list):
            if not top:
                self.bad(source, "a list inside a list is not a call output")
                return
            if not value:
                self.bad(source, "an empty list")
            for i, item in enumerate(value):
                self.take(item, f"{source}[{i}]", top=False)
            return
        if not isinstance(value, dict):
            self.bad(source, "not a JSON object or a list of them")
            return
        if _looks_like_measurement(value):
            self.take_measurement(value, source)
            return
        wall: float | None = None
        obj: dict[str, object] = value
        for _ in range(_MAX_WRAP_DEPTH):
            if wall is None:
                wall = _wall(obj)  # the outermost wall time wins: it timed the whole call
            if _looks_like_response(obj):
                break
            inner = next(
                (obj[k] for k in WRAPPER_KEYS if isinstance(obj.get(k), dict)),
                None,
            )
            if not isinstance(inner, dict):
                self.bad(source, "not a call output (no choices, usage or error)")
                return
            obj = inner
        else:
            self.bad(source, "not a call output (wrapped too deep)")
            return
        self.out.calls.append(AuditCall(source, evidence_from_response(obj, wall_s=wall)))

    def take_measurement(self, value: Mapping[str, object], source: str) -> None:
        try:
            record = Measurement.from_dict(dict(value))
        except CorruptRecordError as exc:
            self.bad(source, f"corrupt measurement record: {exc}")
            return
        self.out.measurements.append(record)
        calls = record.body.get("calls")
        if not isinstance(calls, list):
            self.bad(source, "measurement record: body.calls is not a list")
            return
        for i, call in enumerate(calls):
            where = f"{source}#calls[{i}]"
            raw = call.get("evidence") if isinstance(call, dict) else None
            try:
                evidence = CallEvidence.from_dict(raw)
            except CorruptRecordError as exc:
                self.bad(where, f"corrupt call evidence: {exc}")
                continue
            self.out.calls.append(AuditCall(where, evidence, record.sha256, record.build.build_id))

    def read_file(self, path: Path) -> None:
        source = str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            self.bad(source, f"cannot read: {exc.strerror or exc}")
            return
        self.out.files += 1
        if path.suffix.lower() in JSONL_SUFFIXES:
            self.read_lines(data, source)
            return
        try:
            value: object = orjson.loads(data)
        except orjson.JSONDecodeError:
            # A .json file that is really JSON lines: read it as such if every line parses.
            lines = [line for line in data.splitlines() if line.strip()]
            if len(lines) > 1 and all(_parses(line) for line in lines):
                self.read_lines(data, source)
            else:
                self.bad(source, "not valid JSON")
            return
        self.take(value, source)

    def read_lines(self, data: bytes, source: str) -> None:
        seen = False
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            seen = True
            where = f"{source}:{lineno}"
            try:
                value: object = orjson.loads(line)
            except orjson.JSONDecodeError:
                self.bad(where, "not valid JSON")
                continue
            self.take(value, where)
        if not seen:
            self.bad(source, "empty file")


def _parses(line: bytes) -> bool:
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return True


def _walk(directory: Path) -> Iterator[Path]:
    """Call-output files under `directory`, sorted, without following symlinked directories
    (a link back up the tree would otherwise never end)."""
    suffixes = JSON_SUFFIXES + JSONL_SUFFIXES
    for root, dirs, files in os.walk(directory, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            if name.lower().endswith(suffixes):
                yield Path(root) / name


def read_outputs(paths: Iterable[Path | str]) -> AuditInput:
    """Read every call output under `paths` (files or directories). Never raises for bad
    input: missing paths, unreadable files and non-calls are listed in `malformed`."""
    reader = _Reader()
    for item in paths:
        path = Path(item)
        if path.is_dir():
            before = len(reader.out.calls) + len(reader.out.malformed)
            for file in _walk(path):
                reader.read_file(file)
            if len(reader.out.calls) + len(reader.out.malformed) == before:
                reader.bad(str(path), "no .json or .jsonl files in this directory")
        elif path.exists():
            reader.read_file(path)
        else:
            reader.bad(str(path), "no such file or directory")
    return reader.out


# --------------------------------------------------------------------------------------
# Time model


@dataclass(frozen=True, slots=True)
class CallTime:
    """Prefill and decode seconds of one call and where each figure came from."""

    prefill_s: float | None
    prefill_source: Source | None
    decode_s: float | None
    decode_source: Source | None

    @property
    def modelled(self) -> bool:
        return self.prefill_s is not None and self.decode_s is not None


def call_time(ev: CallEvidence, *, prefill_tps: float, decode_tps: float) -> CallTime:
    """Server timings win; otherwise counts / rates. Prefill by rate needs valid prompt and
    cached counts with cached <= prompt (a missing cached count is not taken as zero)."""
    prefill: float | None = None
    prefill_src: Source | None = None
    if ev.prompt_ms is not None:
        prefill, prefill_src = ev.prompt_ms / 1000.0, "timings"
    elif (
        ev.prompt_tokens is not None
        and ev.cached_tokens is not None
        and ev.cached_tokens <= ev.prompt_tokens
    ):
        prefill, prefill_src = (ev.prompt_tokens - ev.cached_tokens) / prefill_tps, "rates"
    decode: float | None = None
    decode_src: Source | None = None
    if ev.predicted_ms is not None:
        decode, decode_src = ev.predicted_ms / 1000.0, "timings"
    elif ev.completion_tokens is not None:
        decode, decode_src = ev.completion_tokens / decode_tps, "rates"
    return CallTime(prefill, prefill_src, decode, decode_src)


# --------------------------------------------------------------------------------------
# Prefix spans and the match


@dataclass(frozen=True, slots=True)
class PrefixSpan:
    """A prefix's measured token span on one build: the latest resumed warm or probe leg."""

    sha256: str
    build_id: str
    span_tokens: int
    alignment: int
    at: str
    kind: str


def prefix_spans(measurements: Iterable[Measurement]) -> list[PrefixSpan]:
    """The latest resumed span per (prefix, build), from warm records and probe legs.

    Only measurements whose verdict is `resumed` count: a partial or cold check did not
    measure the prefix's span, it measured a miss.
    """
    latest: dict[tuple[str, str], PrefixSpan] = {}
    for m in measurements:
        span = strict_count(m.body.get("span_tokens"))
        if m.body.get("verdict") != "resumed" or not span:
            continue
        key = (m.sha256, m.build.build_id)
        entry = PrefixSpan(m.sha256, m.build.build_id, span, _alignment_of(m), m.at, m.kind)
        if key not in latest or latest[key].at <= m.at:
            latest[key] = entry
    return sorted(latest.values(), key=lambda s: (s.sha256, s.build_id))


def span_tolerance(span: PrefixSpan) -> int:
    """How far a mean cached count may sit from a span and still match it: the larger of
    64 tokens, 2% of the span, and the server's alignment (aligned engines round down)."""
    return max(MATCH_MIN_TOKENS, math.ceil(span.span_tokens * MATCH_FRACTION), span.alignment)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The prefix a batch shares, and how that was decided."""

    sha256: str
    names: tuple[str, ...]
    method: Literal["records", "mean_cached"]
    build_id: str | None
    build_known: bool
    span_tokens: int | None
    mean_cached: float | None
    difference: float | None
    tolerance: int | None
    registered: bool | None

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.sha256,
            "names": list(self.names),
            "method": self.method,
            "build_id": self.build_id,
            "build_known": self.build_known,
            "span_tokens": self.span_tokens,
            "mean_cached": self.mean_cached,
            "difference": self.difference,
            "tolerance": self.tolerance,
            "registered": self.registered,
        }

    def label(self) -> str:
        name = ", ".join(self.names)
        return f"{name} ({self.sha256[:12]})" if name else self.sha256


def match_prefix(
    calls: Sequence[AuditCall],
    spans: Sequence[PrefixSpan],
    *,
    names: Mapping[str, Sequence[str]] | None = None,
    registered: set[str] | None = None,
) -> PrefixMatch | None:
    """Which prefix the batch shares, or None.

    - every call came from measurement records of one prefix: that sha, directly;
    - otherwise the mean cached count of the reused calls against the spans measured on the
      builds the batch's records name (every build when none does), closest within
      `span_tolerance`. `names` maps sha -> names; `registered` is the registry's shas
      (None: no registry to ask).
    """
    names = names or {}

    def is_registered(sha: str) -> bool | None:
        return None if registered is None else sha in registered

    builds = {c.build_id for c in calls if c.build_id is not None}
    reused = [
        c.evidence.cached_tokens
        for c in calls
        if c.evidence.cache_state == "reused" and c.evidence.cached_tokens is not None
    ]
    mean = sum(reused) / len(reused) if reused else None
    shas = {c.sha256 for c in calls}
    sha = next(iter(shas)) if len(shas) == 1 else None
    if sha is not None:
        own = [s for s in spans if s.sha256 == sha and s.build_id in builds]
        span = max(own, key=lambda s: s.at) if own else None
        return PrefixMatch(
            sha256=sha,
            names=tuple(names.get(sha, ())),
            method="records",
            build_id=span.build_id if span else (next(iter(builds)) if len(builds) == 1 else None),
            build_known=True,
            span_tokens=span.span_tokens if span else None,
            mean_cached=mean,
            difference=None if span is None or mean is None else abs(mean - span.span_tokens),
            tolerance=span_tolerance(span) if span else None,
            registered=is_registered(sha),
        )
    if mean is None:
        return None
    # Newest first, so that `min` (which keeps the first of equals) prefers it on a tie.
    candidates = sorted(
        (s for s in spans if not builds or s.build_id in builds),
        key=lambda s: s.at,
        reverse=True,
    )
    within = [s for s in candidates if abs(mean - s.span_tokens) <= span_tolerance(s)]
    if not within:
        return None
    s = min(within, key=lambda s: abs(mean - s.span_tokens))
    return PrefixMatch(
        sha256=s.sha256,
        names=tuple(names.get(s.sha256, ())),
        method="mean_cached",
        build_id=s.build_id,
        build_known=bool(builds),
        span_tokens=s.span_tokens,
        mean_cached=mean,
        difference=abs(mean - s.span_tokens),
        tolerance=span_tolerance(s),
        registered=is_registered(s.sha256),
    )


# --------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True, slots=True)
class TokenStat:
    """A total over the calls that reported the count, and how many did."""

    total: int
    calls: int

    @property
    def mean(self) -> float | None:
        return self.total / self.calls if self.calls else None

    def to_dict(self) -> JSONObject:
        return {"total": self.total, "mean": self.mean, "calls": self.calls}


def _stat(values: Sequence[int]) -> TokenStat:
    return TokenStat(sum(values), len(values))


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The accounting of one batch. `to_dict` is the `--json` form; `to_text` the table."""

    calls: tuple[AuditCall, ...]
    times: tuple[CallTime, ...]
    malformed: tuple[Malformed, ...]
    files: int
    prefill_tps: float
    decode_tps: float
    rates_given: bool
    prefix: PrefixMatch | None

    # -- counts ---------------------------------------------------------------------------

    def states(self) -> dict[str, int]:
        out = {"cold": 0, "reused": 0, "unverified": 0}
        for c in self.calls:
            out[c.evidence.cache_state] += 1
        return out

    def tokens(self) -> dict[str, TokenStat]:
        """Totals and means, each over the calls that reported that count. Cached counts come
        only from verified (cold or reused) calls: elsewhere they are not evidence."""
        evs = [c.evidence for c in self.calls]
        verified = [e for e in evs if e.cache_state != "unverified"]
        return {
            "prompt": _stat([e.prompt_tokens for e in evs if e.prompt_tokens is not None]),
            "cached": _stat([e.cached_tokens for e in verified if e.cached_tokens is not None]),
            "cached_when_reused": _stat(
                [e.cached_tokens for e in verified if e.cached_tokens and e.cached_tokens > 0]
            ),
            "completion": _stat(
                [e.completion_tokens for e in evs if e.completion_tokens is not None]
            ),
        }

    def cached_share(self) -> float | None:
        """Cached / prompt tokens over the verified calls (both counts are known there)."""
        pairs = [
            (c.evidence.cached_tokens, c.evidence.prompt_tokens)
            for c in self.calls
            if c.evidence.cache_state != "unverified"
        ]
        cached = sum(a or 0 for a, _ in pairs)
        prompt = sum(b or 0 for _, b in pairs)
        return _share(cached, prompt)

    # -- time -----------------------------------------------------------------------------

    def _modelled(self) -> list[tuple[AuditCall, CallTime]]:
        return [(c, t) for c, t in zip(self.calls, self.times, strict=True) if t.modelled]

    def prefill_s(self) -> float:
        return sum(t.prefill_s or 0.0 for _, t in self._modelled())

    def decode_s(self) -> float:
        return sum(t.decode_s or 0.0 for _, t in self._modelled())

    def prefill_share(self) -> float | None:
        return _share(self.prefill_s(), self.prefill_s() + self.decode_s())

    def dominant(self) -> Dominant | None:
        """Which share of the modelled time is larger (None: nothing could be modelled)."""
        share = self.prefill_share()
        if share is None:
            return None
        if math.isclose(share, 0.5, abs_tol=1e-9):
            return "even"
        return "prefill" if share > 0.5 else "decode"

    def wall(self) -> tuple[float, int]:
        walls = [c.wall_s for c in self.calls if c.wall_s is not None]
        return sum(walls), len(walls)

    def closure(self) -> tuple[float | None, int]:
        """(modelled / wall, calls) over the calls with both a model and a wall time."""
        both = [(c, t) for c, t in self._modelled() if c.wall_s is not None]
        wall = sum(c.wall_s or 0.0 for c, _ in both)
        model = sum((t.prefill_s or 0.0) + (t.decode_s or 0.0) for _, t in both)
        return _share(model, wall), len(both)

    def sources(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {
            "prefill": {"timings": 0, "rates": 0, "unknown": 0},
            "decode": {"timings": 0, "rates": 0, "unknown": 0},
        }
        for t in self.times:
            out["prefill"][t.prefill_source or "unknown"] += 1
            out["decode"][t.decode_source or "unknown"] += 1
        return out

    def unverified(self) -> list[Malformed]:
        """The calls that count as unverified, with the reason their evidence gives."""
        return [
            Malformed(c.source, c.evidence.reason or c.evidence.error or "unverified")
            for c in self.calls
            if c.evidence.cache_state == "unverified"
        ]

    def summary(self) -> str:
        """One sentence: which share dominates, and whether caching is the lever."""
        dominant, share = self.dominant(), self.prefill_share()
        if dominant is None or share is None:
            return "no call reported the counts or timings needed to model its time"
        if dominant == "prefill":
            return (
                f"prefill dominates: {round(share * 100)}% of modelled time; "
                "prompt caching is the lever"
            )
        if dominant == "decode":
            return (
                f"decode dominates: {round((1 - share) * 100)}% of modelled time; "
                "prompt caching is not the lever for this batch"
            )
        return "prefill and decode are even: 50% of modelled time each"

    def to_dict(self) -> JSONObject:
        wall, wall_n = self.wall()
        closure, closure_n = self.closure()
        share = self.prefill_share()
        modelled = self._modelled()
        tokens: dict[str, JSONValue] = {k: v.to_dict() for k, v in self.tokens().items()}
        sources: dict[str, JSONValue] = {k: dict(v) for k, v in self.sources().items()}
        return {
            "files": self.files,
            "calls": len(self.calls),
            "calls_with_cached_tokens": self.states()["reused"],
            "states": dict(self.states()),
            "tokens": tokens,
            "cached_share": self.cached_share(),
            "time": {
                "wall_s": wall if wall_n else None,
                "wall_calls": wall_n,
                "modelled_calls": len(modelled),
                "prefill_s": self.prefill_s() if modelled else None,
                "decode_s": self.decode_s() if modelled else None,
                "prefill_share": share,
                "decode_share": None if share is None else 1 - share,
                "dominant": self.dominant(),
                "closure": closure,
                "closure_calls": closure_n,
                "sources": sources,
                "rates": {
                    "prefill_tps": self.prefill_tps,
                    "decode_tps": self.decode_tps,
                    "given": self.rates_given,
                },
            },
            "summary": self.summary(),
            "shared_prefix": None if self.prefix is None else self.prefix.to_dict(),
            "unverified": [u.to_dict() for u in self.unverified()],
            "malformed": [m.to_dict() for m in self.malformed],
        }

    def to_text(self, *, limit: int = 10) -> str:
        """The report for a person: a short table, the verdict sentence, then what was skipped."""
        st = self.states()
        tok = self.tokens()
        lines = [
            f"calls          {len(self.calls):,} from {self.files:,} files "
            f"(reused {st['reused']:,}, cold {st['cold']:,}, unverified {st['unverified']:,})",
            f"{'tokens':<14} {'total':>14} {'mean':>12} {'calls':>8}",
        ]
        for label, key in (
            ("prompt", "prompt"),
            ("cached", "cached"),
            ("  if reused", "cached_when_reused"),
            ("completion", "completion"),
        ):
            row = tok[key]
            shown = "-" if row.mean is None else f"{row.mean:,.1f}"
            lines.append(f"  {label:<12} {row.total:>14,} {shown:>12} {row.calls:>8,}")
        share = self.cached_share()
        if share is not None:
            lines.append(f"cached share   {share:.1%} of prompt tokens (verified calls)")
        wall, wall_n = self.wall()
        lines.append(
            f"wall time      {_secs(wall)} over {wall_n:,} calls" if wall_n else "wall time      -"
        )
        modelled = self._modelled()
        psh = self.prefill_share()
        if modelled and psh is not None:
            lines.append(
                f"modelled       prefill {_secs(self.prefill_s())} ({psh:.0%}), "
                f"decode {_secs(self.decode_s())} ({1 - psh:.0%}) over {len(modelled):,} calls"
            )
            closure, closure_n = self.closure()
            if closure is not None:
                lines.append(
                    f"closure        modelled time is {closure:.0%} of measured wall time "
                    f"({closure_n:,} calls)"
                )
        src = self.sources()
        lines.append(
            "sources        prefill: "
            + _sources_text(src["prefill"], f"{self.prefill_tps:,.0f} tok/s")
            + "; decode: "
            + _sources_text(src["decode"], f"{self.decode_tps:,.0f} tok/s")
            + ("" if self.rates_given else " (default rates: the measured Halogen Flash lane)")
        )
        lines.append(f"shared prefix  {self._prefix_text()}")
        lines.append(self.summary())
        for title, items in (("unverified", self.unverified()), ("malformed", self.malformed)):
            if items:
                lines.append(f"{title} ({len(items):,}):")
                lines.extend(f"  {m.source}: {m.reason}" for m in items[:limit])
                if len(items) > limit:
                    lines.append(f"  ... and {len(items) - limit:,} more (see --json)")
        return "\n".join(lines) + "\n"

    def _prefix_text(self) -> str:
        p = self.prefix
        if p is None:
            return (
                "none matched (no resumed span measured on the batch's build lies near its "
                "mean cached count)"
            )
        if p.method == "records":
            return f"{p.label()} (named by the measurement records read)"
        where = f"build {p.build_id}" + ("" if p.build_known else ", the batch's build unknown")
        return (
            f"{p.label()}: mean cached {p.mean_cached or 0:,.0f} vs measured span "
            f"{p.span_tokens or 0:,} on {where} (within {p.tolerance or 0:,})"
        )


def _secs(value: float) -> str:
    """Seconds for a person: three significant digits under 100 s (a fast simulator's
    milliseconds must not print as 0.00), grouped whole seconds above."""
    return f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"


def _sources_text(counts: Mapping[str, int], rate: str) -> str:
    parts = []
    if counts["timings"]:
        parts.append(f"{counts['timings']:,} by server timings")
    if counts["rates"]:
        parts.append(f"{counts['rates']:,} by rate ({rate})")
    if counts["unknown"]:
        parts.append(f"{counts['unknown']:,} unknown")
    return ", ".join(parts) or "-"


def audit_calls(
    data: AuditInput,
    *,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    spans: Sequence[PrefixSpan] = (),
    names: Mapping[str, Sequence[str]] | None = None,
    registered: set[str] | None = None,
) -> AuditReport:
    """Account for the calls read. Pure. Rates default to the measured Flash lane.

    Spans from the records read are added to `spans`, so a directory that carries its
    warm records names its prefix without a registry.
    """
    _check_rates(prefill_tps, decode_tps)
    p_tps = prefill_tps if prefill_tps is not None else DEFAULT_PREFILL_TPS
    d_tps = decode_tps if decode_tps is not None else DEFAULT_DECODE_TPS
    times = tuple(call_time(c.evidence, prefill_tps=p_tps, decode_tps=d_tps) for c in data.calls)
    all_spans = _merge_spans(spans, prefix_spans(data.measurements))
    return AuditReport(
        calls=tuple(data.calls),
        times=times,
        malformed=tuple(data.malformed),
        files=data.files,
        prefill_tps=p_tps,
        decode_tps=d_tps,
        rates_given=prefill_tps is not None or decode_tps is not None,
        prefix=match_prefix(data.calls, all_spans, names=names, registered=registered),
    )


def _merge_spans(given: Sequence[PrefixSpan], read: Sequence[PrefixSpan]) -> list[PrefixSpan]:
    """The latest span per (prefix, build) across both sources."""
    latest: dict[tuple[str, str], PrefixSpan] = {}
    for s in [*given, *read]:
        key = (s.sha256, s.build_id)
        if key not in latest or latest[key].at <= s.at:
            latest[key] = s
    return sorted(latest.values(), key=lambda s: (s.sha256, s.build_id))


def _check_rates(prefill_tps: float | None, decode_tps: float | None) -> None:
    for rate, what in ((prefill_tps, "prefill"), (decode_tps, "decode")):
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise UsageError(f"--{what}-tps must be a positive number of tokens per second")


def run_audit(
    paths: Iterable[Path | str],
    *,
    registry: Registry | None = None,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
) -> AuditReport:
    """Read `paths` and account for them; `registry` (when it exists) supplies measured
    spans, names, and which shas are registered.

    Raises:
        UsageError: a rate is not a positive number.
        CorruptRecordError: a registry measurement record does not parse (fail closed).
    """
    _check_rates(prefill_tps, decode_tps)
    data = read_outputs(paths)
    spans: list[PrefixSpan] = []
    names: dict[str, list[str]] = {}
    registered: set[str] | None = None
    if registry is not None and registry.exists:
        spans = prefix_spans(registry.measurements())
        registered = set()
        for info in registry.list_objects():
            registered.add(info.sha256)
            if info.names:
                names[info.sha256] = list(info.names)
    return audit_calls(
        data,
        prefill_tps=prefill_tps,
        decode_tps=decode_tps,
        spans=spans,
        names=names,
        registered=registered,
    )
