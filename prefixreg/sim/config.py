"""`SimConfig`: every knob of the simulator, with the measured value as its default. Pure.

Defaults are the Halogen Flash lane as measured (API 0.7.0): an LRU of 8 fixed-size entries
(116,389,652 bytes, `cap_mb` 110), 2 snapshots per request, no snapshot alignment, counters
lagging one call, 4 slots of 262,144 tokens, cold prefill ~1,180 tok/s, decode ~60 tok/s,
`max_tokens` cap 65,536, queue timeout 3,600 s, SSE keepalive every 10 s.

The `dense` profile (Halogen dense, 0.1.x) differs where the reference says it does: snapshots
aligned to 2048 with partial resume (cached counts are multiples of 2048), one request at a
time, whole full-context entries (`slot_ctx` x 64 KiB), queue timeout 7,200 s, no `timings`.
Build a dense config with `SimConfig.for_profile("dense")`; plain `SimConfig()` is flash.

`speed` compresses time: every modelled duration (prefill, decode, queue timeout, keepalive
interval) is divided by it, so tests run in milliseconds while every ratio holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

from prefixreg.core.errors import UsageError

__all__ = ["PROFILES", "PROFILE_DEFAULTS", "Profile", "SimConfig"]

Profile = Literal["flash", "dense"]
PROFILES: tuple[str, ...] = get_args(Profile)

FLASH_ENTRY_BYTES = 116_389_652  # measured `last_entry_bytes`, whatever the prompt size
DENSE_SLOT_CTX = 262_144


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
    counter_lag: int = 1
    prefill_tps: float = 1180.0
    decode_tps: float = 60.0
    slots: int = 4
    slot_ctx: int = 262_144
    max_tokens_cap: int = 65_536
    queue_timeout: float = 3600.0
    keepalive: float = 10.0
    answer_tokens: int = 24
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
            ("counter_lag must be >= 0", self.counter_lag >= 0),
            ("prefill_tps must be > 0", self.prefill_tps > 0),
            ("decode_tps must be > 0", self.decode_tps > 0),
            ("slots must be >= 1", self.slots >= 1),
            ("slot_ctx must be >= 1", self.slot_ctx >= 1),
            ("max_tokens_cap must be >= 1", self.max_tokens_cap >= 1),
            ("queue_timeout must be >= 0", self.queue_timeout >= 0),
            ("keepalive must be >= 0 (0 disables it)", self.keepalive >= 0),
            ("answer_tokens must be >= 1", self.answer_tokens >= 1),
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
        "entry_bytes": DENSE_SLOT_CTX * 64 * 1024,  # slot_ctx x 64 KiB of KV
        "slots": 1,  # batch-1
        "queue_timeout": 7200.0,
    },
}
