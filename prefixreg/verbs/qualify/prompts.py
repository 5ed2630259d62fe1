"""`qualify`'s prompt: the built-in public text fixture, a text file, or a token-ID file.

Invariants:
- `fixture_sha256` is sha256 of `json.dumps(prompt)` (default separators: the JSON-quoted
  string or the list of IDs), the benchmark client's fingerprint, so receipts of one prompt
  compare across tools; the prompt itself is never in a receipt.
- A file whose content starts with `[` (after white space) is a token prompt: a non-empty
  JSON array of IDs, each exactly an int in 0..2**32-1 (never a boolean, float or string);
  anything else in such a file is refused, never sent as text. Any other file is UTF-8 text.
- The built-in fixture's token length depends on the tokenizer: it is never advertised as
  a number of tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.core.jsonio import loads
from prefixreg.registry.userfiles import read_user_file

# Public text, any tokenizer's: a one-line task, then one line repeated.
FIXTURE: Final = "Count the words in the text below and answer with the number only.\n" + (
    "alpha beta gamma delta\n" * 512
)
MAX_TOKEN_ID: Final = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class QualifyPrompt:
    """What every request of a run sends: text or token IDs, and where it came from."""

    value: str | tuple[int, ...]
    source: Literal["builtin", "file"]

    @property
    def kind(self) -> Literal["text", "tokens"]:
        return "text" if isinstance(self.value, str) else "tokens"

    @property
    def sent(self) -> str | list[int]:
        return self.value if isinstance(self.value, str) else list(self.value)

    @property
    def fixture_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.sent).encode("utf-8")).hexdigest()


def builtin_prompt() -> QualifyPrompt:
    return QualifyPrompt(FIXTURE, "builtin")


def load_prompt(path: Path | str) -> QualifyPrompt:
    """A prompt file (module docstring). Raises UsageError: unreadable, empty, not UTF-8,
    or a token array that is not one."""
    data = read_user_file(path)
    if data.lstrip()[:1] == b"[":
        return QualifyPrompt(token_ids(data, str(path)), "file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--prompt-file {path}: not UTF-8 text (nor a JSON array)") from None
    if not text.strip():
        raise UsageError(f"--prompt-file {path}: empty")
    return QualifyPrompt(text, "file")


def token_ids(data: bytes, where: str) -> tuple[int, ...]:
    """A JSON array of token IDs, strictly (module docstring), else UsageError naming `where`."""
    try:
        value = loads(data)
    except CorruptRecordError:
        raise UsageError(f"--prompt-file {where}: starts with '[' but is not JSON") from None
    if not isinstance(value, list) or not value:
        raise UsageError(f"--prompt-file {where}: a token prompt is a non-empty JSON array")
    for i, item in enumerate(value):
        if type(item) is not int or not 0 <= item <= MAX_TOKEN_ID:
            shown = json.dumps(item)[:20]
            raise UsageError(
                f"--prompt-file {where}: item {i} ({shown}) is not a token ID (an integer "
                f"0..{MAX_TOKEN_ID})"
            )
    return tuple(value)  # type: ignore[arg-type]  # every item checked an int above
