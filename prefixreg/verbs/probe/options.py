"""What a probe measures (`ProbeOptions`, its sizes parsed by `parse_sizes` and checked
against a worker's context by `check_sizes`) and its text (a built-in corpus, slices of
it). Pure.

Invariants: sizes are whole numbers of characters within `MAX_SIZE_CHARS`, a corpus is text
UTF-8 can carry and long enough for every size, a frame is a verified `Frame` (never a
reference); anything else is a `UsageError` before a request is made. The built-in text
reads like a system prompt (instructions, file names, identifiers), so tokenizers split it
as they split real prefixes; the same seed gives the same characters on every machine.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame
from prefixreg.core.probe_words import PROBE_FILES, PROBE_WORDS
from prefixreg.core.records import ServerBuild, strict_count

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
# The order is part of the corpus: the simulator's tokenizer is calibrated on this text.
_WORDS: Final = PROBE_WORDS
_FILES: Final = PROBE_FILES


def whole(value: object, high: int) -> bool:
    """Is `value` an int (never a bool) from 1 to `high`?"""
    return type(value) is int and 1 <= value <= high


def builtin_corpus(n_chars: int, *, seed: int = 20261129) -> str:
    """At least `n_chars` characters of deterministic system-prompt-like text.

    Raises:
        UsageError: `n_chars` is not a whole number from 1 to 10^9, or `seed` not an int.
    """
    if not whole(n_chars, 10**9) or type(seed) is not int:
        raise UsageError("builtin_corpus takes 1 to 10^9 characters and an integer seed")
    rng = random.Random(seed)  # noqa: S311 -- reproducible filler text, not a secret
    parts: list[str] = []
    size = 0
    while size < n_chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 18))]
        if rng.random() < 0.25:
            words.insert(rng.randrange(len(words)), f"`{rng.choice(_FILES)}`")
        if rng.random() < 0.15:
            words.append(f"(id {rng.getrandbits(32):08x})")
        parts.append(f"{len(parts) + 1}. " + " ".join(words).capitalize() + ".\n")
        size += len(parts[-1])
    return "".join(parts)


def probe_slice(corpus: str, n_chars: int, *, header: str, offset: int = 0) -> str:
    """`header` then `n_chars` characters of `corpus` from `offset` (wrapping around). The
    header makes each probe prefix distinct, so no leg resumes another's snapshot by accident.

    Raises:
        UsageError: an empty corpus or a header that is not text, or a bad count.
    """
    given: list[object] = [corpus, header]
    if not (isinstance(given[0], str) and corpus and isinstance(given[1], str)):
        raise UsageError("probe_slice takes a non-empty text corpus and a text header")
    if not whole(n_chars, 10**9) or type(offset) is not int or offset < 0:
        raise UsageError("probe_slice takes 1 to 10^9 characters from an offset of 0 or more")
    offset %= len(corpus)
    body = (corpus * (1 + (offset + n_chars) // len(corpus)))[offset : offset + n_chars]
    return f"{header}\n{body}"


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What to probe: sizes in characters, foreign prompts before leg C (at every size, or
    with `legs="report"` at the one nearest 16k), a survival search, and an optional frame
    whose tools and settings go with each size's prefix (legs judged against that head);
    `bisect`: then narrow Cmax's bracket between the sizes (`run._Prober.bisect`).

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
    bisect: bool = False

    def __post_init__(self) -> None:
        given: list[object] = [self.sizes, self.survival, self.force, self.legs, self.frame]
        sizes, survival, force, legs, frame = given
        if not isinstance(sizes, (tuple, list)) or not sizes:
            raise UsageError("sizes must be a non-empty list of character counts")
        object.__setattr__(self, "sizes", tuple(sizes))
        if not all(whole(n, MAX_SIZE_CHARS) for n in (*sizes, self.foreign_chars)):
            text = f"sizes and --foreign-chars must be whole numbers from 1 to {MAX_SIZE_CHARS:,}"
            raise UsageError(text)
        if not whole(self.foreign, MAX_FOREIGN):
            raise UsageError(f"--foreign must be a whole number from 1 to {MAX_FOREIGN:,}")
        if type(survival) is not bool or type(force) is not bool or type(self.bisect) is not bool:
            raise UsageError("survival, force and bisect must be true or false")
        if legs not in ("all", "report"):
            raise UsageError(f"--legs {legs!r}: use all or report")
        if frame is not None and not isinstance(frame, Frame):
            raise UsageError("frame must be a verified Frame (Registry.head), not a reference")
        corpus: object = self.corpus
        if corpus is not None and (not isinstance(corpus, str) or _SURROGATE.search(corpus)):
            raise UsageError("the corpus must be text that UTF-8 can carry (no lone surrogate)")
        if isinstance(corpus, str) and len(corpus) < (need := max(self.sizes)):
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


def parse_sizes(text: str) -> tuple[int, ...]:
    """`4k,16k,32k` -> (4000, 16000, 32000): characters of prefix text, k = 1000.

    Raises:
        UsageError: not text, or a size not a whole number from 1 to `MAX_SIZE_CHARS`.
    """
    given: object = text
    if not isinstance(given, str):
        raise UsageError(f"sizes must be text like 4k,16k, not {type(given).__name__}")
    sizes = set()
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
            raise UsageError(f"size {part.strip()!r} is over {MAX_SIZE_CHARS:,} characters")
        sizes.add(n)
    return tuple(sorted(sizes))


def check_sizes(options: ProbeOptions, build: ServerBuild) -> None:
    """Refuse sizes (and the foreign prompt size) the worker's context surely cannot hold: N
    characters are at least N / `MAX_CHARS_PER_TOKEN` tokens (the server refuses the rest).

    Raises:
        UsageError: a size is too large, or the arguments are of the wrong types.
    """
    given: list[object] = [options, build]
    if not isinstance(given[0], ProbeOptions) or not isinstance(given[1], ServerBuild):
        raise UsageError("check_sizes takes ProbeOptions and a ServerBuild")
    counts = [strict_count(build.identity.get(k)) for k in ("slot_ctx", "context", "n_ctx")]
    context = min((n for n in counts if n), default=None)
    if context is None:
        return
    limit, extra = context * MAX_CHARS_PER_TOKEN, options.head_extra
    tools = f" (with the frame's {extra:,} bytes of tools)" if extra else ""
    wanted = [(f"size {s + extra:,} characters{tools}", s + extra) for s in options.sizes]
    wanted.append((f"--foreign-chars {options.foreign_chars:,}", options.foreign_chars))
    for label, chars in wanted:
        if chars > limit:
            text = f"{label} is larger than the worker's context "
            raise UsageError(text + f"({context:,} tokens, at most about {limit:,} characters)")
