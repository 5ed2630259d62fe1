"""The probe's text: a built-in deterministic corpus, slices of it, and a user's corpus file.

The built-in text reads like a system prompt (instructions, file names, identifiers) so that
tokenizers split it the way they split real prefixes; the same seed gives the same
characters on every machine. A user's corpus file is read only when it is a regular file of
at most `MAX_CORPUS_BYTES`: a FIFO, a device or a directory is refused before a byte is read.
"""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path
from typing import Final

from prefixreg.core.errors import UsageError

MAX_CORPUS_BYTES: Final = 64 << 20
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


def read_corpus(path: Path | str) -> str:
    """The UTF-8 text of the corpus file at `path`.

    Raises:
        UsageError: not a path; missing or unreadable; not a regular file; over
            `MAX_CORPUS_BYTES`; not UTF-8.
    """
    given: object = path
    if not isinstance(given, (str, Path)):
        raise UsageError(f"corpus: a file path is needed, not {type(given).__name__}")
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:
        raise UsageError(f"corpus {path}: {getattr(exc, 'strerror', None) or exc}") from None
    too_big = UsageError(f"corpus {path}: larger than {MAX_CORPUS_BYTES:,} bytes")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"corpus {path}: not a regular file (a FIFO, device or directory)")
        if st.st_size > MAX_CORPUS_BYTES:
            raise too_big
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CORPUS_BYTES + 1)  # one byte more shows a file that grew
    finally:
        os.close(fd)
    if len(data) > MAX_CORPUS_BYTES:
        raise too_big
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"corpus {path}: not UTF-8 text") from None
