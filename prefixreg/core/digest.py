"""Digests: sha256 object ids, abbreviations, and blake3 build ids. Pure: no I/O.

Invariants:
- An object id is exactly 64 lowercase hex digits; anything else is refused *before* a
  path is built from it, so no id can escape `objects/`.
- An abbreviation is 8 to 63 hex digits (case folded to lower).
- A build id is the first 16 hex digits of blake3 over canonical JSON of the identity.
  blake3 is imported on first use so commands that never compute one do not pay for it.
"""

from __future__ import annotations

import hashlib
import re

from prefixreg.core.errors import InvalidDigestError
from prefixreg.core.jsonio import JSONValue, dumps_canonical

_FULL = re.compile(r"[0-9a-f]{64}")
_ABBREV = re.compile(r"[0-9a-fA-F]{8,64}")
_HEXISH = re.compile(r"[0-9a-fA-F]+")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_full_sha(text: str) -> bool:
    """True when `text` is exactly 64 lowercase hex digits."""
    return _FULL.fullmatch(text) is not None


def looks_like_sha(text: str) -> bool:
    """True when `text` is all hex digits (any case, any length): a sha, not a name."""
    return _HEXISH.fullmatch(text) is not None


def parse_abbrev(text: str) -> str:
    """A sha or an abbreviation of at least 8 hex digits, in lower case. Raises
    InvalidDigestError: fewer than 8 digits, more than 64, or a non-hex character."""
    if _ABBREV.fullmatch(text) is None:
        raise InvalidDigestError(f"not a sha256 or an abbreviation of 8+ hex digits: {text!r}")
    return text.lower()


def output_digest(content: bytes, reasoning: bytes) -> str:
    """sha256(sha256(content) || sha256(reasoning)): independent of chunk boundaries."""
    return sha256_hex(hashlib.sha256(content).digest() + hashlib.sha256(reasoning).digest())


def build_id(identity: JSONValue) -> str:
    """First 16 hex digits of blake3 over the canonical JSON of a server build identity."""
    import blake3  # heavy native import, only where a build id is needed

    return blake3.blake3(dumps_canonical(identity)).hexdigest()[:16]
