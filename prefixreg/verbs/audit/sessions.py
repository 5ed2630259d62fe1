"""Which earlier call of the batch each call continues: its session prefix. Pure.

A call continues an earlier call of its session when its request sent that call's whole
request first (tools and every message, byte for byte: the earlier call's last `chain` entry is
in this call's chain); of several, the one with the most messages (the previous call of the
session), and of equal requests the latest earlier one. Matched on hashes only, never text.

The session prefix is the previous call's prompt: its server count when that call's counts are
valid (`measured`), else (only bytes known) this call's prompt scaled by the two requests'
bytes (`estimated`); never more than this call's prompt. A call read without its request (no
chain) has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prefixreg.verbs.audit.read import AuditCall


@dataclass(frozen=True, slots=True)
class SessionPrefix:
    """Call `of` (its source) is the previous call of the session; its prompt, `tokens` long."""

    of: str
    tokens: int
    source: Literal["measured", "estimated"]


def _bytes(c: AuditCall) -> int | None:
    return None if c.head_bytes is None or c.rest_bytes is None else c.head_bytes + c.rest_bytes


def _prompt(prev: AuditCall, call: AuditCall, prompt: int) -> tuple[int, bool] | None:
    """(the previous call's prompt tokens, whether measured); None: not known even by bytes."""
    ev = prev.evidence
    if ev.cache_state != "unverified" and ev.prompt_tokens is not None:
        return min(ev.prompt_tokens, prompt), True
    before, now = _bytes(prev), _bytes(call)
    if before is None or not now:
        return None
    return min(prompt, prompt * before // now), False


def session_prefixes(calls: Sequence[AuditCall]) -> list[SessionPrefix | None]:
    """Each call's session prefix (the module's rule), in call order."""
    last: dict[str, list[int]] = {}  # a request's last chain entry -> the calls that sent it
    for i, c in enumerate(calls):
        if c.chain:
            last.setdefault(c.chain[-1], []).append(i)
    out: list[SessionPrefix | None] = []
    for i, c in enumerate(calls):
        prompt = c.evidence.prompt_tokens
        prev = None
        for n in range(len(c.chain), 0, -1):  # the longest earlier request this one sent first
            sent = last.get(c.chain[n - 1], [])
            # A shorter request is a prefix wherever it was read; an equal one must come first.
            found = [j for j in sent if n < len(c.chain) or j < i]
            if found:
                prev = max(found)
                break
        if prev is None or prompt is None:
            out.append(None)
            continue
        got = _prompt(calls[prev], c, prompt)
        if got is None:
            out.append(None)
            continue
        tokens, measured = got
        out.append(
            SessionPrefix(calls[prev].source, tokens, "measured" if measured else "estimated")
        )
    return out
