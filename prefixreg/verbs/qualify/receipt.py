"""`qualify`'s receipt: an allowlist, fit to publish. Pure.

It holds only the fixture's hash, counters, timings, phases, settings, the judge's words
and the build's profile and id (a hash): never the endpoint, the model alias, a file path,
the raw prompt or output, or an exception's text (a failed request names its class). Each
row's keys are listed in `ROW_KEYS`; a row is built from those keys alone, so a field added
to the evidence stays out until it is listed. The receipt says what it is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from prefixreg.core.jsonio import dumps_pretty
from prefixreg.core.qualification import Assertions, Comparison
from prefixreg.core.records import CallEvidence, ServerBuild
from prefixreg.verbs.measure.calls import CallRecord
from prefixreg.verbs.qualify.prompts import QualifyPrompt

SCHEMA: Final = "prefixreg.qualify/1"
WHAT: Final = (
    "Cache evidence from one run of identical requests on one server build: a first request, "
    "repeats in sequence, a concurrent group, each judged by the strict evidence rules."
)
# How the figures that are not the server's counts were taken (all seconds by this client).
FIGURES: Final = {
    "ttft_s": "send to the first text piece (content or reasoning); complete replies only",
    "wall_s": "send to the end of the reply",
    "decode_tps": "(completion_tokens - 1) / (wall_s - ttft_s); complete replies with 2+ tokens",
}
NOT: Final = (
    "not a model certification (it says nothing of the answers' quality)",
    "not a RAM sizing (one prompt's reuse says nothing of how many fit)",
)
ROW_KEYS: Final = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cached_source",
    "cache_state",
    "reason",
    "complete",
    "token_sha",
    "output_sha256",
    "ttft_s",
    "wall_s",
    "error",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """A run's settings (checked by `qualify`)."""

    tokens: int
    repeats: int
    streams: int
    seed: int
    assertions: Assertions

    def to_dict(self) -> dict[str, Any]:
        a = self.assertions
        return {
            "requested_reply_tokens": self.tokens,
            "temperature": 0,
            "seed": self.seed,
            "repeats": self.repeats,
            "streams": self.streams,
            "require_cold": a.require_cold,
            "require_reuse": a.require_reuse,
            "expected_prompt_tokens": a.expected_prompt_tokens,
        }


@dataclass(frozen=True, slots=True)
class QualifyRow:
    """One request: its phase and place in the request order, its evidence, the `/cache`
    record around it (Halogen, sequential phases), the comparisons with the first request
    (None for the first) and its decode rate."""

    phase: str
    index: int
    evidence: CallEvidence
    record: CallRecord | None
    tokens_vs_first: Comparison | None
    output_vs_first: Comparison | None
    decode_tps: float | None

    def to_dict(self) -> dict[str, Any]:
        ev = self.evidence.to_dict()
        out: dict[str, Any] = {"phase": self.phase, "request": self.index + 1}
        out |= {key: ev.get(key) for key in ROW_KEYS}
        out["decode_tps"] = self.decode_tps
        if self.index:
            out |= {
                "tokens_vs_first": self.tokens_vs_first,
                "output_vs_first": self.output_vs_first,
            }
        record = self.record.to_dict() if self.record is not None else {}
        if record.get("cache_deltas") is not None:  # counts only, and whether others interleaved
            out |= {"cache_deltas": record["cache_deltas"], "interleaved": record["interleaved"]}
        if record.get("counter_window") is not None:
            out["counter_window"] = record["counter_window"]
        return out


def rows_for(
    rows: Sequence[QualifyRow],
    *,
    settings: Settings,
    prompt: QualifyPrompt,
    build: ServerBuild | None,
    qualified: bool,
    failures: Sequence[str],
    error: str | None,
) -> dict[str, Any]:
    """The receipt of a run (module docstring)."""
    listed = [r.to_dict() for r in rows]
    comparisons = [r for r in listed if r["request"] > 1]
    return {
        "schema": SCHEMA,
        "what": WHAT,
        "not": list(NOT),
        "figures": dict(FIGURES),
        "qualified": qualified,
        "failures": list(failures),
        "error": error,
        "fixture_sha256": prompt.fixture_sha256,
        "prompt": {"kind": prompt.kind, "source": prompt.source},
        "settings": settings.to_dict(),
        "server": None if build is None else {"profile": build.profile, "build_id": build.build_id},
        "counts": {
            "requests": len(listed),
            "complete": sum(1 for r in listed if r["complete"]),
            **{
                f"{what}_{outcome}": sum(1 for r in comparisons if r[f"{what}_vs_first"] == outcome)
                for what in ("tokens", "output")
                for outcome in ("pass", "differ", "unverified")
            },
        },
        "rows": listed,
    }


def render(receipt: dict[str, Any]) -> bytes:
    """The receipt file's bytes (sorted keys, indented)."""
    return dumps_pretty(receipt)


def _n(value: object) -> str:
    return "-" if not isinstance(value, int) else f"{value:,}"


def summary_lines(receipt: dict[str, Any]) -> list[str]:
    """The receipt for a person: one line a request, then the decision and its reasons."""
    server = receipt["server"] or {}
    lines = [
        f"server   {server.get('profile', '?')} build {server.get('build_id', '?')}; "
        f"fixture {receipt['fixture_sha256'][:16]} ({receipt['prompt']['kind']})"
    ]
    for row in receipt["rows"]:
        state = row["cache_state"] + (f" ({row['reason']})" if row["reason"] else "")
        counts = f"prompt {_n(row['prompt_tokens'])}, cached {_n(row['cached_tokens'])}"
        counts += f", completion {_n(row['completion_tokens'])}"
        same = ""
        if row["request"] > 1:
            same = f"; tokens {row['tokens_vs_first']}, output {row['output_vs_first']}"
        ttft = "" if row["ttft_s"] is None else f", ttft {row['ttft_s']:.3f} s"
        rate = "" if row["decode_tps"] is None else f", {row['decode_tps']:.1f} tok/s"
        lines.append(f"{row['request']:>3} {row['phase']:<10} {counts}: {state}{same}{ttft}{rate}")
    verdict = "QUALIFIED" if receipt["qualified"] else "NOT QUALIFIED"
    lines.append(f"verdict  {verdict}")
    lines += [f"  - {why}" for why in receipt["failures"]]
    lines.append("  (" + "; ".join(receipt["not"]) + ")")
    return lines
