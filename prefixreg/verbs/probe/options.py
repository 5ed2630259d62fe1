"""What a probe measures (`ProbeOptions`) and its bounds: checked at construction.

Invariants: sizes are whole numbers of characters within `MAX_SIZE_CHARS`, a corpus is text
UTF-8 can carry and long enough for every size, a frame is a verified `Frame` (never a
reference); anything else is a `UsageError` before a request is made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame
from prefixreg.verbs.probe.corpus import whole

DEFAULT_SIZES: Final = (4000, 16000, 32000, 64000)
# The largest size (characters): beyond any context, small enough that a typo allocates
# nothing big. Characters one token may hold at most, for the context check (the lane has
# about 1.5, English BPE text about 4). The report's probe runs leg C at 16k only.
MAX_SIZE_CHARS: Final = 100_000_000
MAX_CHARS_PER_TOKEN: Final = 8
REPORT_C_SIZE: Final = 16_000
MAX_FOREIGN: Final = 10_000
SURVIVAL_CAP: Final = 64
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
Legs = Literal["all", "report"]


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What to probe: sizes in characters, foreign prompts before leg C (at every size, or
    with `legs="report"` at the one nearest 16k), a survival search, and an optional frame
    whose tools and settings go with each size's prefix (legs judged against that head).

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
        given: list[object] = [self.sizes, self.survival, self.force, self.legs, self.frame]
        sizes, survival, force, legs, frame = given
        if not isinstance(sizes, (tuple, list)) or not sizes:
            raise UsageError("sizes must be a non-empty list of character counts")
        object.__setattr__(self, "sizes", tuple(sizes))
        if not all(whole(n, MAX_SIZE_CHARS) for n in (*sizes, self.foreign_chars)):
            raise UsageError(
                f"sizes and --foreign-chars must be whole numbers from 1 to {MAX_SIZE_CHARS:,}"
            )
        if not whole(self.foreign, MAX_FOREIGN):
            raise UsageError(f"--foreign must be a whole number from 1 to {MAX_FOREIGN:,}")
        if type(survival) is not bool or type(force) is not bool:
            raise UsageError("survival and force must be true or false")
        if legs not in ("all", "report"):
            raise UsageError(f"--legs {legs!r}: use all or report")
        if frame is not None and not isinstance(frame, Frame):
            raise UsageError("frame must be a verified Frame (Registry.head), not a reference")
        corpus: object = self.corpus
        if corpus is not None and (not isinstance(corpus, str) or _SURROGATE.search(corpus)):
            raise UsageError("the corpus must be text that UTF-8 can carry (no lone surrogate)")
        if isinstance(corpus, str) and len(corpus) < max(self.sizes):
            need = max(self.sizes)
            raise UsageError(f"the corpus has {len(corpus):,} characters; a size needs {need:,}")

    @property
    def head_extra(self) -> int:
        """Bytes a frame adds to each size's rendered head: its tools JSON, when rendered."""
        frame = self.frame
        return len(frame.tools_data or b"") if frame is not None and frame.renders_tools else 0

    @property
    def c_sizes(self) -> tuple[int, ...]:
        """The sizes leg C runs at."""
        if self.legs == "all":
            return self.sizes
        return (min(self.sizes, key=lambda s: (abs(s - REPORT_C_SIZE), s)),)
