"""`LoopStats`: what an agent loop's calls were served, from the server's own evidence. Pure.

A loop adds each call's `CallEvidence`; the accumulator counts resumed / cold / unverified
calls and sums prompt and cached tokens over the calls whose counts are verified. An
unverified call adds to `unverified` and to nothing else: a missing count is never zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import CallEvidence

__all__ = ["LoopStats"]


@dataclass(slots=True)
class LoopStats:
    """Running totals over a loop's calls."""

    calls: int = 0
    resumed: int = 0
    cold: int = 0
    unverified: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0

    def add(self, evidence: CallEvidence) -> CallEvidence:
        """Count one call; returns the evidence so a loop can write `stats.add(ev)` inline."""
        self.calls += 1
        if evidence.wall_s is not None:
            self.wall_s += evidence.wall_s
        if evidence.cache_state == "unverified":
            self.unverified += 1
            return evidence
        if evidence.cache_state == "reused":
            self.resumed += 1
        else:
            self.cold += 1
        self.prompt_tokens += evidence.prompt_tokens or 0
        self.cached_tokens += evidence.cached_tokens or 0
        self.completion_tokens += evidence.completion_tokens or 0
        return evidence

    @property
    def resumed_fraction(self) -> float | None:
        """Share of verified prompt tokens that came from the cache (None before any)."""
        return None if self.prompt_tokens == 0 else self.cached_tokens / self.prompt_tokens

    def to_dict(self) -> JSONObject:
        return {
            "calls": self.calls,
            "resumed": self.resumed,
            "cold": self.cold,
            "unverified": self.unverified,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "resumed_fraction": self.resumed_fraction,
            "wall_s": round(self.wall_s, 6),
        }

    def __str__(self) -> str:
        frac = self.resumed_fraction
        share = "-" if frac is None else f"{frac:.1%}"
        return (
            f"{self.calls} calls: {self.resumed} resumed, {self.cold} cold, "
            f"{self.unverified} unverified; {self.cached_tokens:,} of {self.prompt_tokens:,} "
            f"prompt tokens from the cache ({share})"
        )
