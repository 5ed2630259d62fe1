"""The audit's time model: prefill and decode seconds of one call, and where each came from.

Invariants: server `timings` win (`prompt_ms` -> prefill, `predicted_ms` -> decode);
otherwise rates: prefill = (prompt - cached) / prefill_tps, decode = completion / decode_tps.
A missing count is never taken as zero: without it the figure is unknown (None). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.records import CallEvidence

__all__ = ["DEFAULT_DECODE_TPS", "DEFAULT_PREFILL_TPS", "CallTime", "Source", "call_time"]

# The measured Halogen Flash lane (the simulator's defaults model the same lane).
DEFAULT_PREFILL_TPS: Final = 1180.0
DEFAULT_DECODE_TPS: Final = 60.0

Source = Literal["timings", "rates"]


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
