"""`snapshot`: save a head's llama.cpp KV state; restore it, proven, or warm instead.

`save_snapshot` warms the head in the slot already holding it, else an idle one; proves with
a pinned fresh-tail check that the slot holds it; saves the slot as the file named by the
head's sha and the build id; hashes it in the server's directory as seen from here; writes
the record and a `snapshot-save` measurement. `restore_and_prove` is
`measure.slots.restore_head`, then a normal warm unless `restored`.

Invariants: nothing is saved without the proven check, and nothing recorded when the server
saved no tokens, the file is not where it saved it, or the build changed meanwhile.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from prefixreg.core.errors import (
    ArgumentValueError,
    EvidenceUnverifiedError,
    UsageError,
    check_progress,
    check_type,
)
from prefixreg.core.frame import Frame, Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.prefix import Prefix
from prefixreg.core.snapshots import SnapshotRecord, snapshot_file_name
from prefixreg.registry.snapshots import digest_snapshot_file, write_snapshot
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.server.slots import require_slot_api, slot_action
from prefixreg.server.worker import Worker, check_worker
from prefixreg.verbs.measure.slots import (
    Progress,
    RestoreResult,
    readable_dir,
    restore_head,
    warm_and_locate,
)
from prefixreg.verbs.measure.trial import Trial
from prefixreg.verbs.measure.warm import warm


def save_snapshot(
    registry: Registry,
    head: Head,
    worker: Worker,
    *,
    slot_dir: Path | str,
    slot: int | None = None,
    progress: Progress = None,
) -> tuple[SnapshotRecord, JSONObject]:
    """Save `head`'s KV state on `worker` and record it, the file hashed in `slot_dir` (the
    server's `--slot-save-path` as seen from here); the record and the `snapshot-save` body.

    Raises:
        UsageError: not a head; a mirror; no slot API; `slot_dir` unreadable or without the file.
        EvidenceUnverifiedError: the slot not shown to hold the head, no tokens saved, or the
            build changed (nothing recorded).
        WorkerError: the worker failed.
    """
    slot_dir = _door("save_snapshot", registry, head, worker, slot_dir, progress)
    say = progress or (lambda _msg: None)
    registry.refuse_on_mirror("record a snapshot")
    if not readable_dir(slot_dir):
        hint = "a snapshot is recorded with its file's hashes: name the server's "
        hint += "--slot-save-path as seen from here"
        raise UsageError(f"--slot-dir {slot_dir}: not a readable directory", hint=hint)
    trial = Trial(registry, worker, head)
    build = trial.build
    require_slot_api(build)
    say(f"warming {head.sha256[:12]} on {worker.url} (build {build.build_id})")
    warmed, chosen = warm_and_locate(trial, slot)
    checked = trial.call("check", slot=chosen.id)
    check, judged = checked.record, checked.judgement
    if not judged.resumed:
        text = f"slot {chosen.id} does not provably hold the head ({judged.verdict}: "
        raise EvidenceUnverifiedError(text + f"{judged.reason}); nothing saved")
    name = snapshot_file_name(head.sha256, build.build_id)
    say(f"saving slot {chosen.id} as {name}")
    transfer = slot_action(worker, chosen.id, "save", name)
    if not transfer.n_tokens:
        text = f"the server reported saving {transfer.n_tokens} tokens from slot {chosen.id}; "
        raise EvidenceUnverifiedError(text + "nothing recorded")
    digests = None
    try:
        digests = digest_snapshot_file(slot_dir, name)
    except FileNotFoundError:
        pass
    if digests is None or transfer.n_bytes not in (None, digests.size):
        text = f"{slot_dir} does not hold {name} as the server just saved it "
        hint = "--slot-dir must be the server's --slot-save-path, as seen from here"
        raise UsageError(text + f"({transfer.n_bytes} bytes)", hint=hint)
    if trial.changed() is not None:
        raise EvidenceUnverifiedError("the server build changed during the save; nothing recorded")
    assert digests.sha256 is not None and digests.blake3 is not None  # noqa: S101 -- asked for
    record = SnapshotRecord(
        sha256=head.sha256,
        build=build,
        file=name,
        file_sha256=digests.sha256,
        file_blake3=digests.blake3,
        file_bytes=digests.size,
        slot_dir=str(slot_dir.resolve()),
        n_saved=transfer.n_tokens,
        n_written=transfer.n_bytes,
        save_ms=transfer.server_ms,
        slot_id=chosen.id,
        slot_ctx=chosen.n_ctx,
        created=iso_utc(utc_now()),
        worker=worker.url,
    )
    body: JSONObject = {
        "verdict": "saved",
        "reason": f"{transfer.n_tokens:,} tokens saved from slot {chosen.id} after a proven check",
        "snapshot": record.to_dict(),
        "record": str(write_snapshot(registry, record)),
        "save": asdict(transfer),
        "calls": [warmed.to_dict(), check.to_dict()],
    }
    return record, trial.finish("snapshot-save", body)[0].body


def restore_and_prove(
    registry: Registry,
    head: Head,
    worker: Worker,
    *,
    slot_dir: Path | str | None = None,
    slot: int | None = None,
    fallback_warm: bool = True,
    progress: Progress = None,
) -> RestoreResult:
    """Restore `head`'s snapshot and prove it; a normal warm follows one not `restored`
    (unless `fallback_warm` is False). Raises as `measure.slots.restore_head`."""
    where = (
        None
        if slot_dir is None
        else _door("restore_and_prove", registry, head, worker, slot_dir, progress)
    )
    check_type(fallback_warm, bool, "restore_and_prove: fallback_warm", "True or False")
    result = restore_head(registry, worker, head, slot_dir=where, slot=slot, progress=progress)
    if result.verdict == "restored" or not fallback_warm:
        return result
    if progress is not None:
        progress("falling back to a normal warm")
    return replace(result, fallback=warm(registry, head, worker, progress=progress))


def _door(
    where: str, registry: object, head: object, worker: object, slot_dir: object, progress: object
) -> Path:
    """The arguments every snapshot call takes, checked once; `slot_dir` as a Path (a str
    path is the obvious call). Raises ArgumentTypeError / ArgumentValueError."""
    check_type(registry, Registry, f"{where}: registry", "a Registry (prefixreg.open_registry())")
    check_type(head, (Prefix, Frame), f"{where}: head", "a Prefix or a Frame (Registry.head)")
    check_worker(worker, f"{where}: worker")
    check_progress(progress, f"{where}: progress")
    check_type(slot_dir, (str, Path), f"{where}: slot_dir", "a directory's path (str or Path)")
    if str(slot_dir) == "" or "\0" in str(slot_dir):
        raise ArgumentValueError(f"{where}: slot_dir is a directory's path, not {slot_dir!r:.80}")
    return Path(str(slot_dir)).expanduser()


def require_slot_dir(slot_dir: Path | None) -> Path:
    """`snapshot save`'s option rule, checked before anything is opened: `--slot-dir` is
    required. Raises UsageError."""
    if slot_dir is None:
        raise UsageError("snapshot save needs --slot-dir: the file's hashes go in the record")
    return slot_dir
