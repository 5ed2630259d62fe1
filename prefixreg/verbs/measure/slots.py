"""KV snapshot calls on one llama.cpp slot (a warm that finds its slot, a pinned check), and
the restore with its proof: verify the record and its file, erase the slot (the baseline),
restore, check, and record `core.judge.judge_restore`'s verdict as a `restore` measurement.

Invariants:
- A check is pinned with `id_slot`, so its cached count speaks of that slot alone.
- `restored` needs the erase (an erase reply without its count is no baseline:
  `unverified`), `n_restored` > 0 and a resumed pinned check; `n_restored` alone is never
  evidence. An erase does not clear llama-server's host-RAM prompt cache (`--cache-ram`).
- Nothing is sent before the record and its file verify: a record of another build is never
  used (the reason names the identity fields that differ); the file is re-hashed (blake3,
  size) in `--slot-dir` or the record's directory; unreadable, missing or changed is an
  `IntegrityError` (exit 3).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from prefixreg.core.errors import IntegrityError, UsageError
from prefixreg.core.frame import Frame, Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import Judgement
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import ServerBuild
from prefixreg.core.snapshots import SnapshotRecord
from prefixreg.registry.snapshots import digest_snapshot_file, list_snapshots, read_snapshot
from prefixreg.registry.store import Registry
from prefixreg.server.slots import SlotInfo, SlotTransfer, idle_slot, list_slots, require_slot_api
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import CallRecord
from prefixreg.verbs.measure.trial import Trial
from prefixreg.verbs.measure.warm import WarmResult, warm

Progress = Callable[[str], None] | None


def readable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.R_OK | os.X_OK)


def warm_and_locate(trial: Trial, slot: int | None) -> tuple[CallRecord, SlotInfo]:
    """The trial's warm call and the slot that served it: the one whose `id_task` moved
    (llama.cpp serves a prompt from the slot sharing most of it). Ambiguous (several moved,
    or it is not known idle) or `slot` given: the warm is pinned to an idle slot instead."""
    worker = trial.worker
    if slot is None:
        before = {s.id: s.id_task for s in list_slots(worker)}
        warm = trial.call("warm").record
        moved = [s for s in list_slots(worker) if s.id_task != before.get(s.id)]
        if len(moved) == 1 and moved[0].idle:
            return warm, moved[0]
    chosen = idle_slot(worker, prefer=slot)
    return trial.call("warm", slot=chosen.id).record, chosen


def warm_copies(worker: Worker, head: Head, copies: int) -> list[tuple[int, Judgement]]:
    """Keep `copies` of `head`, one per llama.cpp slot (one per concurrent loop call): a warm
    pinned to each of the first `copies` slots, proven by a pinned check there: (slot, the
    judge's verdict on its check) per copy.

    Raises:
        UsageError: a profile without slots, or fewer slots than `copies`.
        WorkerError: the worker failed.
    """
    trial = Trial(None, worker, head)
    require_slot_api(trial.build)
    slots = list_slots(worker)
    if type(copies) is not int or not 1 <= copies <= len(slots):
        raise UsageError(f"{copies!r} copies on {len(slots)} slots: at most one per slot")
    out = []
    for slot in slots[:copies]:
        trial.call("warm", slot=slot.id)
        out.append((slot.id, trial.call("check", slot=slot.id).judgement))
    return out


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What `restore_head` found; `body` is its measurement's (only verdict and reason when
    nothing was sent); `fallback` the warm a caller ran after a restore not proven."""

    head: Head
    worker_url: str
    build: ServerBuild
    verdict: str  # a `core.judge.RestoreVerdict`, or no_snapshot | restore_failed
    reason: str
    body: JSONObject
    snapshot: SnapshotRecord | None = None
    file_check: str = "not checked"
    transfer: SlotTransfer | None = None
    check: CallRecord | None = None
    record_path: str | None = None
    fallback: WarmResult | None = None

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.head.sha256,
            "kind": self.head.kind,
            "worker": self.worker_url,
            "build": self.build.to_dict(),
            "restore": None,
            **self.body,
            "check": None if self.check is None else self.check.to_dict(),
            "record": self.record_path,
            "fallback": None if self.fallback is None else self.fallback.receipt(),
        }


def _no_snapshot_reason(registry: Registry, sha: str, build: ServerBuild) -> str:
    others = list_snapshots(registry, sha)
    if not others:
        return f"no snapshot of {sha[:12]} is recorded"
    a, b = others[-1].build, build
    keys = sorted({*a.identity, *b.identity})
    diff = ["profile"] * (a.profile != b.profile)
    diff += [k for k in keys if a.identity.get(k) != b.identity.get(k)]
    shown = ", ".join(f"{k} {a.identity.get(k)!r} -> {b.identity.get(k)!r}" for k in diff[:3])
    text = f"a snapshot exists for build {a.build_id}, but the worker now runs build "
    text += f"{b.build_id} ({shown or 'identity differs'}): a KV state is only valid on the build "
    return text + "that saved it, so it is not used"


