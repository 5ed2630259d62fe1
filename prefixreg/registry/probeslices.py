"""Probe slices: how a meta record marks an object a probe made, and what receipts keep. Pure.

A probe registers the slices it sends (so every call is made from verified bytes and its
measurements name an object), but they are not the user's prefixes. Format version 1 has
no separate place for them; the meta record's `source` label (DESIGN §3) says it:

- `probe/<run id>`: written by `Registry.add_probe_slice` since this convention exists.
  The label is reserved: `Registry.add` refuses a source starting with `probe/`, and the
  CLI's `add` labels content with a file's base name, which never contains a `/`.
- `probe` with a note starting `probe `: what earlier releases wrote for a slice, still
  recognised so an existing registry's slices are told apart too.

Readers that do not know the convention see an ordinary meta record (format v1 unchanged).

A probe receipt (`probes/<ts>.json`) lists every call with the sha256 of what it sent;
`receipt_shas` reads those shas, so `gc --prune-unnamed` keeps the slices a receipt points
to, as it keeps what a name points to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.jsonio import loads_object

__all__ = [
    "LEGACY_PROBE_SOURCE",
    "PROBE_SOURCE_PREFIX",
    "is_probe_source",
    "probe_source",
    "receipt_refs",
    "receipt_shas",
]

PROBE_SOURCE_PREFIX: Final = "probe/"
LEGACY_PROBE_SOURCE: Final = "probe"


def probe_source(run_id: str) -> str:
    """The meta `source` label of a slice registered by probe run `run_id`."""
    return f"{PROBE_SOURCE_PREFIX}{run_id}"


def is_probe_source(source: str, note: str | None = None) -> bool:
    """Does a meta record with this `source` (and `note`) mark a probe slice?"""
    if source.startswith(PROBE_SOURCE_PREFIX):
        return True
    return source == LEGACY_PROBE_SOURCE and (note or "").startswith("probe ")


def receipt_shas(raw: bytes) -> set[str] | None:
    """The shas a probe receipt's calls name, or None when the receipt does not parse
    (a caller deciding what to delete must then treat the receipt as unknown)."""
    try:
        data = loads_object(raw)
    except CorruptRecordError:
        return None
    calls = data.get("calls")
    if not isinstance(calls, list):
        return None
    out: set[str] = set()
    for call in calls:
        sha = call.get("sha256") if isinstance(call, dict) else None
        if isinstance(sha, str) and is_full_sha(sha):
            out.add(sha)
    return out


def receipt_refs(receipts: Iterable[bytes]) -> tuple[set[str], bool]:
    """(every sha the receipts' calls name, whether some receipt did not parse)."""
    shas: set[str] = set()
    unread = False
    for raw in receipts:
        found = receipt_shas(raw)
        if found is None:
            unread = True
        else:
            shas |= found
    return shas, unread
