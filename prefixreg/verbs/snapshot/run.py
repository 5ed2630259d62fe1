"""KV snapshots of registered prefixes: save one on a worker, and restore it with proof.

`save_snapshot`: verify the prefix (an `IntegrityError` means nothing is sent), read the
build (`/health` + `/props`), refuse a profile without a slot API (exit 2), warm the
prefix (served by the slot already holding it, found from `/slots`; else pinned to an idle
slot with `id_slot`), prove with a fresh-tail check pinned to that slot that it holds it,
save the slot under a file name derived from the sha and the build id, hash the file when
the server's directory is readable here, re-read the build, and write the record
(`snapshots/<sha>-<build>.json`) and a measurement.

`restore_and_prove`: verify the prefix, read the build, find the record for this prefix on
the worker's *current* build (a record of another build is never used: the output says
which identity fields differ), re-hash the file when its directory is readable here (a
mismatch raises `IntegrityError`, exit 3, before any restore request), restore it into an
idle slot, then send a fresh-tail resume check pinned to that slot. The verdict is
`restored` only when the check's cached count covers the prefix's span (`judge_resume`):
`n_restored` alone is never evidence. A restore the server called a success that did not
resume is said plainly (`not_resumed`), recorded as a measurement, and followed by a normal
warm (unless `fallback_warm=False`).

Verdicts: restored | not_resumed | restore_failed | no_snapshot | unverified.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from prefixreg.core.errors import (
    EvidenceUnverifiedError,
    IntegrityError,
    UsageError,
    WorkerHTTPError,
)
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.core.snapshots import SnapshotRecord, snapshot_file_name
from prefixreg.registry.snapshots import (
    FileDigests,
    digest_snapshot_file,
    list_snapshots,
    read_snapshot,
    write_snapshot,
)
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.server.slots import (
    SlotTransfer,
    idle_slot,
    require_slot_api,
    restore_slot,
    save_slot,
)
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import CallRecord, record_measurement
from prefixreg.verbs.measure.slots import (
    Progress,
    pinned_check,
    readable_dir,
    say_to,
    warm_and_locate,
)
from prefixreg.verbs.measure.warm import WarmResult, warm

__all__ = ["RestoreResult", "RestoreVerdict", "SaveResult", "restore_and_prove", "save_snapshot"]

RestoreVerdict = Literal["restored", "not_resumed", "restore_failed", "no_snapshot", "unverified"]


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What `save_snapshot` did: the record written, the save reply, and the proof calls."""

    record: SnapshotRecord
    record_path: str
    transfer: SlotTransfer
    calls: tuple[CallRecord, ...]
    measurement: Measurement

    def to_dict(self) -> JSONObject:
        return {
            "snapshot": self.record.to_dict(),
            "record": self.record_path,
            "save": self.transfer.to_dict(),
            "calls": [c.to_dict() for c in self.calls],
        }


def save_snapshot(
    registry: Registry,
    ref: str,
    worker: Worker,
    *,
    slot_dir: Path | None = None,
    slot: int | None = None,
    progress: Progress = None,
) -> SaveResult:
    """Save `ref`'s KV state on `worker` and record it (see the module docstring).

    Raises:
        IntegrityError: the prefix does not verify (nothing sent).
        UsageError: a profile without a slot API; `slot_dir` not holding the saved file.
        EvidenceUnverifiedError: the slot could not be shown to hold the prefix, the server
            saved no tokens, or the build changed (nothing recorded).
        WorkerError: the worker failed.
    """
    say = say_to(progress)
    registry.refuse_on_mirror("record a snapshot")
    prefix = registry.get(ref)
    build = worker.server_build()
    require_slot_api(build)
    say(f"warming {prefix.sha256[:12]} on {worker.url} (build {build.build_id})")
    warm, chosen = warm_and_locate(worker, prefix, slot)
    check, verdict, reason, _, _ = pinned_check(worker, prefix, chosen.id)
    if verdict != "resumed":
        raise EvidenceUnverifiedError(
            f"slot {chosen.id} does not provably hold the prefix ({verdict}: {reason}); "
            "nothing saved"
        )
    name = snapshot_file_name(prefix.sha256, build.build_id)
    say(f"saving slot {chosen.id} as {name}")
    transfer = save_slot(worker, chosen.id, name)
    if not transfer.n_tokens:
        raise EvidenceUnverifiedError(
            f"the server reported saving {transfer.n_tokens} tokens from slot {chosen.id}; "
            "nothing recorded"
        )
    digests: FileDigests | None = None
    if slot_dir is not None:
        if not readable_dir(slot_dir):
            raise UsageError(f"--slot-dir {slot_dir}: not a readable directory")
        try:
            digests = digest_snapshot_file(slot_dir, name)
        except FileNotFoundError:
            raise UsageError(
                f"{slot_dir} does not hold {name}, the file the server just saved",
                hint="--slot-dir must be the server's --slot-save-path, as seen from here",
            ) from None
    if worker.server_build().build_id != build.build_id:
        raise EvidenceUnverifiedError("the server build changed during the save; nothing recorded")
    record = SnapshotRecord(
        sha256=prefix.sha256,
        build=build,
        file=name,
        n_saved=transfer.n_tokens,
        n_written=transfer.n_bytes,
        save_ms=transfer.server_ms,
        slot_id=chosen.id,
        slot_ctx=chosen.n_ctx,
        created=iso_utc(utc_now()),
        file_sha256=None if digests is None else digests.sha256,
        file_blake3=None if digests is None else digests.blake3,
        file_bytes=None if digests is None else digests.size,
        slot_dir=None if slot_dir is None else str(slot_dir.resolve()),
        worker=worker.url,
    )
    path = write_snapshot(registry, record)
    body: JSONObject = {
        "verdict": "saved",
        "reason": f"{transfer.n_tokens:,} tokens saved from slot {chosen.id} after a proven check",
        "snapshot": record.to_dict(),
        "save": transfer.to_dict(),
        "calls": [warm.to_dict(), check.to_dict()],
    }
    measurement, _ = record_measurement(
        registry, worker, build, prefix.sha256, "snapshot-save", body
    )
    return SaveResult(
        record=record,
        record_path=str(path),
        transfer=transfer,
        calls=(warm, check),
        measurement=measurement,
    )


