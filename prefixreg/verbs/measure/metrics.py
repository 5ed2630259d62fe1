"""Prometheus metrics in the node_exporter textfile format (`--metrics-file`): `Metrics`
collects samples; `write_metrics` renders them (exposition format 0.0.4) and replaces the file.

Invariants:
- Names follow Prometheus conventions: a `prefixreg_` prefix, base units (`_seconds`,
  `_tokens`), `_total` on counters; one HELP and one TYPE line per metric, its samples
  grouped under them, sorted, so a file is the same for the same numbers.
- Label values are escaped (backslash, quote, newline); names are checked against the
  exposition grammar; a value is a finite number. A bad name or value is a `UsageError`
  (a bug of ours), never a file node_exporter would reject.
- The file is written with the registry's durable writer (temp, fsync, rename, directory
  fsync), so the collector never reads half a file; a path whose directory does not exist,
  or that holds a directory, FIFO or device, is a `UsageError` before anything runs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prefixreg.core.errors import UsageError
from prefixreg.registry.fsutil import replace_atomic
from prefixreg.registry.userfiles import check_output_file

Kind = Literal["counter", "gauge"]
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(slots=True)
class Metrics:
    """Samples by metric name: `(help, kind)` once per name, any number of labelled values."""

    meta: dict[str, tuple[str, Kind]] = field(default_factory=dict)
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = field(default_factory=dict)

    def set(
        self,
        name: str,
        value: float,
        help_text: str,
        labels: Mapping[str, str] | None = None,
        *,
        kind: Kind = "gauge",
    ) -> None:
        """Record one sample (the last value given for the same labels wins)."""
        labels = labels or {}
        if not _NAME.fullmatch(name) or not name.startswith("prefixreg_"):
            raise UsageError(f"not a prefixreg metric name: {name!r}")
        if kind == "counter" and not name.endswith("_total"):
            raise UsageError(f"a counter's name ends in _total: {name!r}")
        given: object = value  # callers outside the type checker pass anything
        real = isinstance(given, int | float) and not isinstance(given, bool)
        if not real or not math.isfinite(value):
            raise UsageError(f"metric {name}: not a finite number: {value!r}")
        if bad := [k for k in labels if not _LABEL.fullmatch(k) or k.startswith("__")]:
            raise UsageError(f"metric {name}: bad label name(s) {bad}")
        self.meta.setdefault(name, (help_text, kind))
        self.samples.setdefault(name, {})[tuple(sorted(labels.items()))] = float(value)

    def update(self, other: Metrics) -> None:
        """Add `other`'s samples (several keepers' counters in one file, told apart by label)."""
        for name, samples in other.samples.items():
            self.meta.setdefault(name, other.meta[name])
            self.samples.setdefault(name, {}).update(samples)

    def render(self) -> bytes:
        """The text exposition format, one block per metric, sorted."""
        lines: list[str] = []
        for name in sorted(self.samples):
            help_text, kind = self.meta[name]
            lines.append(f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2)}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in sorted(self.samples[name].items()):
                inside = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                shown = repr(value) if not value.is_integer() else str(int(value))
                lines.append(f"{name}{{{inside}}} {shown}" if inside else f"{name} {shown}")
        return ("\n".join(lines) + "\n").encode("utf-8")


def check_metrics_path(path: Path | None) -> Path | None:
    """`path` if a metrics file may be written there (`userfiles.check_output_file`: its
    directory exists, no directory, FIFO or device in its place), else `UsageError`."""
    return None if path is None else check_output_file(path, "--metrics-file")


def write_metrics(path: Path, metrics: Metrics) -> None:
    """Replace `path` with the rendered metrics, atomically and durably."""
    replace_atomic(check_metrics_path(path) or path, metrics.render(), mode=0o644)
