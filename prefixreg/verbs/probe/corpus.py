"""The probe's text: a built-in deterministic corpus, and slices of it. Pure.

The built-in text reads like a system prompt (instructions, file names, identifiers) so that
tokenizers split it the way they split real prefixes; the same seed gives the same
characters on every machine.
"""

from __future__ import annotations

import random
from typing import Final

from prefixreg.core.errors import UsageError

# The order is part of the corpus: the simulator's tokenizer is calibrated on this text.
_WORDS: Final = """agent repository module function test commit branch review patch refactor
error type value index cache prefix token worker server request response stream buffer config
option default parse render record measure verify hash object name journal lock write read
file path directory build release version schema field count state always never before after
when unless every each only the a of to in for with on keep check run report explain prefer
avoid return raise handle log retry fail close""".split()  # noqa: SIM905 -- prose, in order
_FILES: Final = ("store.py", "worker.py", "README.md", "tests/test_store.py", "pyproject.toml")


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
