"""keepalive on llama.cpp: bring a head lost to a server restart back from its snapshot.

After a restart every slot is empty: instead of re-prefilling a head with a snapshot for
the worker's *current* build, the keeper restores it (`measure.slots.restore_head`, never a
warm) and the pinned check is the re-warm's call. `SnapshotRewarm` sets the restore's cost
(server time plus the check's wall time and uncached tokens) against a re-prefill's (the
head's tokens, and the newest cold call of it on this build, None when none was).

Invariants:
- Only `restored` replaces the re-warm; anything else (no snapshot for this build, refused,
  not proven, a record or file that does not verify) is reported, then a normal re-warm.
- The restore goes into a slot no other kept head is known to hold.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass

from prefixreg.core.errors import CorruptRecordError, IntegrityError, WorkerError
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import CallEvidence
from prefixreg.registry.snapshots import list_snapshots
from prefixreg.registry.store import Registry
from prefixreg.server.slots import list_slots
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import CallRecord
from prefixreg.verbs.measure.slots import restore_head


@dataclass(frozen=True, slots=True)
class SnapshotRewarm:
    """One attempt to restore a lost head: the verdict, and tokens and seconds each way.
    `check` is the pinned resume check when `restored` (the keeper's re-warm call)."""

    verdict: str
    reason: str
    slot: int | None = None
    restore_s: float | None = None  # the server's restore time plus the check's wall time
    restore_tokens: int | None = None  # tokens the check computed (its uncached part)
    prefill_tokens: int | None = None  # head tokens a re-prefill would have computed
    prefill_s: float | None = None  # the newest cold call of this head on this build
    check: CallRecord | None = None

    @property
    def restored(self) -> bool:
        return self.verdict == "restored" and self.check is not None

    def to_dict(self) -> JSONObject:
        out = asdict(self)
        del out["check"]
        return out


def _free_slot(worker: Worker, taken: Collection[int]) -> int | None:
    """The first idle slot not `taken` by another kept head (None: let the server pick)."""
    try:
        free = [s.id for s in list_slots(worker) if s.idle and s.id not in taken]
    except WorkerError:
        return None
    return free[0] if free else None


def _last_cold_s(registry: Registry, sha: str, build_id: str) -> float | None:
    """Wall seconds of the newest cold call of `sha` measured on `build_id`, or None."""
    for m in reversed(registry.measurements(sha)):
        calls = m.body.get("calls") if m.build.build_id == build_id else None
        for call in calls if isinstance(calls, list) else []:
            try:
                ev = CallEvidence.from_dict(call.get("evidence") if isinstance(call, dict) else 0)
            except CorruptRecordError:
                continue
            if ev.cache_state == "cold" and ev.wall_s is not None:
                return ev.wall_s
    return None


def restore_for_keepalive(
    registry: Registry, worker: Worker, head: Head, *, taken: Collection[int] = ()
) -> SnapshotRewarm | None:
    """Restore `head`'s snapshot for the worker's current build and prove it; never warms
    (the keeper does). None, and no request sent, when the head has no snapshot record.

    Raises:
        WorkerError: the worker failed outside the restore requests (the keeper's error path).
    """
    try:
        if not list_snapshots(registry, head.sha256):
            return None
        result = restore_head(registry, worker, head, slot=_free_slot(worker, taken))
    except IntegrityError as exc:  # a record or file that does not verify: nothing was sent
        return SnapshotRewarm("integrity", str(exc))
    ev = None if result.check is None else result.check.evidence
    t = result.transfer
    restore_s = uncached = None
    if t is not None and t.server_ms is not None and ev is not None and ev.wall_s is not None:
        restore_s = t.server_ms / 1000 + ev.wall_s
    if ev is not None and ev.prompt_tokens is not None and ev.cached_tokens is not None:
        uncached = ev.prompt_tokens - ev.cached_tokens
    return SnapshotRewarm(
        result.verdict,
        result.reason,
        slot=None if t is None else t.slot_id,
        restore_s=restore_s,
        restore_tokens=uncached,
        prefill_tokens=None if ev is None else ev.cached_tokens,
        prefill_s=_last_cold_s(registry, head.system.sha256, result.build.build_id),
        check=result.check if result.verdict == "restored" else None,
    )
