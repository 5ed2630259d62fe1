"""The simulator's disk tier (`--cache-dir`, like Flash's ``HALOGEN_CACHE_DIR``): snapshots that
outlive the process. Not thread-safe: the engine serialises calls.

Each snapshot the memory cache stores is also a JSON file under ``<cache_dir>/<build>/`` (one
subtree per template, model id and slot size), written to a temporary file renamed into place:
a crash leaves the whole record or none; a failed write (full disk, directory gone) leaves no
temporary file and counts as skipped. On start the subtree is read back least recently used
first (file mtime; a restore touches the file), so entries survive a restart exactly; a file
not regular, not JSON, or not named after its tokens is ignored. A record models ``tokens *
disk_token_bytes``; least recently used records are evicted to stay within ``disk_gib``, one
larger than all of it is skipped. A lookup restores the longest record that is an exact prefix
of the prompt. `/cache.disk` (halogen-api.md §1.3): ``hits`` restores, ``misses`` lookups that
found nothing where memory had nothing either, ``persisted``, ``skipped`` (held already, over
budget, failed); ``lineages`` (records extending no other) and ``branches`` (the rest) are the
simulator's own definitions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from prefixreg.core import jsonio
from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.sim.config import GIB, SimConfig
from prefixreg.sim.tokenizer import TEMPLATE_SHA256, token_digest

_SUFFIX = ".json"


def _record_name(tokens: tuple[str, ...]) -> str:
    return token_digest(tokens).hex() + _SUFFIX


class DiskTier:
    """Records on disk plus their index (name -> tokens, least recent first). Raises
    `UsageError` if the build's subtree cannot be created or read."""

    def __init__(self, config: SimConfig, cache_dir: str) -> None:
        ident = f"{TEMPLATE_SHA256}\n{config.model_id}\n{config.slot_ctx}\n".encode()
        self.dir = Path(cache_dir) / hashlib.sha256(ident).hexdigest()[:16]
        self.config, self.budget_bytes = config, int(config.disk_gib * GIB)
        self.counters = dict.fromkeys(("hits", "misses", "persisted", "evicted", "skipped"), 0)
        self.restored_bytes = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            paths = list(self.dir.iterdir())
        except OSError as exc:
            raise UsageError(
                f"simulator: cannot use cache_dir {cache_dir}: {exc.strerror or exc}"
            ) from None
        found: list[tuple[float, str, tuple[str, ...]]] = []
        for path in paths:
            if not path.name.endswith(_SUFFIX) or path.is_symlink() or not path.is_file():
                continue  # temporary files of an interrupted write, or anything not ours
            try:
                body = jsonio.loads(path.read_bytes(), path=path)
                mtime = path.stat().st_mtime
            except (OSError, CorruptRecordError):
                continue  # unreadable: ignored, like a record that was never written
            listed = body.get("tokens") if isinstance(body, dict) else None
            tokens = tuple(str(t) for t in listed) if isinstance(listed, list) else ()
            if tokens and _record_name(tokens) == path.name:
                found.append((mtime, path.name, tokens))
        self._records = OrderedDict((name, tokens) for _, name, tokens in sorted(found))

    @property
    def bytes(self) -> int:
        return sum(len(t) for t in self._records.values()) * self.config.disk_token_bytes

    def resume(self, tokens: tuple[str, ...], cached: int) -> tuple[int, float]:
        """Restore the longest record that is a prefix of `tokens` and resumes more than the
        `cached` tokens memory found, refreshing it: (its length, modelled seconds before
        `speed`); (0, 0.0) if there is none (a miss when memory had nothing either)."""
        best = 0
        for record in self._records.values():
            if best < len(record) <= len(tokens) and tokens[: len(record)] == record:
                best = len(record)
        if best <= cached:
            self.counters["misses"] += cached == 0
            return 0, 0.0
        name = _record_name(tokens[:best])
        self._records.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(self.dir / name)  # recency survives a restart
        size = best * self.config.disk_token_bytes
        self.counters["hits"] += 1
        self.restored_bytes += size
        return best, size / (self.config.disk_read_mbps * 1e6)

    def persist(self, snapshot: tuple[str, ...]) -> None:
        """Write `snapshot` (atomically), then evict least-recently-used records over budget."""
        name = _record_name(snapshot)
        held = name in self._records
        if held or len(snapshot) * self.config.disk_token_bytes > self.budget_bytes:
            self.counters["skipped"] += 1
            if held:
                self._records.move_to_end(name)
            return
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps({"v": 1, "tokens": list(snapshot)}), encoding="utf-8")
            os.replace(tmp, self.dir / name)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.counters["skipped"] += 1
            return
        self._records[name] = snapshot
        self.counters["persisted"] += 1
        while self.bytes > self.budget_bytes and len(self._records) > 1:
            old, _ = self._records.popitem(last=False)
            with contextlib.suppress(FileNotFoundError):
                (self.dir / old).unlink()
            self.counters["evicted"] += 1

    def body(self) -> dict[str, Any]:
        """The `/cache` `disk` block."""
        records = list(self._records.values())
        roots = sum(
            1
            for r in records
            if not any(len(o) < len(r) and r[: len(o)] == o for o in records if o is not r)
        )
        return {
            "on": True,
            "records": len(records),
            "lineages": roots,
            "branches": len(records) - roots,
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes,
            **self.counters,
            "restore_ms_total": round(self.restored_bytes / self.config.disk_read_mbps / 1000, 1),
            "restored_bytes": self.restored_bytes,
        }
