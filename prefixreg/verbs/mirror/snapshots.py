"""Snapshots travel: a KV snapshot proven on one worker reaches the workers of the same build
through the mirror's transport (rsync, over ssh for a remote directory): the saving worker's
slot directory -> the coordinator -> each destination's slot directory. One prefill per
build per fleet; `warm --restore` on a destination proves the restore as usual.

Invariants:
- A destination gets only the file of the record for its own worker's build, read now
  (`registry.snapshots`; the file name holds the head's sha and the build id): a worker of
  another build gets nothing (`no_snapshot`), so another build's file is never shipped.
- The file is hashed on arrival at the coordinator (sha256, blake3 and size against the
  record) before it is sent anywhere: a mismatch is an `IntegrityError`, nothing is sent.
- At each destination it is hashed again, there (`sha256sum`, over ssh for a remote one);
  `content` is `judge_copy`'s verdict. rsync writes a temp file and renames it, so a worker
  never finds a half-written snapshot under its final name.
- One destination failing (worker, ssh, rsync, a wrong hash there) never stops the others.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixreg.core.errors import (
    ArgumentValueError,
    IntegrityError,
    MirrorError,
    UsageError,
    WorkerError,
    check_progress,
    check_type,
)
from prefixreg.core.frame import Frame, Head
from prefixreg.core.judge import CopyVerdict, judge_copy
from prefixreg.core.prefix import Prefix
from prefixreg.core.snapshots import SnapshotRecord
from prefixreg.registry.snapshots import digest_snapshot_file, read_snapshot
from prefixreg.registry.store import Registry
from prefixreg.registry.userfiles import check_output_file
from prefixreg.server.worker import Worker, check_worker
from prefixreg.verbs.mirror import rsync
from prefixreg.verbs.mirror.rsync import Destination, parse_destination


@dataclass(slots=True)
class ShipResult:
    """One destination: `result` shipped | no_snapshot | failed; `content` the judge's."""

    destination: str
    worker: str
    build_id: str | None = None
    file: str | None = None
    result: str = "failed"
    content: CopyVerdict = "unchecked"
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    to_dict = asdict


@dataclass(slots=True)
class ShipReport:
    """Every destination's `ShipResult`, in `--to` order, and the verdict of the whole."""

    results: list[ShipResult]

    @property
    def outcome(self) -> str:
        """`mirror_failed` when a destination whose worker answered failed (the copy did),
        else `worker_error` when one failed (its worker did not answer), else `no_snapshot`
        when one was not shipped, else `ok`."""
        failed = [r for r in self.results if r.result == "failed"]
        if any(r.build_id is not None for r in failed):  # it answered: the copy failed
            return "mirror_failed"
        if failed:
            return "worker_error"
        return "ok" if all(r.result == "shipped" for r in self.results) else "no_snapshot"

    def to_list(self) -> list[dict[str, object]]:
        return [r.to_dict() for r in self.results]


def check_ship_targets(to: Sequence[str], workers: Sequence[str]) -> None:
    """`snapshot ship`'s option rules, before a worker is asked: one `--worker` per `--to`,
    and no destination inside a registry root (`check_destinations`). Raises UsageError."""
    if len(to) != len(workers):
        raise UsageError(f"{len(to)} --to but {len(workers)} --worker: give one worker each")
    check_destinations(to)


