"""keepalive on llama.cpp: bring a prefix lost to a server restart back from its snapshot.

After a restart every slot is empty, so a re-warm would re-prefill the whole prefix. When
the registry holds a snapshot of that prefix for the worker's *current* build, the keeper
restores it instead (`restore_and_prove`, no fallback warm) and the pinned fresh-tail
check is the re-warm's call. `SnapshotRewarm` says what each way cost: the restore's
server time plus the check's wall time and its uncached tokens, against the prefix tokens
a re-prefill would have computed and the newest cold call of this prefix measured on this
build (None when none was).

Invariants:
- Only a `restored` verdict (the check's cached count covers the prefix's span) replaces
  the re-warm; any other outcome (no snapshot for this build, a refused restore, a restore
  that did not resume, a snapshot file that no longer matches its record) is reported and
  the keeper re-warms normally.
- The restore goes into a slot no other kept prefix is known to hold, so it never
  overwrites what the keeper just brought back.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from prefixreg.core.errors import IntegrityError, WorkerError
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.prefix import Prefix
from prefixreg.registry.snapshots import list_snapshots
from prefixreg.registry.store import Registry
from prefixreg.server.slots import list_slots
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import CallRecord
from prefixreg.verbs.snapshot.run import restore_and_prove

__all__ = ["SnapshotRewarm", "restore_for_keepalive"]


@dataclass(frozen=True, slots=True)
class SnapshotRewarm:
    """One attempt to restore a lost prefix: the verdict, and tokens and seconds each way.

    `check` is the pinned resume check when the restore was `restored` (the keeper's
    re-warm call), else None.
    """

    sha256: str
    verdict: str
    reason: str
    check: CallRecord | None = None
    slot: int | None = None
    restore_s: float | None = None  # the server's restore time plus the check's wall time
    restore_tokens: int | None = None  # tokens the check computed (its uncached part)
    prefill_tokens: int | None = None  # prefix tokens a re-prefill would have computed
    prefill_s: float | None = None  # the newest cold call of this prefix on this build

    @property
    def restored(self) -> bool:
        return self.verdict == "restored" and self.check is not None

    def to_dict(self) -> JSONObject:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "slot": self.slot,
            "restore_s": self.restore_s,
            "restore_tokens": self.restore_tokens,
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
        }


def _free_slot(worker: Worker, taken: Collection[int]) -> int | None:
    """The first idle slot not `taken` by another kept prefix (None: let the server pick)."""
    try:
        slots = list_slots(worker)
    except WorkerError:
        return None
    free = [s.id for s in slots if not s.is_processing and s.id not in taken]
    return free[0] if free else None


def _last_cold_s(registry: Registry, sha: str, build_id: str) -> float | None:
    """Wall seconds of the newest cold call of `sha` measured on `build_id`, or None."""
    for m in reversed(registry.measurements(sha)):
        if m.build.build_id != build_id:
            continue
        calls = m.body.get("calls")
        for call in calls if isinstance(calls, list) else []:
            ev = call.get("evidence") if isinstance(call, dict) else None
            if isinstance(ev, dict) and ev.get("cache_state") == "cold":
                wall = ev.get("wall_s")
                if isinstance(wall, int | float) and not isinstance(wall, bool):
                    return float(wall)
    return None


def restore_for_keepalive(
    registry: Registry, worker: Worker, prefix: Prefix, *, taken: Collection[int] = ()
) -> SnapshotRewarm | None:
    """Restore `prefix`'s snapshot for the worker's current build and prove it (see the
    module docstring); never falls back to a warm itself: the keeper does. None (and no
    request sent) when the prefix has no snapshot record at all.

    Raises:
        WorkerError: the worker failed outside the restore request (the keeper's error path).
    """
    sha = prefix.sha256
    try:
        if not list_snapshots(registry, sha):
            return None
        result = restore_and_prove(
            registry, sha, worker, slot=_free_slot(worker, taken), fallback_warm=False
        )
    except IntegrityError as exc:  # the file changed: nothing was sent; re-prefill instead
        return SnapshotRewarm(sha, "integrity", str(exc))
    check = result.check if result.verdict == "restored" else None
    ev = None if result.check is None else result.check.evidence
    t = result.transfer
    restore_s = None
    if t is not None and t.server_ms is not None and ev is not None and ev.wall_s is not None:
        restore_s = t.server_ms / 1000 + ev.wall_s
    uncached = None
    if ev is not None and ev.prompt_tokens is not None and ev.cached_tokens is not None:
        uncached = ev.prompt_tokens - ev.cached_tokens
    return SnapshotRewarm(
        sha,
        result.verdict,
        result.reason,
        check=check,
        slot=None if t is None else t.slot_id,
        restore_s=restore_s,
        restore_tokens=uncached,
        prefill_tokens=None if ev is None else ev.cached_tokens,
        prefill_s=_last_cold_s(registry, sha, result.build.build_id),
    )
