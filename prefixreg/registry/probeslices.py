"""Probe slices: how a meta record marks an object a probe made, and what receipts keep. Pure.

A probe registers the slices it sends (so every call is made from verified bytes), but they
are not the user's prefixes. Format v1 has no separate place for them: the meta record's
`source` says it. `probe/<run id>` is written by `Registry.add_probe_slice` and reserved
(`add` refuses it; the CLI labels content with a file's base name, which has no `/`);
`probe` with a note `probe ...` is what earlier releases wrote, still recognised. A user's
`add` of the same bytes rewrites the meta record as theirs.

A probe receipt (`probes/<ts>.json`) lists every call with the sha256 of what it sent;
`gc --prune-unnamed` keeps the slices a receipt names, as it keeps what a name points to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.jsonio import loads_object

PROBE_SOURCE_PREFIX: Final = "probe/"


def is_probe_source(source: str, note: str | None = None) -> bool:
    """Does a meta record with this `source` (and `note`) mark a probe slice?"""
    if source.startswith(PROBE_SOURCE_PREFIX):
        return True
    return source == "probe" and (note or "").startswith("probe ")


def receipt_shas(raw: bytes) -> set[str] | None:
    """The shas a probe receipt's calls name, or None when it does not parse (a caller
    deciding what to delete must then treat the receipt as unknown)."""
    try:
        calls = loads_object(raw).get("calls")
    except CorruptRecordError:
        return None
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
        unread = unread or found is None
        shas |= found or set()
    return shas, unread
