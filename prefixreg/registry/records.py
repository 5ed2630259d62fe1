"""`Records`: the history verbs keep in a registry: measurements, probe receipts, the mirror
log. (Frame records live with the objects, KV snapshot records in `snapshots`.)

Invariants:
- Measurements and probe receipts are published with no-overwrite links (mode 0444), never
  through a symlinked directory; a taken name is retried with a fresh stamp, never replaced.
- A measurement is read strictly, with the depth-capped JSON reader: a record whose file name
  disagrees with its sha, or that does not parse, is a `CorruptRecordError` (fail closed).
- `mirror.log` lines are appended whole or not at all (`fsutil.append_line`).
- A probe receipt lists every call with the sha256 of what it sent: `receipt_refs` reads
  them, so `gc --prune-unnamed` keeps the slices a receipt names, as it keeps a name's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import CorruptRecordError, PrefixregError, UsageError
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.disk import Disk

if TYPE_CHECKING:
    from prefixreg.core.records import Measurement


class Records:
    """Measurements, probe receipts and the mirror log below a `Disk` (see `Registry`)."""

    def __init__(self, disk: Disk) -> None:
        self._disk = disk

    def write_measurement(self, measurement: Measurement) -> Path:
        from prefixreg.core.records import Measurement

        if not isinstance(measurement, Measurement):
            raise UsageError(f"not a Measurement: {type(measurement).__name__}")
        directory = self._disk.mkdir(layout.MEASUREMENTS)
        data = dumps_canonical(measurement.to_dict()) + b"\n"
        for _ in range(100):
            stamp = layout.stamp_utc(layout.utc_now())
            path = directory / layout.measurement_filename(measurement.sha256, stamp)
            if fsutil.publish_new(path, data, mode=0o444):
                return path
        raise PrefixregError(f"no free measurement file name for {measurement.sha256}")

    def measurements(self, sha: str | None = None) -> list[Measurement]:
        if sha is not None:
            layout.need_sha(sha)
        out = [
            self.load_measurement(entry)
            for entry, _kind in self._disk.entries(layout.MEASUREMENTS)
            if not layout.is_temp_name(entry) and entry.endswith(".json")
            if sha is None or layout.measurement_sha(entry) == sha
        ]
        return sorted(out, key=lambda m: m.at)

    def load_measurement(self, filename: str) -> Measurement:
        """One record by its file name in `measurements/`, parsed strictly. Raises:
        CorruptRecordError (see the module invariants), IntegrityError (not a regular file)."""
        from prefixreg.core.records import Measurement

        rel = f"{layout.MEASUREMENTS}/{filename}"
        record = self._disk.record(rel, Measurement.from_dict)
        if layout.measurement_sha(filename) != record.sha256:
            path = self._disk.path(rel)
            raise CorruptRecordError(f"{path}: records sha {record.sha256}", path=path)
        return record

    def write_probe_receipt(
        self, stamp: str, render: Callable[[Path, Path], tuple[bytes, bytes]]
    ) -> tuple[Path, Path]:
        directory = self._disk.mkdir(layout.PROBES)
        for attempt in range(100):
            name = stamp if attempt == 0 else layout.stamp_utc(layout.utc_now())
            json_path, md_path = (directory / n for n in layout.probe_filenames(name))
            receipt, verdict = render(json_path, md_path)
            if not fsutil.publish_new(md_path, verdict, mode=0o444):
                continue
            if fsutil.publish_new(json_path, receipt, mode=0o444):
                return json_path, md_path
            md_path.unlink()  # the receipt's name was taken: its verdict goes with it
        raise PrefixregError(f"no free probe receipt name for {stamp}")

    def _receipts(self) -> Iterator[tuple[Path, bytes | None]]:
        """Every receipt file, newest first, with its bytes (None: unreadable)."""
        for entry, kind in reversed(self._disk.entries(layout.PROBES)):
            if kind == "file" and not layout.is_temp_name(entry) and entry.endswith(".json"):
                rel = f"{layout.PROBES}/{entry}"
                try:
                    raw: bytes | None = self._disk.read(rel)
                except (OSError, PrefixregError):
                    raw = None
                yield self._disk.path(rel), raw

    def probe_receipts(self) -> list[tuple[Path, bytes]]:
        return [(path, raw) for path, raw in self._receipts() if raw is not None]

    def receipt_refs(self) -> tuple[set[str], bool]:
        """(every sha the receipts' calls name, whether some receipt could not be read or
        parsed: a caller deciding what to delete must then keep every probe slice)."""
        found = [None if raw is None else receipt_shas(raw) for _path, raw in self._receipts()]
        return set().union(*(shas for shas in found if shas is not None)), None in found

    def append_mirror_log(self, line: bytes) -> None:
        fsutil.append_line(self._disk.path(layout.MIRROR_LOG), line, root=self._disk.root)


def receipt_shas(raw: bytes) -> set[str] | None:
    """The shas a probe receipt's calls name, or None when it does not parse."""
    try:
        calls = loads_object(raw).get("calls")
    except CorruptRecordError:
        return None
    if not isinstance(calls, list):
        return None
    shas = (call.get("sha256") if isinstance(call, dict) else None for call in calls)
    return {sha for sha in shas if isinstance(sha, str) and is_full_sha(sha)}
