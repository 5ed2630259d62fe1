"""A built-in deterministic corpus for probes, and slicing helpers. Pure.

The text reads like a system prompt (instructions, file names, identifiers) so that
tokenizers split it the way they split real prefixes. It depends only on the seed: the same
seed gives the same characters on every machine, so a probe's prefixes are reproducible.
"""

from __future__ import annotations

import random

__all__ = ["builtin_corpus", "probe_slice"]

_WORDS = [
    "agent",
    "repository",
    "module",
    "function",
    "test",
    "commit",
    "branch",
    "review",
    "patch",
    "refactor",
    "error",
    "type",
    "value",
    "index",
    "cache",
    "prefix",
    "token",
    "worker",
    "server",
    "request",
    "response",
    "stream",
    "buffer",
    "config",
    "option",
    "default",
    "parse",
    "render",
    "record",
    "measure",
    "verify",
    "hash",
    "object",
    "name",
    "journal",
    "lock",
    "write",
    "read",
    "file",
    "path",
    "directory",
    "build",
    "release",
    "version",
    "schema",
    "field",
    "count",
    "state",
    "always",
    "never",
    "before",
    "after",
    "when",
    "unless",
    "every",
    "each",
    "only",
    "the",
    "a",
    "of",
    "to",
    "in",
    "for",
    "with",
    "on",
    "keep",
    "check",
    "run",
    "report",
    "explain",
    "prefer",
    "avoid",
    "return",
    "raise",
    "handle",
    "log",
    "retry",
    "fail",
    "close",
]
_FILES = ("store.py", "worker.py", "README.md", "tests/test_store.py", "pyproject.toml")


def builtin_corpus(n_chars: int, *, seed: int = 20261129) -> str:
    """At least `n_chars` characters of deterministic system-prompt-like text."""
    rng = random.Random(seed)  # noqa: S311 -- reproducible filler text, not a secret
    parts: list[str] = []
    size = 0
    rule = 1
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
    """
    if not corpus:
        raise ValueError("empty corpus")
    body = (corpus * (1 + (offset + n_chars) // len(corpus)))[offset : offset + n_chars]
    return f"{header}\n{body}"