def ship_snapshot(
    registry: Registry,
    head: Head,
    targets: Sequence[tuple[str, Worker]],
    *,
    source: str | None = None,
    ssh_options: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> list[ShipResult]:
    """Ship `head`'s snapshot to each (slot directory, its worker) of `targets` from `source`
    (PATH or [user@]HOST:PATH; default the directory each record was saved in).

    Raises:
        UsageError: not a head, no target, or a malformed ssh option.
        CorruptRecordError: a snapshot record does not parse (nothing sent).
        MirrorError: a bad directory, or the file could not be fetched.
        IntegrityError: the file as fetched does not match its record (nothing sent).
    """
    where = "ship_snapshot"
    check_type(registry, Registry, f"{where}: registry", "a Registry (prefixreg.open_registry())")
    check_type(head, (Prefix, Frame), f"{where}: head", "a Prefix or a Frame (Registry.head)")
    check_progress(progress, f"{where}: progress")
    check_type(targets, (list, tuple), f"{where}: targets", "a list of (directory, Worker) pairs")
    for n, pair in enumerate(targets):
        check_type(pair, tuple, f"{where}: targets[{n}]", "a (directory, Worker) pair")
        if len(pair) != 2:
            raise ArgumentValueError(f"{where}: targets[{n}] is a (directory, Worker) pair")
        check_type(pair[0], str, f"{where}: targets[{n}][0]", "a directory, PATH or HOST:PATH")
        check_worker(pair[1], f"{where}: targets[{n}][1]")
    if not targets:
        raise UsageError("ship needs a destination: --to DIR with its --worker URL")
    checked = check_destinations([d for d, _w in targets])  # before a worker is asked
    dests = list(zip(checked, [w for _d, w in targets], strict=True))
    ssh = rsync.build_ssh_command(rsync.parse_ssh_options(ssh_options), control_path=None)
    results = [ShipResult(dest.raw, w.url) for dest, w in dests]
    records: dict[str, SnapshotRecord | None] = {}
    for (_dest, worker), result in zip(dests, results, strict=True):
        try:
            result.build_id = worker.server_build().build_id
        except WorkerError as exc:
            result.error = f"worker {worker.url}: {exc}"
            continue
        records[result.build_id] = read_snapshot(registry, head.sha256, result.build_id)
    with tempfile.TemporaryDirectory(prefix="prxs-") as staging:
        for record in filter(None, records.values()):  # all of them, before anything is sent
            _fetch(record, source, Path(staging), ssh)
        for (dest, _worker), result in zip(dests, results, strict=True):  # the long loop
            if progress is not None:
                progress(f"shipping to {dest.raw}")
            found = records.get(result.build_id or "")
            if result.error is None and found is None:
                result.result = "no_snapshot"
                result.error = f"no snapshot of {head.sha256[:12]} on build {result.build_id}"
            elif result.error is None and found is not None:
                _send(found, dest, Path(staging), ssh, result)
    return results


def check_destinations(dirs: Sequence[str]) -> list[Destination]:
    """Each `--to` parsed; a local one that lands inside a registry root (or is not a
    directory) is refused before anything is sent (`userfiles.check_output_file`): a shipped
    file never lands in `objects/`. A remote one is the far host's to guard. Raises
    UsageError."""
    out = []
    for d in dirs:
        dest = parse_destination(d)
        if dest.host is None:
            check_output_file(Path(dest.path), "the ship destination", directory=True)
        out.append(dest)
    return out


def _fetch(record: SnapshotRecord, source: str | None, staging: Path, ssh: list[str]) -> None:
    """Bring the record's file to `staging` and hash it against the record."""
    src = parse_destination(source or record.slot_dir)
    rsh = ssh if src.host is not None else None
    rsync.run(rsync.build_rsync_argv("file", src.target(record.file), str(staging), rsh=rsh))
    try:
        got = digest_snapshot_file(staging, record.file)
    except FileNotFoundError:  # rsync skips a symlink or special file
        raise MirrorError(f"{src.target(record.file)}: not a regular file there") from None
    want = (record.file_sha256, record.file_blake3, record.file_bytes)
    if (got.sha256, got.blake3, got.size) != want:
        text = f"{src.target(record.file)} arrived with sha256 {str(got.sha256)[:16]}… "
        text += f"({got.size:,} bytes), its record says {record.file_sha256[:16]}… "
        text += f"({record.file_bytes:,} bytes): changed at the source or in transit; nothing sent"
        where = staging / record.file
        raise IntegrityError(text, path=where, expected=record.file_sha256, actual=got.sha256)


def _send(
    record: SnapshotRecord, dest: Destination, staging: Path, ssh: list[str], result: ShipResult
) -> None:
    """Send the checked file to `dest` and hash it there; the outcome goes into `result`."""
    began, rsh = time.monotonic(), ssh if dest.host is not None else None
    result.file = record.file
    try:
        staged = str(staging / record.file)
        rsync.run(rsync.build_rsync_argv("file", staged, dest.target(record.file), rsh=rsh))
        where = f"{dest.path.rstrip('/')}/{record.file}"  # both checked: no shell quoting needed
        argv = ["sha256sum", "--", where]
        if rsh is not None:
            argv = [*rsh, dest.ssh_host, f"sha256sum -- {where}"]
        digest = rsync.run(argv)[:64].decode("ascii", "replace")
    except MirrorError as exc:
        result.error = str(exc)
    else:
        result.content = judge_copy(hashed=True, matched=digest == record.file_sha256)
        if result.content == "verified":
            result.result, result.bytes = "shipped", record.file_bytes
        else:
            result.error = f"{where} hashes to {digest[:16]}… there, not {record.file_sha256[:16]}…"
    result.seconds = time.monotonic() - began
