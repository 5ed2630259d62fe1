"""What a running probe tells a person: its plan before the first call, a line for each leg
once it answered, and after the first cold leg an estimate of the rest. Pure: the lines are
made here, the caller prints them (the CLI on a terminal's stderr).

Before the first call the plan says what its cold prefills would take on the measured lane
(`LANE_CHARS_PER_S`, said as the lane's). The estimate prices every cold prefill the plan
holds (each size's A1 and, after foreign prompts, its C leg; the foreign prompts themselves) at
the first cold leg's rate (its prompt tokens over the server's `prompt_ms`, else its wall time)
and characters per token; resumed legs, the survival search and a bisection are not priced,
and it says so. Nothing here is a verdict: a leg's state is the judge's, quoted.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixreg.verbs.probe.checks import ProbeCall
from prefixreg.verbs.probe.options import ProbeOptions

# Runs shorter than this many seconds are not worth an estimate line.
ESTIMATE_FROM_S = 10.0
# The measured Halogen Flash lane's cold prefill: 64,000 characters of the probe corpus in
# 33.26 s. Before any call, the only rate there is; said as the lane's, never this server's.
LANE_CHARS_PER_S = 64_000 / 33.26


def duration(seconds: float) -> str:
    """`2 min 12 s`, `45 s`, `1 h 3 min`."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def planned_calls(options: ProbeOptions) -> int:
    """The calls the sizes' legs make (survival and bisection come on top)."""
    return 3 * len(options.sizes) + (options.foreign + 1) * len(options.c_sizes)


def cold_chars(options: ProbeOptions) -> int:
    """Characters the plan prefills cold: each size's A1 and C leg, the foreign prompts."""
    chars = sum(options.sizes) + sum(options.c_sizes)
    return chars + options.foreign * len(options.c_sizes) * options.foreign_chars


def plan(options: ProbeOptions) -> str:
    """The plan, and when it is long, what its cold prefills would take on the measured lane
    (the only rate known before the first call; the first cold leg then times this server)."""
    sizes = options.sizes
    span = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,} to {sizes[-1]:,}"
    more = " plus a survival search" if options.survival else ""
    more += " and a bisection of Cmax" if options.bisect else ""
    n = f"{len(sizes)} size{'s' if len(sizes) > 1 else ''}"
    line = f"probe: {n} ({span} characters), {planned_calls(options)} calls{more}"
    lane = cold_chars(options) / LANE_CHARS_PER_S
    if lane >= ESTIMATE_FROM_S:
        line += (
            f"; its cold prefills take about {duration(lane)} on the measured Halogen Flash "
            f"lane ({LANE_CHARS_PER_S:,.0f} characters a second), this server's rate follows "
            "its first cold leg"
        )
    return line + "; a line per leg as it answers"


def leg_line(call: ProbeCall) -> str:
    ev = call.record.evidence
    size = f" {call.size:,} chars" if call.size else ""
    counts = "no counts"
    if ev.prompt_tokens is not None:
        counts = f"{ev.prompt_tokens:,} prompt"
        counts += "" if ev.cached_tokens is None else f", {ev.cached_tokens:,} cached"
    wall = "" if ev.wall_s is None else f" in {ev.wall_s:.2f} s"
    return f"  {call.leg}{size}: {counts}, {call.verdict or ev.cache_state}{wall}"


@dataclass(frozen=True, slots=True)
class Rate:
    """What the first cold leg measured: tokens per second and characters per token."""

    tokens_per_s: float
    chars_per_token: float


def first_rate(call: ProbeCall) -> Rate | None:
    """The rate of a cold leg with a size, counts and a time; None otherwise."""
    ev = call.record.evidence
    seconds = ev.prompt_ms / 1000 if ev.prompt_ms else ev.wall_s
    if not call.size or not ev.prompt_tokens or not seconds or seconds <= 0:
        return None
    return Rate(ev.prompt_tokens / seconds, call.size / ev.prompt_tokens)


def estimate(options: ProbeOptions, rate: Rate, done: int) -> tuple[float, str]:
    """(seconds, the line) for the cold prefills still ahead of a plan `done` calls into."""
    chars = cold_chars(options) - options.sizes[0]  # the first A1, already measured
    seconds = chars / rate.chars_per_token / rate.tokens_per_s
    left = max(planned_calls(options) - done, 0)
    extra = (
        " (the survival search and the bisection not counted)"
        if (options.survival or options.bisect)
        else ""
    )
    return seconds, (
        f"estimate: about {duration(seconds)} for the other {left:,} calls, at the first cold "
        f"leg's {rate.tokens_per_s:,.0f} tokens/s and {rate.chars_per_token:.2f} characters a "
        f"token{extra}"
    )
