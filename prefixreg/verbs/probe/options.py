"""What a probe measures (`ProbeOptions`), and its sizes: `--sizes`, the context check, leg C.

Invariants: options are checked when they are built (a wrong type or value is a
`UsageError`, whether they came from the CLI or the API), so a size is refused before any
text is made when it is absurd (over `MAX_SIZE_CHARS`) or, once the worker's build is read,
surely beyond its context (more characters than the context times `MAX_CHARS_PER_TOKEN`, a
frame's tools counted). A frame is a verified `Frame` object (`Registry.head`), never a
reference. Nothing here sends a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame
from prefixreg.core.records import ServerBuild, strict_count

DEFAULT_SIZES: Final = (4000, 16000, 32000, 64000)
# The largest size (characters); far beyond any context, small enough that nothing big is
# ever allocated for a typo.
MAX_SIZE_CHARS: Final = 100_000_000
MAX_FOREIGN: Final = 10_000
# Characters one token may hold at most, for the context check (the measured lane has about
# 1.5, English BPE text about 4; 8 leaves room for any tokenizer on ordinary text).
MAX_CHARS_PER_TOKEN: Final = 8
# The report's probe runs leg C at 16k characters only (22 calls at its four sizes).
REPORT_C_SIZE: Final = 16_000
Legs = Literal["all", "report"]


def _count(value: object, high: int) -> bool:
    return type(value) is int and 1 <= value <= high


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What to probe: sizes in characters, foreign prompts for leg C, survival search.

    `legs="report"` runs leg C at the size nearest 16k only (the report's 22 calls). With a
    `frame`, each size's prefix is sent with its tools and settings and legs are judged
    against that whole head (the slice plus the tools it renders).

    Raises:
        UsageError: a field of the wrong type or out of bounds.
    """

    sizes: tuple[int, ...] = DEFAULT_SIZES
    foreign: int = 9
    foreign_chars: int = 2000
    corpus: str | None = None
    survival: bool = False
    force: bool = False
    legs: Legs = "all"
    frame: Frame | None = None

    def __post_init__(self) -> None:
        sizes: object = self.sizes
        if not isinstance(sizes, (tuple, list)) or not sizes:
            raise UsageError("sizes must be a non-empty list of character counts")
        object.__setattr__(self, "sizes", tuple(sizes))
        if not all(_count(n, MAX_SIZE_CHARS) for n in (*sizes, self.foreign_chars)):
            raise UsageError(
                f"sizes and --foreign-chars must be whole numbers from 1 to {MAX_SIZE_CHARS:,}"
            )
        if not _count(self.foreign, MAX_FOREIGN):
            raise UsageError(f"--foreign must be a whole number from 1 to {MAX_FOREIGN:,}")
        flags: list[object] = [self.survival, self.force]
        if any(type(flag) is not bool for flag in flags):
            raise UsageError("survival and force must be true or false")
        legs: object = self.legs
        if legs not in ("all", "report"):
            raise UsageError(f"--legs {legs!r}: use all or report")
        frame: object = self.frame
        if frame is not None and not isinstance(frame, Frame):
            raise UsageError("frame must be a verified Frame (Registry.head), not a reference")
        self._check_corpus()

    def _check_corpus(self) -> None:
        corpus: object = self.corpus
        if corpus is None:
            return
        if not isinstance(corpus, str):
            raise UsageError(f"the corpus must be text, not {type(corpus).__name__}")
        if len(corpus) < max(self.sizes):
            raise UsageError(
                f"the corpus has {len(corpus):,} characters; the largest size needs "
                f"{max(self.sizes):,}"
            )
        try:
            corpus.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("the corpus is not valid Unicode text (a lone surrogate)") from None

    @property
    def head_extra(self) -> int:
        """Bytes a frame adds to each size's rendered head: its tools JSON, when rendered."""
        frame = self.frame
        return len(frame.tools_data or b"") if frame is not None and frame.renders_tools else 0

    @property
    def c_sizes(self) -> tuple[int, ...]:
        """The sizes leg C runs at: every size, or (`legs="report"`) the one nearest 16k."""
        if self.legs == "all":
            return self.sizes
        return (min(self.sizes, key=lambda s: (abs(s - REPORT_C_SIZE), s)),)


def parse_sizes(text: str) -> tuple[int, ...]:
    """`4k,16k,32k` -> (4000, 16000, 32000): characters of prefix text, k = 1000.

    Raises:
        UsageError: not text, empty, a size that is not a whole number of characters, or
            one over `MAX_SIZE_CHARS` (before any text is made).
    """
    if not isinstance(text, str):
        raise UsageError(f"sizes must be text like 4k,16k, not {type(text).__name__}")
    sizes = []
    for part in text.split(","):
        item = part.strip().lower()
        digits = item.removesuffix("k")
        # ASCII digits only, and few of them: int() of a huge or non-ASCII digit string
        # raises (or takes long) instead of giving a clear one-line error.
        ok = digits.isascii() and digits.isdigit() and len(digits) <= 12
        n = int(digits) * (1000 if item.endswith("k") else 1) if ok else 0
        if n < 1:
            raise UsageError(f"bad size {part.strip()!r}: use characters like 4000 or 4k")
        if n > MAX_SIZE_CHARS:
            raise UsageError(
                f"size {part.strip()!r} is over {MAX_SIZE_CHARS:,} characters: "
                "no worker's context holds that"
            )
        sizes.append(n)
    return tuple(sorted(set(sizes)))


def context_tokens(build: ServerBuild) -> int | None:
    """The tokens one request may hold on this worker (a slot's context), if it says."""
    values = [strict_count(build.identity.get(k)) for k in ("slot_ctx", "context", "n_ctx")]
    valid = [v for v in values if v]
    return min(valid) if valid else None


def check_sizes(options: ProbeOptions, build: ServerBuild) -> None:
    """Refuse sizes (and a foreign prompt size) the worker's context surely cannot hold.

    Sizes are characters and the context is tokens: a text of N characters has at least
    N / `MAX_CHARS_PER_TOKEN` tokens. (Shorter ones may still be too long: the server then
    answers with its own error.)

    Raises:
        UsageError: a size is too large, or the arguments are of the wrong types.
    """
    given: list[object] = [options, build]
    if not isinstance(given[0], ProbeOptions) or not isinstance(given[1], ServerBuild):
        raise UsageError("check_sizes takes ProbeOptions and a ServerBuild")
    context = context_tokens(build)
    if context is None:
        return
    limit, extra = context * MAX_CHARS_PER_TOKEN, options.head_extra
    tools = f" (with the frame's {extra:,} bytes of tools)" if extra else ""
    wanted = [(f"size {s + extra:,} characters{tools}", s + extra) for s in options.sizes]
    wanted.append((f"--foreign-chars {options.foreign_chars:,}", options.foreign_chars))
    for label, chars in wanted:
        if chars > limit:
            raise UsageError(
                f"{label} is larger than the worker's context "
                f"({context:,} tokens, at most about {limit:,} characters)"
            )
