"""`Prefix`: the verified text of one registered prefix, ready to send. Pure.

A `Prefix` is only ever built from bytes that were just hashed and matched their sha
(`Registry.get`), and it keeps the decoded text of exactly those bytes, so the bytes checked
are the bytes sent: nothing re-reads the file between the check and the request.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from prefixreg.core.errors import CorruptRecordError

__all__ = ["Prefix", "fresh_tail"]


class Prefix(NamedTuple):
    """A verified prefix: its sha256, its exact bytes, and the name it was reached by.

    Immutable. `text` decodes the bytes on each access; holding bytes (in a tuple, the
    cheapest immutable record to build) keeps `Registry.get` as cheap as the read and the
    hash it must do anyway.
    """

    sha256: str
    data: bytes
    name: str | None = None

    @classmethod
    def from_text(cls, sha256: str, text: str, name: str | None = None) -> Prefix:
        """Build from text (for callers that hold the text of a sha they verified)."""
        return cls(sha256=sha256, data=text.encode("utf-8"), name=name)

    @property
    def text(self) -> str:
        """The prefix as a string (the registry only stores valid UTF-8)."""
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptRecordError(f"prefix {self.sha256} is not valid UTF-8") from None

    @property
    def size(self) -> int:
        """Length in bytes of the UTF-8 content."""
        return len(self.data)

    # The head protocol, shared with `Frame`: what every verb needs of the head it sends.
    @property
    def kind(self) -> str:
        return "prefix"

    @property
    def system(self) -> Prefix:
        """The system prefix this head sends (a bare prefix is its own)."""
        return self

    @property
    def head_bytes(self) -> int:
        """Bytes of the rendered head this prefix owns: its content."""
        return len(self.data)

    def messages(self, tail: str, *, role: str = "system") -> list[dict[str, str]]:
        """The chat messages for one call: this prefix as `messages[0]`, then the user tail."""
        return [{"role": role, "content": self.text}, {"role": "user", "content": tail}]


def fresh_tail(nonce: str | None = None) -> str:
    """A short user tail that the server has never seen (a new random nonce each call).

    Its shape is fixed, so on a deterministic tokenizer it always has the same token count;
    only the nonce (16 hex digits) changes.
    """
    token = nonce if nonce is not None else os.urandom(8).hex()
    return f"prefixreg resume check {token}. Reply with one word."
