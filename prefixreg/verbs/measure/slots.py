"""The calls a KV snapshot save or restore makes on one slot: a warm that finds (or pins)
the slot serving a prefix, and a fresh-tail resume check pinned to a slot.

Invariants:
- A check is pinned with `id_slot`, so its cached count speaks of that slot and no other;
  its verdict is the judge's (the cached count must cover the prefix's span).
- The slot a warm used is read from `/slots` (`id_task` moved); when that is ambiguous the
  warm is pinned to an idle slot instead of guessing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.server.slots import SlotInfo, idle_slot, list_slots
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import CallRecord, judge_check, measured_call

__all__ = ["Progress", "pinned_check", "readable_dir", "say_to", "warm_and_locate"]

Progress = Callable[[str], None] | None


def say_to(progress: Progress) -> Callable[[str], None]:
    return progress or (lambda _msg: None)


def pinned_check(
    worker: Worker, prefix: Prefix, slot_id: int
) -> tuple[CallRecord, str, str, int | None, float | None]:
    """A fresh-tail resume check pinned to `slot_id`: (call, verdict, reason, span, coverage)."""
    tail = fresh_tail()
    call = measured_call(
        worker, prefix, phase="check", tail=tail, with_cache=False, id_slot=slot_id
    )
    j = judge_check(call.evidence, prefix, tail=tail, alignment=0)
    return call, j.verdict, j.reason, j.span, j.coverage


def readable_dir(path: Path | None) -> bool:
    return path is not None and path.is_dir() and os.access(path, os.R_OK | os.X_OK)


def warm_and_locate(
    worker: Worker, prefix: Prefix, slot: int | None
) -> tuple[CallRecord, SlotInfo]:
    """The warm call and the slot that served it.

    Without `slot`, llama.cpp picks the slot whose cached prompt shares the most with the
    call, so a slot already holding the prefix serves it without a prefill; that slot is
    the one whose `id_task` moved in `/slots`. When that is ambiguous (other traffic moved
    more than one slot) or `slot` is given, the warm call is pinned to an idle slot.
    """
    if slot is None:
        before = {s.id: s.id_task for s in list_slots(worker)}
        warm = measured_call(worker, prefix, phase="warm", tail=fresh_tail(), with_cache=False)
        moved = [s for s in list_slots(worker) if s.id_task != before.get(s.id)]
        if len(moved) == 1 and not moved[0].is_processing:
            return warm, moved[0]
    chosen = idle_slot(worker, prefer=slot)
    warm = measured_call(
        worker, prefix, phase="warm", tail=fresh_tail(), with_cache=False, id_slot=chosen.id
    )
    return warm, chosen