def check_file(record: SnapshotRecord, slot_dir: Path | None) -> str:
    """Re-hash the snapshot file in `slot_dir`, else the record's directory: blake3 and size
    (as strong as sha256, several times faster on the restore's critical path).

    Raises:
        UsageError: `slot_dir` is not a readable directory.
        IntegrityError: the record's directory is unreadable here; the file is missing, not
            a regular file, or does not match the record.
    """
    if slot_dir is not None and not readable_dir(slot_dir):
        raise UsageError(f"--slot-dir {slot_dir}: not a readable directory")
    where = slot_dir or Path(record.slot_dir)
    path = where / record.file
    if not readable_dir(where):
        text = f"{where}: the record's snapshot directory is not readable here, so the file "
        text += "cannot be checked; no restore sent (--slot-dir names where it is)"
        raise IntegrityError(text, path=where)
    try:
        got = digest_snapshot_file(where, record.file, sha256=False)
    except FileNotFoundError:
        raise IntegrityError(f"{path}: the snapshot file is missing; no restore sent") from None
    if got.blake3 != record.file_blake3 or got.size != record.file_bytes:
        text = f"{path}: blake3 {str(got.blake3)[:16]}… ({got.size:,} bytes) does not match "
        text += f"the record's {record.file_blake3[:16]}… ({record.file_bytes:,} bytes); "
        text += "no restore sent"
        raise IntegrityError(text, path=path, expected=record.file_blake3, actual=got.blake3)
    return f"blake3 matched ({got.size:,} bytes)"


def restore_head(
    registry: Registry,
    worker: Worker,
    head: Head,
    *,
    slot_dir: Path | None = None,
    slot: int | None = None,
    progress: Progress = None,
) -> RestoreResult:
    """Restore `head`'s snapshot for the worker's build into an idle slot (`slot` if it is)
    and prove it (module docstring). Never warms.

    Raises:
        IntegrityError: the record or the snapshot file does not verify (nothing sent).
        UsageError: not a head; a profile without a slot API; a mirror; a bad `slot_dir`.
        WorkerError: the worker failed outside the erase and restore requests.
    """
    if not isinstance(head, Prefix | Frame):
        raise UsageError(f"restore takes a Prefix or a Frame (Registry.head), not {head!r:.40}")
    say = progress or (lambda _msg: None)
    registry.refuse_on_mirror("record a restore")
    trial = Trial(registry, worker, head)
    build = trial.build
    require_slot_api(build)
    record = read_snapshot(registry, head.sha256, build.build_id)
    result = RestoreResult(head, worker.url, build, "no_snapshot", "", {})
    if record is None:
        reason = _no_snapshot_reason(registry, head.sha256, build)
        return replace(result, reason=reason, body={"verdict": "no_snapshot", "reason": reason})
    file_check = check_file(record, slot_dir)
    chosen = idle_slot(worker, prefer=slot)
    say(f"erasing slot {chosen.id}, then restoring {record.file} into it ({file_check})")
    result = replace(result, snapshot=record, file_check=file_check)
    body: JSONObject = {"snapshot": record.to_dict(), "file_check": file_check}
    restored = trial.restore(chosen.id, record.file)
    verdict, reason = restored.verdict, restored.reason
    if restored.check is not None and restored.erased and restored.transfer:
        verdict, reason = trial.same_build(verdict, reason)
        check = restored.check.record
        body |= restored.check.judgement.to_dict() | {
            "prefix_bytes": head.system.size,
            "head_bytes": head.head_bytes,
            "erase": asdict(restored.erased),
            "restore": asdict(restored.transfer),
            "prompt_tokens": check.evidence.prompt_tokens,
            "cached_tokens": check.evidence.cached_tokens,
            "calls": [check.to_dict()],
        }
        result = replace(result, transfer=restored.transfer, check=check)
    body |= {"verdict": verdict, "reason": reason}
    measurement, path = trial.finish("restore", body)
    say(f"{verdict}: {reason}")
    body = measurement.body  # with the frame it names
    return replace(result, verdict=verdict, reason=reason, body=body, record_path=str(path))


@dataclass(frozen=True, slots=True)
class WarmCopies:
    """A `warm` and, with `copies` above 1, each further copy's pinned check (slot, verdict).
    Its outcome is the warm's verdict, or, when that resumed, the first copy not resumed."""

    warm: WarmResult
    kept: list[tuple[int, Judgement]]
    public: bool = False

    @property
    def outcome(self) -> str:
        if self.warm.verdict != "resumed":
            return self.warm.verdict
        return next((j.verdict for _, j in self.kept if not j.resumed), self.warm.verdict)

    def to_dict(self) -> JSONObject:
        """The `--json` receipt (`public`: without the worker address and model)."""
        out = self.warm.receipt(public=self.public)
        if self.kept:
            out["copies"] = [{"slot": i, **j.to_dict()} for i, j in self.kept]
        return out

    def text(self, _exit_code: int = 0) -> str:
        lines = "".join(f"copy in slot {i}: {j.verdict} ({j.reason})\n" for i, j in self.kept)
        return self.warm.summary() + lines


def warm_with_copies(
    registry: Registry,
    head: Head,
    worker: Worker,
    *,
    check: bool,
    send_warm: bool,
    copies: int = 1,
    public: bool = False,
    progress: Progress = None,
) -> WarmCopies:
    """`warm`, then (`copies` above 1) `warm_copies`; raises as they do."""
    result = warm(registry, head, worker, check=check, send_warm=send_warm, progress=progress)
    kept = [] if copies == 1 else warm_copies(worker, head, copies)
    return WarmCopies(result, kept, public)