# -- restore --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What `restore_and_prove` found. `fallback` is the normal warm run after a restore
    that was not proven (None when it was, or when `fallback_warm` was False)."""

    prefix: Prefix
    worker_url: str
    build: ServerBuild
    verdict: RestoreVerdict
    reason: str
    snapshot: SnapshotRecord | None = None
    file_check: str = "not checked"
    transfer: SlotTransfer | None = None
    check: CallRecord | None = None
    span_tokens: int | None = None
    coverage: float | None = None
    measurement: Measurement | None = None
    record_path: str | None = None
    fallback: WarmResult | None = field(default=None)

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.prefix.sha256,
            "worker": self.worker_url,
            "build": self.build.to_dict(),
            "verdict": self.verdict,
            "reason": self.reason,
            "snapshot": None if self.snapshot is None else self.snapshot.to_dict(),
            "file_check": self.file_check,
            "restore": None if self.transfer is None else self.transfer.to_dict(),
            "check": None if self.check is None else self.check.to_dict(),
            "span_tokens": self.span_tokens,
            "coverage": self.coverage,
            "record": self.record_path,
            "fallback": None if self.fallback is None else self.fallback.receipt(),
        }


def _identity_diff(a: ServerBuild, b: ServerBuild) -> str:
    keys = sorted(set(a.identity) | set(b.identity))
    diff = [k for k in keys if a.identity.get(k) != b.identity.get(k)]
    if a.profile != b.profile:
        diff.insert(0, "profile")
    shown = ", ".join(f"{k} {a.identity.get(k)!r} -> {b.identity.get(k)!r}" for k in diff[:3])
    return shown or "identity differs"


def _no_snapshot_reason(registry: Registry, sha: str, build: ServerBuild) -> str:
    others = list_snapshots(registry, sha)
    if not others:
        return f"no snapshot of {sha[:12]} is recorded"
    latest = others[-1]
    return (
        f"a snapshot exists for build {latest.build_id}, but the worker now runs build "
        f"{build.build_id} ({_identity_diff(latest.build, build)}): a KV state is only "
        "valid on the build that saved it, so it is not used"
    )


def _check_file(record: SnapshotRecord, slot_dir: Path | None) -> str:
    """Re-hash the snapshot file when its directory is readable; IntegrityError on mismatch.

    The record's blake3 is checked when it has one (as strong as sha256, several times
    faster on a 10-30 MB file: this sits on the restore's critical path), else its sha256.
    """
    where = slot_dir or (Path(record.slot_dir) if record.slot_dir else None)
    if where is None or not readable_dir(where):
        return "not checked: the server's snapshot directory is not readable here"
    fast = record.file_blake3 is not None
    try:
        got = digest_snapshot_file(where, record.file, sha256=not fast, blake3=fast)
    except FileNotFoundError:
        raise IntegrityError(
            f"{where / record.file}: the snapshot file is missing; no restore sent"
        ) from None
    algorithm = "blake3" if fast else "sha256"
    expected = record.file_blake3 if fast else record.file_sha256
    actual = got.blake3 if fast else got.sha256
    if expected is None or actual is None:
        return f"hashed ({got.size:,} bytes); the record has no digest to compare"
    if actual != expected or got.size != record.file_bytes:
        raise IntegrityError(
            f"{where / record.file}: {algorithm} {actual[:16]}… ({got.size:,} bytes) does not "
            f"match the record's {expected[:16]}… ({record.file_bytes} bytes); no restore sent",
            path=where / record.file,
            expected=expected,
            actual=actual,
        )
    return f"{algorithm} matched ({got.size:,} bytes)"


def restore_and_prove(
    registry: Registry,
    ref: str,
    worker: Worker,
    *,
    slot_dir: Path | None = None,
    slot: int | None = None,
    fallback_warm: bool = True,
    progress: Progress = None,
) -> RestoreResult:
    """Restore `ref`'s snapshot on `worker` and prove it with a pinned fresh-tail check.

    Raises:
        IntegrityError: the prefix or the snapshot file does not verify (no restore sent).
        UsageError: a profile without a slot API; a mirror registry.
        WorkerError: the worker failed outside the restore request itself.
    """
    say = say_to(progress)
    registry.refuse_on_mirror("record a restore")
    prefix = registry.get(ref)
    build = worker.server_build()
    require_slot_api(build)
    record = read_snapshot(registry, prefix.sha256, build.build_id)
    base = RestoreResult(
        prefix=prefix, worker_url=worker.url, build=build, verdict="no_snapshot", reason=""
    )
    if record is None:
        reason = _no_snapshot_reason(registry, prefix.sha256, build)
        say(reason)
        result = replace(base, reason=reason)
        return _with_fallback(result, registry, ref, worker, fallback_warm, progress)
    file_check = _check_file(record, slot_dir)
    chosen = idle_slot(worker, prefer=slot)
    say(f"restoring {record.file} into slot {chosen.id} ({file_check})")
    try:
        transfer = restore_slot(worker, chosen.id, record.file)
    except WorkerHTTPError as exc:
        body: JSONObject = {
            "verdict": "restore_failed",
            "reason": str(exc),
            "snapshot": record.to_dict(),
        }
        measurement, path = record_measurement(
            registry, worker, build, prefix.sha256, "restore", body
        )
        result = replace(
            base,
            verdict="restore_failed",
            reason=f"the server refused the restore: {exc}",
            snapshot=record,
            file_check=file_check,
            measurement=measurement,
            record_path=str(path),
        )
        return _with_fallback(result, registry, ref, worker, fallback_warm, progress)
    say(f"resume check pinned to slot {chosen.id}")
    check, judged, why, span, coverage = pinned_check(worker, prefix, chosen.id)
    verdict: RestoreVerdict
    if judged == "resumed":
        verdict, reason = "restored", f"proven by the resume check: {why}"
    elif judged == "unverified":
        verdict, reason = "unverified", f"the resume check is unverified: {why}"
    else:
        verdict = "not_resumed"
        reason = (
            f"the server reported restoring {transfer.n_tokens} tokens, but the resume check "
            f"did not resume the prefix ({judged}: {why})"
        )
    if worker.server_build().build_id != build.build_id:
        verdict, reason = "unverified", "the server build changed during the restore"
    ev = check.evidence
    mbody: JSONObject = {
        "verdict": verdict,
        "reason": reason,
        "prefix_bytes": prefix.size,
        "snapshot": {"file": record.file, "build_id": record.build_id, "n_saved": record.n_saved},
        "file_check": file_check,
        "restore": transfer.to_dict(),
        "prompt_tokens": ev.prompt_tokens,
        "cached_tokens": ev.cached_tokens,
        "span_tokens": span,
        "coverage": coverage,
        "calls": [check.to_dict()],
    }
    measurement, path = record_measurement(registry, worker, build, prefix.sha256, "restore", mbody)
    result = replace(
        base,
        verdict=verdict,
        reason=reason,
        snapshot=record,
        file_check=file_check,
        transfer=transfer,
        check=check,
        span_tokens=span,
        coverage=coverage,
        measurement=measurement,
        record_path=str(path),
    )
    if verdict == "restored":
        return result
    say(reason)
    return _with_fallback(result, registry, ref, worker, fallback_warm, progress)


def _with_fallback(
    result: RestoreResult,
    registry: Registry,
    ref: str,
    worker: Worker,
    fallback_warm: bool,
    progress: Progress,
) -> RestoreResult:
    """After a snapshot that was not used or not proven: a normal warm, when asked for."""
    if not fallback_warm:
        return result
    say_to(progress)("falling back to a normal warm")
    return replace(result, fallback=warm(registry, registry.head(ref), worker, progress=progress))
