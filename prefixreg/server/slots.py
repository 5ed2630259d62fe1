"""llama.cpp's slot API on a `Worker`: `/slots`, and save, restore or erase a slot's KV state.

llama-server with `--slot-save-path DIR` answers `POST /slots/{id}?action=save|restore`
with `{"filename": NAME}` (a bare name in DIR) and `action=erase` with `{}`; replies carry
`n_saved`/`n_restored`/`n_erased`, bytes (`n_written`/`n_read`), `timings.save_ms`/
`restore_ms`. A chat call is pinned to a slot with `id_slot`.

Invariants:
- Only the `llamacpp` profile has a slot API: any other gets a `UsageError` (exit 2) before
  a slot request is sent, never a silent fallback that would look like a restore.
- Fields are read strictly: a slot is idle only when `is_processing` is exactly `false`
  (`"yes"`, `1`, missing: unknown); a count is `strict_count` (missing or malformed: None,
  never zero). A reply's counts never prove a restore resumes anything
  (`core.judge.judge_restore` needs a pinned check).
- Errors are the worker's own tree; a server without `--slot-save-path` answers 501: a
  `UsageError` with a hint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from prefixreg.core.errors import MalformedResponseError, UsageError, WorkerHTTPError
from prefixreg.core.fields import strict_number
from prefixreg.core.records import ServerBuild, strict_count
from prefixreg.server.worker import Worker

# action -> the reply's (tokens, bytes, server ms) fields.
_FIELDS: Final = {
    "save": ("n_saved", "n_written", "save_ms"),
    "restore": ("n_restored", "n_read", "restore_ms"),
    "erase": ("n_erased", "n_read", "erase_ms"),  # llama.cpp sends only the count
}


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One entry of `/slots`; `is_processing` None: not a JSON boolean (so not `idle`)."""

    id: int
    n_ctx: int | None
    is_processing: bool | None
    id_task: int | None

    @property
    def idle(self) -> bool:
        return self.is_processing is False


@dataclass(frozen=True, slots=True)
class SlotTransfer:
    """A save, restore or erase reply: tokens, bytes, the server's time, the client's wall time."""

    action: str
    slot_id: int
    filename: str
    n_tokens: int | None
    n_bytes: int | None
    server_ms: float | None
    wall_s: float


def require_slot_api(build: ServerBuild) -> None:
    """Refuse (UsageError, exit 2) a server whose profile has no slot save/restore API."""
    if build.profile != "llamacpp":
        raise UsageError(
            f"KV snapshots are not supported by this server's profile ({build.profile})",
            hint="snapshots need llama.cpp's llama-server started with --slot-save-path DIR",
        )


def list_slots(worker: Worker) -> list[SlotInfo]:
    """`GET /slots` as `SlotInfo`s; a server with the route off is a `UsageError`."""
    raw = worker.slots()
    if raw is None:
        raise UsageError(
            f"{worker.url} has no /slots route", hint="start llama-server without --no-slots"
        )
    out = []
    for slot in raw:
        sid, busy = strict_count(slot.get("id")), slot.get("is_processing")
        if sid is None:
            raise MalformedResponseError(f"GET /slots on {worker.url}: a slot without an id")
        n_ctx, task = strict_count(slot.get("n_ctx")), strict_count(slot.get("id_task"))
        out.append(SlotInfo(sid, n_ctx, busy if isinstance(busy, bool) else None, task))
    return out


def idle_slot(worker: Worker, prefer: int | None = None) -> SlotInfo:
    """An idle slot (`prefer` if it is idle); a 503 `WorkerHTTPError` when none is known idle."""
    idle = [s for s in list_slots(worker) if s.idle]
    if not idle:
        raise WorkerHTTPError(
            f"GET /slots on {worker.url}: no slot is idle",
            status_code=503,
            url=worker.url,
            hint="retry when the worker is idle",
        )
    return next((s for s in idle if s.id == prefer), idle[0])


def slot_action(worker: Worker, slot_id: int, action: str, filename: str = "") -> SlotTransfer:
    """POST `action` (save, restore, erase) for a slot; save and restore name a bare `filename`."""
    path, started = f"/slots/{slot_id}?action={action}", time.perf_counter()
    reply = worker.post_json(  # the worker's transport: its deadline, size cap, error tree
        path,
        {"filename": filename} if filename else {},
        seconds=max(worker.timeout, 120.0),  # disk I/O of tens of MB on the server
        missing=frozenset({501}),
    )
    wall = time.perf_counter() - started
    if reply is None:
        raise UsageError(
            f"POST {path} on {worker.url}: the server's slot actions are off",
            hint="start llama-server with --slot-save-path DIR",
        )
    tokens, size, ms = _FIELDS[action]
    timings = reply.get("timings")
    n_tokens, n_bytes = strict_count(reply.get(tokens)), strict_count(reply.get(size))
    server_ms = strict_number(timings.get(ms) if isinstance(timings, dict) else None)
    return SlotTransfer(action, slot_id, filename, n_tokens, n_bytes, server_ms, wall)
