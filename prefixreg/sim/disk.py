"""The simulator's disk tier (`--cache-dir`, like Flash's ``HALOGEN_CACHE_DIR``): snapshots that
outlive the process.

Every snapshot the memory cache stores is also written here, one JSON file per snapshot under
``<cache_dir>/<build>/`` where ``<build>`` is derived from the template, model id and slot size
(each build gets its own subtree, as on Flash). A write goes to a temporary file in the same
directory and is renamed into place, so a crash leaves either the whole record or none. On
start the subtree is read back, least recently used first (by file mtime; a restore touches
the file), so entries survive a restart of the simulator exactly.

The modelled size of a record is ``tokens * disk_token_bytes`` (~27 KiB a token on Flash); the
tier holds at most ``disk_gib`` GiB and evicts least-recently-used records to stay under it; a
record larger than the whole budget is skipped. A lookup finds the longest record that is an
exact prefix of the prompt (Flash places). Counters follow `/cache.disk` (halogen-api.md §1.3):
``hits`` restores, ``misses`` lookups that found no record where memory had nothing either,
``persisted`` records written, ``skipped`` stores not written (held already, or over budget),
``lineages`` records that extend no other record (their roots), ``branches`` the rest. These
two are the simulator's definitions; the reference does not document Flash's. Not thread-safe:
the engine serialises calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixreg.sim.tokenizer import token_digest

__all__ = ["DiskCounters", "DiskTier", "build_subtree"]

_SUFFIX = ".json"


def build_subtree(template_sha256: str, model: str, slot_ctx: int) -> str:
    """The subtree name of one build: 16 hex digits of a sha256 over what identifies it."""
    ident = f"{template_sha256}\n{model}\n{slot_ctx}\n".encode()
    return hashlib.sha256(ident).hexdigest()[:16]


def _record_name(tokens: tuple[str, ...]) -> str:
    return token_digest(tokens).hex() + _SUFFIX


@dataclass(slots=True)
class DiskCounters:
    """Cumulative disk-tier counters (records/bytes/lineages are computed when read)."""

    hits: int = 0
    misses: int = 0
    persisted: int = 0
    evicted: int = 0
    skipped: int = 0
    restore_ms_total: float = 0.0
    restored_bytes: int = 0


class DiskTier:
    """Records on disk plus their in-memory index (name -> tokens, least recent first)."""

    def __init__(self, root: Path, build: str, *, budget_bytes: int, token_bytes: int) -> None:
        self.dir = root / build
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.token_bytes = token_bytes
        self.counters = DiskCounters()
        self._records: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._load()

    def _load(self) -> None:
        found: list[tuple[float, str, tuple[str, ...]]] = []
        for path in self.dir.iterdir():
            if not path.name.endswith(_SUFFIX) or path.is_symlink() or not path.is_file():
                continue  # temporary files of an interrupted write, or anything not ours
            try:
                body = json.loads(path.read_text(encoding="utf-8"))
                tokens = tuple(str(t) for t in body["tokens"])
                mtime = path.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError):
                continue  # unreadable: ignored, like a record that was never written
            if _record_name(tokens) == path.name:
                found.append((mtime, path.name, tokens))
        for _, name, tokens in sorted(found):
            self._records[name] = tokens

    def size(self, tokens: int) -> int:
        """Modelled bytes of a record of `tokens` tokens."""
        return tokens * self.token_bytes

    @property
    def bytes(self) -> int:
        return sum(self.size(len(t)) for t in self._records.values())

    def find(self, tokens: tuple[str, ...]) -> int:
        """Length of the longest record that is an exact prefix of `tokens` (0: none)."""
        best = 0
        for record in self._records.values():
            n = len(record)
            if best < n <= len(tokens) and tokens[:n] == record:
                best = n
        return best

    def restore(self, tokens: tuple[str, ...], length: int) -> int:
        """Restore the record `tokens[:length]`: refresh it; returns its modelled bytes."""
        name = _record_name(tokens[:length])
        self._records.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(self.dir / name)  # recency survives a restart
        size = self.size(length)
        self.counters.hits += 1
        self.counters.restored_bytes += size
        return size

    def persist(self, snapshot: tuple[str, ...]) -> None:
        """Write `snapshot` (atomically), then evict least-recently-used records over budget."""
        name = _record_name(snapshot)
        if name in self._records or self.size(len(snapshot)) > self.budget_bytes:
            self.counters.skipped += 1
            if name in self._records:
                self._records.move_to_end(name)
            return
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"v": 1, "tokens": list(snapshot)}), encoding="utf-8")
        os.replace(tmp, self.dir / name)
        self._records[name] = snapshot
        self.counters.persisted += 1
        while self.bytes > self.budget_bytes and len(self._records) > 1:
            old, _ = self._records.popitem(last=False)
            with contextlib.suppress(FileNotFoundError):
                (self.dir / old).unlink()
            self.counters.evicted += 1

    def body(self) -> dict[str, Any]:
        """The `/cache` `disk` block."""
        records = list(self._records.values())
        roots = sum(
            1
            for r in records
            if not any(len(o) < len(r) and r[: len(o)] == o for o in records if o is not r)
        )
        c = self.counters
        return {
            "on": True,
            "records": len(records),
            "lineages": roots,
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes,
            "hits": c.hits,
            "misses": c.misses,
            "persisted": c.persisted,
            "branches": len(records) - roots,
            "evicted": c.evicted,
            "skipped": c.skipped,
            "restore_ms_total": round(c.restore_ms_total, 1),
            "restored_bytes": c.restored_bytes,
        }
