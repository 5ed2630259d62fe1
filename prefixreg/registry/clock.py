"""The registry's clock and its two spellings of a moment (DESIGN §3).

Invariant: every record and file name takes its time from `utc_now`, so records agree on
the clock; `iso_utc` and `stamp_utc` round once to whole microseconds (never wrapping the
fraction without carrying into the seconds).
"""

from __future__ import annotations

import time

__all__ = ["iso_utc", "stamp_utc", "utc_now"]


def utc_now() -> float:
    """The current time as a Unix timestamp (one place, so records agree on the clock)."""
    return time.time()


def _split(moment: float) -> tuple[time.struct_time, int]:
    # Round once to whole microseconds, then split: rounding the fraction alone could give
    # 1,000,000 and wrap to 0 without carrying into the seconds.
    seconds, micros = divmod(round(moment * 1_000_000), 1_000_000)
    return time.gmtime(seconds), micros


def iso_utc(moment: float) -> str:
    """ISO 8601 UTC with microseconds: `2026-11-29T12:48:17.123456Z`."""
    when, micros = _split(moment)
    return time.strftime("%Y-%m-%dT%H:%M:%S", when) + f".{micros:06d}Z"


def stamp_utc(moment: float) -> str:
    """The file-name timestamp of DESIGN §3: UTC `%Y%m%dT%H%M%S.%fZ`."""
    when, micros = _split(moment)
    return time.strftime("%Y%m%dT%H%M%S", when) + f".{micros:06d}Z"
