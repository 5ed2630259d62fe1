"""`warm --restore` and `snapshot restore`: restore a head's snapshot and prove it (else a
normal warm follows), as a typed result the CLI renders and maps to its exit code.

Invariants: `restored` is the only outcome a restore itself succeeds with; a restore not
proven is `unverified` or `not_restored`, except that `as_warm` (`warm --restore`) lets the
fallback warm's verdict decide, as a plain `warm` would. Nothing here prints or exits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.slots import Progress, RestoreResult
from prefixreg.verbs.snapshot.run import restore_and_prove

# A fallback warm's verdicts that exit 0, as a plain `warm` of that verdict would.
_WARM_OK = ("resumed", "warmed")


@dataclass(frozen=True, slots=True)
class WarmRestore:
    """What a restore (and its fallback warm) came to; `as_warm` reads it as `warm --restore`
    does (the fallback warm decides, and the JSON says `outcome` and `resumed_by`)."""

    result: RestoreResult
    as_warm: bool = True

    @property
    def outcome(self) -> str:
        """`restored`; with `as_warm` the fallback warm's verdict; else `unverified` or
        `not_restored`."""
        r, fb = self.result, self.result.fallback
        if r.verdict == "restored" and fb is None:
            return "restored"
        if self.as_warm and fb is not None:
            return fb.verdict
        return "unverified" if r.verdict == "unverified" else "not_restored"

    def to_dict(self) -> JSONObject:
        """The `--json` receipt; `warm --restore` adds `outcome` (`restored` or the warm's
        verdict) and `resumed_by` (`restore`, `warm` or null)."""
        r, fb = self.result, self.result.fallback
        out = r.to_dict()
        if self.as_warm:
            by = "restore" if r.verdict == "restored" else None
            if by is None and fb is not None and fb.verdict in _WARM_OK:
                by = "warm"
            out |= {"outcome": r.verdict if fb is None else fb.verdict, "resumed_by": by}
        return out

    def text(self, exit_code: int) -> str:
        """The text a person reads; `exit_code` is the one the outcome maps to (the CLI's)."""
        r, fb = self.result, self.result.fallback
        t, call = r.transfer, r.check
        lines = [f"{r.head.kind:<8} {r.head.sha256[:16]} on build {r.build.build_id}"]
        if r.snapshot is not None:
            lines.append(f"file     {r.snapshot.file} ({r.file_check})")
        if t is not None:
            lines.append(
                f"restore  slot {t.slot_id} erased, then: server says {t.n_tokens} tokens, "
                f"{t.server_ms or 0:.1f} ms (not evidence by itself)"
            )
        if call is not None:
            ev = call.evidence
            lines.append(
                f"check    prompt {ev.prompt_tokens}, cached {ev.cached_tokens} "
                f"({ev.cache_state}), {ev.wall_s or 0:.3f} s"
            )
        lines.append(f"verdict  {r.verdict.upper()}: {r.reason}")
        if r.record_path:
            lines.append(f"record   {r.record_path}")
        if fb is not None:
            lines.append(
                f"warm     not restored; a normal warm followed ({fb.verdict}, exit {exit_code}):"
            )
        return "\n".join(lines) + "\n" + ("" if fb is None else fb.summary())


def warm_restore(
    registry: Registry,
    head: Head,
    worker: Worker,
    *,
    slot_dir: Path | None = None,
    slot: int | None = None,
    fallback: bool = True,
    as_warm: bool = True,
    progress: Progress = None,
) -> WarmRestore:
    """Restore and prove `head` (else warm, unless not `fallback`). Raises as
    `snapshot.run.restore_and_prove`."""
    result = restore_and_prove(
        registry,
        head,
        worker,
        slot_dir=slot_dir,
        slot=slot,
        fallback_warm=fallback,
        progress=progress,
    )
    return WarmRestore(result, as_warm=as_warm)
