"""The probe's sizes: parsing `--sizes`, the context check, and which sizes run leg C.

Invariants: a size is refused (usage error, exit 2) before any text is made when it is absurd
(over `MAX_SIZE_CHARS`) or surely beyond the worker's context (more characters than the
context times `MAX_CHARS_PER_TOKEN`, with a frame's tools counted); nothing here sends a call.
"""

from __future__ import annotations

from typing import Final

from prefixreg.core.errors import UsageError
from prefixreg.core.records import ServerBuild, strict_count
from prefixreg.verbs.probe.report import ProbeOptions

__all__ = [
    "MAX_CHARS_PER_TOKEN",
    "MAX_SIZE_CHARS",
    "REPORT_C_SIZE",
    "c_sizes",
    "check_sizes",
    "context_tokens",
    "head_extra",
    "parse_sizes",
]

# The largest size parse_sizes takes (characters); far beyond any context, small enough
# that nothing big is ever allocated for a typo.
MAX_SIZE_CHARS: Final = 100_000_000
# Characters one token may hold at most, for the context check (the measured lane has about
# 1.5, English BPE text about 4; 8 leaves room for any tokenizer on ordinary text).
MAX_CHARS_PER_TOKEN: Final = 8
# The report's probe runs leg C at 16k characters only (22 calls at its four sizes).
REPORT_C_SIZE: Final = 16_000


def parse_sizes(text: str) -> tuple[int, ...]:
    """`4k,16k,32k` -> (4000, 16000, 32000): characters of prefix text, k = 1000.

    A size over `MAX_SIZE_CHARS` is a usage error here, before any text is made; sizes the
    worker's context cannot hold are refused once its build is known (`check_sizes`).
    """
    sizes = []
    for part in text.split(","):
        item = part.strip().lower()
        mult = 1000 if item.endswith("k") else 1
        digits = item.removesuffix("k")
        # ASCII digits only, and few of them: int() of a huge or non-ASCII digit string
        # raises (or takes long) instead of giving a clear one-line error.
        ok = digits.isascii() and digits.isdigit() and len(digits) <= 12
        if not ok or int(digits) * mult < 1:
            raise UsageError(f"bad size {part.strip()!r}: use characters like 4000 or 4k")
        if int(digits) * mult > MAX_SIZE_CHARS:
            raise UsageError(
                f"size {part.strip()!r} is over {MAX_SIZE_CHARS:,} characters: "
                "no worker's context holds that"
            )
        sizes.append(int(digits) * mult)
    if not sizes:
        raise UsageError("no sizes given")
    return tuple(sorted(set(sizes)))


def context_tokens(build: ServerBuild) -> int | None:
    """The tokens one request may hold on this worker (a slot's context), if it says."""
    values = [strict_count(build.identity.get(k)) for k in ("slot_ctx", "context", "n_ctx")]
    valid = [v for v in values if v]
    return min(valid) if valid else None


def check_sizes(options: ProbeOptions, build: ServerBuild) -> None:
    """Refuse sizes (and a foreign prompt size) the worker's context cannot hold.

    Sizes are characters and the context is tokens: a text of N characters has at least
    N / `MAX_CHARS_PER_TOKEN` tokens, so a size over context x that is surely too long.
    (Shorter ones may still be: the server then answers with its own error.)
    """
    context = context_tokens(build)
    if context is None:
        return
    limit = context * MAX_CHARS_PER_TOKEN
    extra = head_extra(options)
    for label, chars in [("size", s + extra) for s in options.sizes] + [
        ("--foreign-chars", options.foreign_chars)
    ]:
        if chars > limit:
            raise UsageError(
                f"{label} {chars:,} characters"
                + (
                    f" (with the frame's {extra:,} bytes of tools)"
                    if extra and label == "size"
                    else ""
                )
                + " is larger than the worker's context "
                f"({context:,} tokens, at most about {limit:,} characters)"
            )


def head_extra(options: ProbeOptions) -> int:
    """Bytes a frame adds to each size's rendered head: its tools JSON, when rendered."""
    frame = options.frame
    return len(frame.tools_data or b"") if frame is not None and frame.renders_tools else 0


def c_sizes(options: ProbeOptions) -> tuple[int, ...]:
    """The sizes leg C runs at: every size, or (`legs="report"`) the one nearest 16k."""
    if options.legs == "all":
        return options.sizes
    return (min(options.sizes, key=lambda s: (abs(s - REPORT_C_SIZE), s)),)
