"""The registry's read-side views: what `show` and `ls` present, gathered and decided here.

`show_view` resolves a reference once (`Registry.head`: verified), collects its names, its
own measurements (a frame's, or the bare prefix's: never the other's), its legacy records
and the build its measurements are judged against; `list_view` picks the rows `ls` lists.
The CLI only renders these typed results (text or `to_dict`) and maps nothing else.

Invariants:
- Nothing is written; every object read is verified by the store.
- A build is called current only as the worker says it now: a worker the caller named that
  does not answer is an error (`WorkerError`); one named only by the environment is a
  `note` and then no build is current (the newest measured one stands in, so labelled).
- Probe slices are hidden from `ls` unless asked (`--all`, `--probe`) or named: a name
  makes one the user's; `hidden` counts the rest (0 when only slices are asked for).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prefixreg.core.errors import CorruptRecordError, WorkerError
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import loads
from prefixreg.registry.layout import frame_relpath

if TYPE_CHECKING:
    from prefixreg.core.records import Measurement
    from prefixreg.registry.objects import ObjectInfo
    from prefixreg.registry.store import Registry


def legacy_dict(rel: str, raw: bytes) -> dict[str, object]:
    """A legacy record for `--json`: its path and parsed JSON (null: not JSON, `text` then)."""
    try:
        return {"path": rel, "record": loads(raw)}
    except CorruptRecordError:
        return {"path": rel, "record": None, "text": raw.decode("utf-8", "replace")}


@dataclass(frozen=True, slots=True)
class ShowView:
    """What `show` presents of one prefix or frame.

    `rows` are the text rows in order (values unescaped: the renderer escapes them);
    `fields` the kind's own JSON keys. `build` is the build measurements are judged
    against: the worker's when `from_worker`, else the newest measured one (or None).
    `latest` is the newest measurement on that build, a clean one preferred (one that
    foreign calls interleaved with proves little); `latest_clean` says which it is.
    """

    sha256: str
    kind: str
    path: Path
    names: list[str]
    rows: dict[str, str]
    fields: dict[str, object]
    measurements: list[Measurement]
    legacy: list[tuple[str, bytes]]
    newest_build: str | None
    build: str | None
    from_worker: bool
    latest: Measurement | None
    latest_clean: bool
    note: str | None = None  # for stderr: why no build is current after all

    def to_dict(self) -> dict[str, object]:
        """The `--json` document."""
        head = {"sha256": self.sha256, "kind": self.kind, "path": str(self.path)}
        return (
            head
            | {"names": self.names, **self.fields}
            | {"current_build": self.build if self.from_worker else None}
            | {"newest_build": self.newest_build}
            | {"measurements": [m.to_dict() for m in self.measurements]}
            | {"legacy": [legacy_dict(rel, raw) for rel, raw in self.legacy]}
        )


def _worker_build(url: str, *, asked: bool) -> tuple[str | None, str | None]:
    """(the build the worker at `url` runs, None) or, when only the environment named it and
    it did not answer, (None, a note saying so)."""
    from prefixreg.server.worker import Worker

    try:
        with Worker(url) as w:
            return w.server_build().build_id, None
    except WorkerError as exc:
        if asked:
            raise
        return None, f"$PREFIXREG_WORKER did not answer ({exc}); no build is current"


def show_view(
    reg: Registry, ref: str, *, worker: str | None = None, env_worker: str | None = None
) -> ShowView:
    """The view of `ref`; `worker` (named by the caller) or else `env_worker` (from
    `$PREFIXREG_WORKER`) says which build is current. Raises: what `Registry.head` raises;
    WorkerError (a `worker` named that did not answer)."""
    head = reg.head(ref)
    sha, system = head.sha256, head.system
    names = sorted(n for n, s in reg.names().items() if s == sha)
    of = sha if isinstance(head, Frame) else None  # a frame's measurements, or the prefix's
    measurements = [m for m in reg.measurements(system.sha256) if m.outcome.frame == of]
    newest = measurements[-1].build.build_id if measurements else None
    build, note, url = newest, None, worker or env_worker or None
    if url is not None:
        answered, note = _worker_build(url, asked=worker is not None)
        build = answered if note is None else newest
    fields: dict[str, object]
    if isinstance(head, Frame):
        path, tools = reg.root / frame_relpath(sha), head.tools_sha256
        fields = {"system": system.sha256, "tools": tools, "settings": head.settings}
        rows = {"system": f"{system.sha256} ({system.size} bytes)", "tools": tools or "-"}
        rows["settings"] = head.settings_json.decode()
        if head.lead_sha256 is not None:
            fields["messages"] = rows["messages"] = head.lead_sha256
        legacy = []
    else:
        meta, path = reg.meta(sha), reg.object_path(sha)
        fields = {"meta": meta.to_dict()}
        rows = {"bytes": str(meta.bytes), "created": meta.created, "source": meta.source}
        rows |= {"note": meta.note} if meta.note else {}
        legacy = reg.legacy_records(sha)
    rows = {"sha256": sha, "kind": head.kind, **rows, "names": ", ".join(names) or "-"}
    current = [m for m in measurements if m.build.build_id == build]
    clean = [m for m in current if not m.outcome.interleaved]
    return ShowView(
        sha256=sha,
        kind=head.kind,
        path=path,
        names=names,
        rows=rows | {"path": str(path)},
        fields=fields,
        measurements=measurements,
        legacy=legacy,
        newest_build=newest,
        build=build,
        from_worker=url is not None and note is None,
        latest=(clean or current)[-1] if current else None,
        latest_clean=bool(clean),
        note=note,
    )


@dataclass(frozen=True, slots=True)
class ListView:
    """What `ls` lists (`rows`, in the store's order) and how many probe slices it hid."""

    rows: list[ObjectInfo] = field(default_factory=list)
    hidden: int = 0

    def to_dict(self) -> list[dict[str, object]]:
        """The `--json` document: a list of rows, names as a list."""
        return [o._asdict() | {"names": list(o.names)} for o in self.rows]


def list_view(reg: Registry, *, show_all: bool = False, probe: bool = False) -> ListView:
    """Prefixes and frames (`show_all`: probe slices too; `probe`: only those)."""
    everything = reg.list_objects(frames=True)
    if probe:
        return ListView([o for o in everything if o.probe_slice])
    rows = [o for o in everything if show_all or not o.probe_slice or o.names]
    return ListView(rows, len(everything) - len(rows))
