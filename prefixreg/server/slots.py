"""llama.cpp's slot API on a `Worker`: list `/slots`, save, restore and erase a slot's KV state.

llama-server (started with `--slot-save-path DIR`) answers
`POST /slots/{id}?action=save|restore` with `{"filename": NAME}` (a bare name inside DIR):
save replies `{"id_slot","filename","n_saved","n_written","timings":{"save_ms"}}`, restore
`{"id_slot","filename","n_restored","n_read","timings":{"restore_ms"}}`, erase `{"n_erased"}`.
A chat call is pinned to a slot with the body field `id_slot` (`Worker.chat(..., id_slot=N)`).

Invariants:
- Only the `llamacpp` profile has a slot API; every other profile gets a `UsageError`
  ("not supported by this server's profile", exit 2) before any slot request is sent,
  never a silent fallback that would look like a restore.
- Counts in replies are strict (`strict_count`): a missing or malformed count is None,
  never zero. The reply's counts are reported, never taken as evidence that a restore
  resumes anything: only a resume check on the slot is.
- Errors are the worker's own error tree (one line, method and path named); a server
  started without `--slot-save-path` answers 501, turned into a `UsageError` with a hint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from prefixreg.core.errors import MalformedResponseError, UsageError, WorkerHTTPError
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.records import ServerBuild, strict_count
from prefixreg.server.worker import Worker

__all__ = [
    "SLOT_PROFILES",
    "SlotInfo",
    "SlotTransfer",
    "erase_slot",
    "idle_slot",
    "list_slots",
    "require_slot_api",
    "restore_slot",
    "save_slot",
]

SLOT_PROFILES: Final = ("llamacpp",)
# Saving or reading a snapshot is disk I/O on the server (tens of MB): more than a small route.
_SLOT_IO_TIMEOUT: Final = 120.0


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One entry of `/slots`: its id, context size, and whether it is busy right now."""

    id: int
    n_ctx: int | None
    is_processing: bool
    id_task: int | None


@dataclass(frozen=True, slots=True)
class SlotTransfer:
    """What a save or restore reply said: tokens and bytes moved, the server's own time, and
    the client's wall time for the request."""

    action: str
    slot_id: int
    filename: str
    n_tokens: int | None
    n_bytes: int | None
    server_ms: float | None
    wall_s: float

    def to_dict(self) -> JSONObject:
        return {
            "action": self.action,
            "slot_id": self.slot_id,
            "filename": self.filename,
            "n_tokens": self.n_tokens,
            "n_bytes": self.n_bytes,
            "server_ms": self.server_ms,
            "wall_s": self.wall_s,
        }


def require_slot_api(build: ServerBuild) -> None:
    """Refuse (UsageError, exit 2) a server whose profile has no slot save/restore API."""
    if build.profile not in SLOT_PROFILES:
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
        sid = strict_count(slot.get("id"))
        if sid is None:
            raise MalformedResponseError(f"GET /slots on {worker.url}: a slot without an id")
        busy = slot.get("is_processing")
        out.append(
            SlotInfo(
                id=sid,
                n_ctx=strict_count(slot.get("n_ctx")),
                is_processing=busy is True,
                id_task=strict_count(slot.get("id_task")),
            )
        )
    return out


def idle_slot(worker: Worker, prefer: int | None = None) -> SlotInfo:
    """An idle slot (`prefer` if it is idle), or a `WorkerError`-family error if none is."""
    slots = list_slots(worker)
    idle = [s for s in slots if not s.is_processing]
    for slot in idle:
        if slot.id == prefer:
            return slot
    if not idle:
        raise WorkerHTTPError(
            f"GET /slots on {worker.url}: every slot is busy",
            status_code=503,
            url=worker.url,
            hint="retry when the worker is idle",
        )
    return idle[0]


def _post(worker: Worker, slot_id: int, action: str, body: JSONObject) -> tuple[JSONObject, float]:
    path = f"/slots/{slot_id}?action={action}"
    started = time.perf_counter()
    # The worker's own transport: one deadline, one size cap, one error tree for all routes.
    reply = worker.post_json(
        path, body, seconds=max(worker.timeout, _SLOT_IO_TIMEOUT), missing=frozenset({501})
    )
    wall = time.perf_counter() - started
    if reply is None:
        raise UsageError(
            f"POST {path} on {worker.url}: the server's slot actions are off",
            hint="start llama-server with --slot-save-path DIR",
        )
    return reply, wall


def _ms(timings: JSONValue, key: str) -> float | None:
    value = timings.get(key) if isinstance(timings, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)


# action -> the reply's (tokens, bytes, server ms) fields.
_TRANSFER_FIELDS: Final = {
    "save": ("n_saved", "n_written", "save_ms"),
    "restore": ("n_restored", "n_read", "restore_ms"),
}


def _transfer(worker: Worker, slot_id: int, action: str, filename: str) -> SlotTransfer:
    reply, wall = _post(worker, slot_id, action, {"filename": filename})
    tokens, size, ms = _TRANSFER_FIELDS[action]
    return SlotTransfer(
        action=action,
        slot_id=slot_id,
        filename=filename,
        n_tokens=strict_count(reply.get(tokens)),
        n_bytes=strict_count(reply.get(size)),
        server_ms=_ms(reply.get("timings"), ms),
        wall_s=wall,
    )


def save_slot(worker: Worker, slot_id: int, filename: str) -> SlotTransfer:
    """Save slot `slot_id`'s KV state as `filename` in the server's slot directory."""
    return _transfer(worker, slot_id, "save", filename)


def restore_slot(worker: Worker, slot_id: int, filename: str) -> SlotTransfer:
    """Restore `filename` into slot `slot_id`. Its counts are reported, never proof."""
    return _transfer(worker, slot_id, "restore", filename)


def erase_slot(worker: Worker, slot_id: int) -> int | None:
    """Forget slot `slot_id`'s prompt; returns the server's `n_erased`."""
    reply, _ = _post(worker, slot_id, "erase", {})
    return strict_count(reply.get("n_erased"))
