"""`SimConfig`: every knob of the simulator, with the measured value as its default. Pure.

Defaults are the Halogen Flash lane as measured (API 0.7.0): an LRU of 8 fixed-size entries
(slabs of 116,389,652 bytes, /health `cap_mb` 110), 2 snapshots per request, no snapshot
alignment, counters lagging one call, 4 slots of 262,144 tokens, `max_tokens` cap 65,536, queue
timeout 3,600 s, SSE keepalive every 10 s, and the time model of `prefixreg.sim.timing` fitted to
the lane's probe (cold 3.38 / 9.81 / 17.16 / 33.26 s at 2,593 / 11,374 / 21,337 / 43,538 prompt
tokens, identical repeat 0.12-0.19 s, fresh tail 0.4-0.69 s).

The wall. A Flash entry is a slab; a snapshot of t tokens needs ``t * token_bytes`` of it and a
snapshot its slab cannot take is refused (counted in `/cache` `refused`). ``cap_mb`` is the
cache-size option (``cacheMb`` -> ``HALOGEN_CACHE_MB``): on Flash, when set, each slab is
``cap_mb`` MiB (0 = the measured ``entry_bytes`` slab); on dense it is the whole budget, cut
into whole ``entry_bytes`` entries (61,440 MiB = 64.4 GB -> 3 entries of ~18.4 GB, as the
startup lines quoted in halogen-api.md §2.1). ``token_bytes`` is not measured: the lane stored
a 43,531-token snapshot in a 111 MiB slab (so at most 2,673 B a token); 2,048 puts the default
wall at 56,830 tokens.

The `dense` profile (Halogen dense, 0.1.x) differs where the reference says it does: snapshots
aligned to 2048 with partial resume (cached counts are multiples of 2048), one request at a
time, whole full-context entries, no counter lag (the lag is a Flash measurement), no duplicate
snapshots, queue timeout 7,200 s, no `timings`, no `/metrics`, no disk tier. Build a dense
config with `SimConfig.for_profile("dense")`; plain `SimConfig()` is flash.

`speed` compresses time: every modelled duration (prefill, decode, disk restores, queue
timeout, keepalive interval) is divided by it, so tests run in milliseconds while every ratio
holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

from prefixreg.core.errors import UsageError

__all__ = ["MIB", "PROFILES", "PROFILE_DEFAULTS", "Profile", "SimConfig"]

Profile = Literal["flash", "dense"]
PROFILES: tuple[str, ...] = get_args(Profile)

MIB = 1 << 20
FLASH_ENTRY_BYTES = 116_389_652  # measured `last_entry_bytes`, whatever the prompt size
DENSE_ENTRY_BYTES = 18_400_000_000  # "whole full-context entries of ~18.4 GB at 262K"
DENSE_CAP_MB = 61_440  # 64.4 GB: the documented AUTO budget that gives 3 entries


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """All simulator options. Field defaults are the measured Flash lane."""

    profile: Profile = "flash"
    host: str = "127.0.0.1"  # loopback only unless asked
    port: int = 0  # 0: an ephemeral port (tests); the CLI defaults to Halogen's 8731
    api_key: str | None = field(default=None, repr=False)  # never shown
    model: str | None = None  # None: "prefixreg-sim-<profile>"
    max_entries: int = 8
    entries_per_request: int = 2
    snapshot_align: int = 0
    entry_bytes: int = FLASH_ENTRY_BYTES
    cap_mb: int = 0
    token_bytes: int = 2048
    counter_lag: int = 1
    dedupe_snapshots: bool = False
    prefill_tps: float = 1370.0
    prefill_setup_s: float = 1.4706
    step_ms: float = 20.28
    step_ms_per_kctx: float = 0.0855
    decode_tps: float = 60.0
    slots: int = 4
    slot_ctx: int = 262_144
    max_tokens_cap: int = 65_536
    queue_timeout: float = 3600.0
    keepalive: float = 10.0
    answer_tokens: int = 24
    cache_dir: str | None = None
    disk_gib: float = 64.0
    disk_token_bytes: int = 27 * 1024
    disk_read_mbps: float = 2000.0
    speed: float = 1.0

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise UsageError(f"unknown simulator profile {self.profile!r}; use flash or dense")
        checks: tuple[tuple[str, bool], ...] = (
            ("max_entries must be >= 0", self.max_entries >= 0),
            ("entries_per_request must be >= 1", self.entries_per_request >= 1),
            ("snapshot_align must be >= 0", self.snapshot_align >= 0),
            (
                "the dense profile needs snapshot_align >= 1",
                self.profile != "dense" or self.snapshot_align >= 1,
            ),
            ("entry_bytes must be >= 1", self.entry_bytes >= 1),
            ("cap_mb must be >= 0", self.cap_mb >= 0),
            ("token_bytes must be >= 0 (0: no per-token wall)", self.token_bytes >= 0),
            ("counter_lag must be >= 0", self.counter_lag >= 0),
            ("prefill_tps must be > 0", self.prefill_tps > 0),
            ("prefill_setup_s must be >= 0", self.prefill_setup_s >= 0),
            ("step_ms must be > 0", self.step_ms > 0),
            ("step_ms_per_kctx must be >= 0", self.step_ms_per_kctx >= 0),
            ("decode_tps must be > 0", self.decode_tps > 0),
            ("slots must be >= 1", self.slots >= 1),
            ("slot_ctx must be >= 1", self.slot_ctx >= 1),
            ("max_tokens_cap must be >= 1", self.max_tokens_cap >= 1),
            ("queue_timeout must be >= 0", self.queue_timeout >= 0),
            ("keepalive must be >= 0 (0 disables it)", self.keepalive >= 0),
            ("answer_tokens must be >= 1", self.answer_tokens >= 1),
            ("cache_dir must not be empty", self.cache_dir is None or self.cache_dir != ""),
            (
                "the disk tier (cache_dir) is a Flash feature",
                self.cache_dir is None or self.profile == "flash",
            ),
            ("disk_gib must be > 0", self.disk_gib > 0),
            ("disk_token_bytes must be >= 1", self.disk_token_bytes >= 1),
            ("disk_read_mbps must be > 0", self.disk_read_mbps > 0),
            ("speed must be > 0", self.speed > 0),
            ("port must be in 0..65535", 0 <= self.port <= 65535),
        )
        for message, ok in checks:
            if not ok:
                raise UsageError(f"simulator: {message}")

    @classmethod
    def for_profile(cls, profile: str, **overrides: Any) -> SimConfig:
        """The profile's defaults, then every override that is not None."""
        if profile not in PROFILES:
            raise UsageError(f"unknown simulator profile {profile!r}; use flash or dense")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UsageError(f"simulator: unknown option(s) {', '.join(unknown)}")
        values: dict[str, Any] = dict(PROFILE_DEFAULTS[profile])
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["profile"] = profile
        return cls(**values)

    @property
    def model_id(self) -> str:
        return self.model or f"prefixreg-sim-{self.profile}"

    @property
    def timings(self) -> bool:
        """Flash reports a `timings` object (with `cache_n`); dense has none."""
        return self.profile == "flash"

    @property
    def slab_bytes(self) -> int:
        """Bytes of one entry: the Flash slab (`cap_mb` MiB when set), or the dense entry."""
        if self.profile == "flash" and self.cap_mb > 0:
            return self.cap_mb * MIB
        return self.entry_bytes

    @property
    def budget_bytes(self) -> int | None:
        """The whole cache budget (dense: `cap_mb` MiB); None: only `max_entries` bounds it."""
        return self.cap_mb * MIB if self.profile == "dense" else None

    @property
    def capacity(self) -> int:
        """Entries the cache can hold: `max_entries`, cut by the dense budget."""
        budget = self.budget_bytes
        if budget is None:
            return self.max_entries
        return min(self.max_entries, budget // self.slab_bytes)

    def scaled(self, seconds: float) -> float:
        """A modelled duration in real seconds under `speed`."""
        return seconds / self.speed

    def with_(self, **changes: Any) -> SimConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


PROFILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "flash": {},
    "dense": {
        "max_entries": 3,  # "3 x 262144-token entries" (halogen-server issue #5 startup line)
        "entries_per_request": 1,
        "snapshot_align": 2048,  # HALOGEN_CACHE_ALIGN default
        "entry_bytes": DENSE_ENTRY_BYTES,
        "cap_mb": DENSE_CAP_MB,
        "token_bytes": 0,  # a dense entry is a whole full-context entry: no per-token wall
        "counter_lag": 0,
        "dedupe_snapshots": True,
        "slots": 1,  # batch-1
        "queue_timeout": 7200.0,
    },
}
