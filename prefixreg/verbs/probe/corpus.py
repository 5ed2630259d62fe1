"""The probe's text: a built-in deterministic corpus, slices of it, and a user's corpus file.

The built-in text reads like a system prompt (instructions, file names, identifiers) so that
tokenizers split it the way they split real prefixes. It depends only on the seed: the same
seed gives the same characters on every machine, so a probe's prefixes are reproducible.

Invariant: a user's corpus file is read only when it is a regular file of at most
`MAX_CORPUS_BYTES` (a FIFO, a device such as /dev/zero or a directory is refused before a
byte is read, and a file that grows past the cap while read is refused too).
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


def _whole(value: object, what: str, low: int = 1) -> int:
    if type(value) is not int or value < low:
        raise UsageError(f"{what} must be a whole number of at least {low}, not {value!r}")
    return value


def builtin_corpus(n_chars: int, *, seed: int = 20261129) -> str:
    """At least `n_chars` characters of deterministic system-prompt-like text.

    Raises:
        UsageError: `n_chars` or `seed` is not a whole number (`n_chars` at most 10^9).
    """
    if _whole(n_chars, "n_chars") > 10**9 or type(seed) is not int:
        raise UsageError("n_chars must be at most 10^9 and seed a whole number")
    rng = random.Random(seed)  # noqa: S311 -- reproducible filler text, not a secret
    parts: list[str] = []
    size, rule = 0, 1
    while size < n_chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 18))]
        if rng.random() < 0.25:
            words.insert(rng.randrange(len(words)), f"`{rng.choice(_FILES)}`")
        if rng.random() < 0.15:
            words.append(f"(id {rng.getrandbits(32):08x})")
        line = f"{rule}. " + " ".join(words).capitalize() + ".\n"
        rule += 1
        parts.append(line)
        size += len(line)
    return "".join(parts)


def probe_slice(corpus: str, n_chars: int, *, header: str, offset: int = 0) -> str:
    """`header` then `n_chars` characters of `corpus` from `offset` (wrapping around).

    The header makes each probe prefix distinct from every other, so no leg can resume from
    an earlier leg's or an earlier run's snapshot by accident.

    Raises:
        UsageError: an empty corpus, a header that is not text, a count that is not whole.
    """
    given: list[object] = [corpus, header]
    if not isinstance(given[0], str) or not corpus or not isinstance(given[1], str):
        raise UsageError("probe_slice needs a non-empty corpus and a header, both text")
    _whole(n_chars, "n_chars")
    offset = _whole(offset, "offset", 0) % len(corpus)
    body = (corpus * (1 + (offset + n_chars) // len(corpus)))[offset : offset + n_chars]
    return f"{header}\n{body}"


def read_corpus(path: Path | str) -> str:
    """The UTF-8 text of the corpus file at `path`.

    Raises:
        UsageError: not a path; missing or unreadable; not a regular file; over
            `MAX_CORPUS_BYTES`; not UTF-8.
    """
    if not isinstance(path, (str, Path)):
        raise UsageError(f"corpus: a file path is needed, not {type(path).__name__}")
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:
        raise UsageError(f"corpus {path}: {getattr(exc, 'strerror', None) or exc}") from None
    chunks: list[bytes] = []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"corpus {path}: not a regular file (a FIFO, device or directory)")
        left = MAX_CORPUS_BYTES + 1
        while left > 0 and st.st_size <= MAX_CORPUS_BYTES:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if max(st.st_size, len(data)) > MAX_CORPUS_BYTES:
        raise UsageError(f"corpus {path}: larger than {MAX_CORPUS_BYTES:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"corpus {path}: not UTF-8 text") from None
