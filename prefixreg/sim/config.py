"""`SimConfig`: every knob of the simulator, its default the measured Halogen Flash lane (API
0.7.0), and the time model the knobs drive. Pure but for `from_options`. Each field carries its
option's metadata (`knob`): help, ``note`` (the default's source), bound (``ge`` / ``gt``,
``why``), ``dense`` default and CLI extras (``shown``, ``cli_default``, ``env``); `prefixreg sim`
builds its options from them, and `from_options` reads them back (a field not given falls back
to its ``env`` variable: the one read of the environment here). A value of the wrong type or out
of bounds is a `UsageError` naming the field, and so is a `host` that is not a loopback address
(the peer has no API key by default). The `dense` profile (Halogen dense 0.1.x): each field's
``dense``, no `timings`, `/metrics` or disk.

The time model (`prefill_s`; its formula and fit to the lane's probe in `prefixreg sim --help`):
``u`` uncached tokens prefill in the cheaper of stepping them (a short pass is latency-bound like
decode) and a batched pass, crossing near 75 tokens: no model linear in the uncached tokens reaches
the measured fresh-tail / identical-repeat ratio (3.3-3.6 > 19/7). Decode: ``completion /
decode_tps``; disk restore: ``bytes / (disk_read_mbps * 10^6)``. `speed` divides every modelled
duration (prefill, decode, disk restores, queue timeout, keepalive interval): ratios hold.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NoReturn, TypeVar, get_args

from prefixreg.core.errors import UsageError

Profile = Literal["flash", "dense"]
ENGINES: tuple[str, ...] = ("vllm", "sglang", "trtllm", "ollama")  # sim.engines' shapes
PROFILES: tuple[str, ...] = get_args(Profile)

MIB = 1 << 20
T = TypeVar("T")


def knob(default: T, doc: str, note: str = "", *, repr: bool = True, **meta: Any) -> T:
    """A `SimConfig` field with its option's metadata."""
    return field(default=default, repr=repr, metadata={"help": doc, "note": note, **meta})


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refuse(problem: str) -> NoReturn:
    raise UsageError(f"simulator: {problem}")


def kind_of(default: object) -> type:
    """The type a field's values have, read from its default (None: an optional string)."""
    return str if default is None else type(default)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """All simulator options. Field defaults are the measured Flash lane."""

    profile: Profile = knob(
        "flash",
        "flash (the measured Halogen Flash lane, API 0.7.0) or dense (Halogen dense: "
        "2048-aligned snapshots, no timings).",
    )
    engine: str | None = knob(
        None,
        "Serve as this engine: vllm, sglang, trtllm or ollama (its reply shapes, routes, headers "
        "and metrics, over the same cache model).",
        shown="Halogen",
    )
    cache_report: bool = knob(
        True,
        "With --engine: its per-call cache report is on. --no-cache-report serves vLLM without "
        "--enable-prompt-tokens-details, SGLang without --enable-cache-report, Ollama before "
        "0.33.3.",
    )
    host: str = knob("127.0.0.1", "Address to bind.", "loopback only")
    port: int = knob(0, "Port to bind; 0 picks a free one.", "Halogen's API port", cli_default=8731)
    api_key: str | None = knob(  # repr=False: never shown
        None,
        "Require 'Authorization: Bearer KEY' (401 otherwise; /health stays open).",
        shown="$PREFIXREG_SIM_API_KEY, else no key",
        env="PREFIXREG_SIM_API_KEY",
        repr=False,
    )
    model: str | None = knob(None, "Model id reported.", shown="prefixreg-sim-<profile>")
    # dense: "3 x 262144-token entries" (the halogen-server issue #5 startup line)
    max_entries: int = knob(8, "LRU capacity in snapshots.", "measured", ge=0, dense=3)
    entries_per_request: int = knob(
        2,
        "Snapshots stored per request (flash: system end, history end, then last message "
        "start, prompt end).",
        "measured",
        ge=1,
        dense=1,
    )
    snapshot_align: int = knob(  # dense: HALOGEN_CACHE_ALIGN's default
        0, "Snapshot places round down to this multiple; 0 = exact.", "measured", ge=0, dense=2048
    )
    # Flash: the measured `last_entry_bytes`, whatever the prompt size; dense: "whole
    # full-context entries of ~18.4 GB at 262K".
    entry_bytes: int = knob(
        116_389_652, "Size of one entry (slab) in bytes.", "measured", ge=1, dense=18_400_000_000
    )
    cap_mb: int = knob(  # dense: 64.4 GB, the documented AUTO budget that gives 3 entries
        0,
        "The cache-size option (cacheMb -> HALOGEN_CACHE_MB), in MiB. Flash: the size of one "
        "entry's slab (0 = --entry-bytes); dense: the whole budget, cut into whole entries.",
        ge=0,
        dense=61_440,
    )
    token_bytes: int = knob(  # dense: a whole full-context entry, no per-token wall
        2048,
        "Bytes of its slab a snapshot needs per token; a snapshot over the slab is refused. "
        "0 = no per-token wall.",
        "not measured: the lane stored 43,531 tokens in a 111 MiB slab",
        ge=0,
        why="0: no per-token wall",
        dense=0,
    )
    counter_lag: int = knob(
        1,
        "Requests before a call's hits/misses/prompt_tokens_saved show in /cache; 0 = immediate.",
        "measured on Flash",
        ge=0,
        dense=0,
    )
    dedupe_snapshots: bool = knob(
        False,
        "Refresh an identical snapshot instead of storing it again.",
        "measured on Flash 0.7.0: snapshot every request",
        dense=True,
    )
    prefill_tps: float = knob(1370.0, "Batched prefill throughput, tokens/s.", "fitted", gt=0)
    prefill_setup_s: float = knob(1.4706, "Seconds of a batched prefill pass.", "fitted", ge=0)
    step_ms: float = knob(20.28, "Milliseconds to step one token (short passes).", "fitted", gt=0)
    step_ms_per_kctx: float = knob(
        0.0855, "Extra milliseconds per stepped token per 1,000 tokens of context.", "fitted", ge=0
    )
    decode_tps: float = knob(60.0, "Decode speed, tokens/s.", "measured", gt=0)
    slots: int = knob(4, "Requests served at once; more wait.", "measured", ge=1, dense=1)
    slot_ctx: int = knob(262_144, "Tokens per slot; a longer prompt is a 400.", "measured", ge=1)
    max_tokens_cap: int = knob(65_536, "Largest max_tokens accepted; more is a 400.", ge=1)
    queue_timeout: float = knob(
        3600.0,
        "Seconds a request may wait for a slot before 503 engine_busy (divided by --speed).",
        ge=0,
        dense=7200.0,
    )
    keepalive: float = knob(
        10.0,
        "Seconds of streaming silence before a ': keepalive' line (divided by --speed); "
        "0 disables.",
        ge=0,
        why="0 disables it",
    )
    answer_tokens: int = knob(24, "Answer length in tokens (less if max_tokens is smaller).", ge=1)
    cached_differs: bool = knob(
        False,
        "A reply that resumed cached tokens ends with other bytes than the cold reply of the "
        "same prompt (a warm answer that is not bitwise the cold one).",
    )
    cache_dir: str | None = knob(
        None,
        "Flash disk tier (HALOGEN_CACHE_DIR): snapshots persist here across restarts and are "
        "restored from it (/cache disk, timings.disk_restore_n/ms).",
        "no disk tier",
    )
    disk_gib: float = knob(64.0, "Disk tier budget in GiB (HALOGEN_CACHE_DISK_GIB).", gt=0)
    disk_token_bytes: int = knob(27 * 1024, "Modelled disk bytes per token.", "~27 KiB", ge=1)
    disk_read_mbps: float = knob(2000.0, "Modelled disk read speed for restores, MB/s.", gt=0)
    speed: float = knob(1.0, "Time compression: every modelled duration is divided by this.", gt=0)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise UsageError(f"unknown simulator profile {self.profile!r}; use flash or dense")
        for f in fields(self):
            value, meta, kind = getattr(self, f.name), f.metadata, kind_of(f.default)
            if value is None and f.default is None:
                continue
            if not (type(value) is kind or (kind is float and type(value) is int)):
                _refuse(f"{f.name} must be of type {kind.__name__}, not {value!r}")
            ge, gt, why = meta.get("ge"), meta.get("gt"), meta.get("why")
            if (ge is not None and value < ge) or (gt is not None and value <= gt):
                bound = f">= {ge}" if ge is not None else f"> {gt}"
                _refuse(f"{f.name} must be {bound}" + (f" ({why})" if why else ""))
        if not self.flash and self.snapshot_align < 1:
            _refuse("the dense profile needs snapshot_align >= 1")
        if self.cache_dir == "":
            _refuse("cache_dir must not be empty")
        if self.cache_dir is not None and not self.flash:
            _refuse("the disk tier (cache_dir) is a Flash feature")
        if not 0 <= self.port <= 65535:
            _refuse("port must be in 0..65535")
        if not _loopback(self.host):  # a test and demo peer with no key by default
            _refuse(
                f"host must be a loopback address (127.0.0.1, ::1, localhost), not {self.host!r}"
            )
        if self.engine is not None and self.engine not in ENGINES:
            _refuse(f"unknown engine {self.engine!r}; one of {', '.join(ENGINES)}")
        if self.engine is not None and not self.flash:
            _refuse("an engine is served over the flash cache model, not dense")
        if self.engine == "trtllm" and not self.cache_report:
            _refuse("TensorRT-LLM always reports its cached tokens (PR #7637): no flag to turn off")

    @classmethod
    def for_profile(cls, profile: str, **overrides: Any) -> SimConfig:
        """The profile's defaults (dense: each field's ``dense``), then every override not None."""
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise UsageError(f"simulator: unknown option(s) {', '.join(unknown)}")
        dense = {f.name: f.metadata["dense"] for f in fields(cls) if "dense" in f.metadata}
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(**((dense if profile == "dense" else {}) | given | {"profile": profile}))

    @classmethod
    def from_options(cls, *, profile: str | None = None, **options: Any) -> SimConfig:
        """`prefixreg sim`'s options (None: not given): a field naming an ``env`` variable
        falls back to it when that is set and not empty, then `for_profile` (default flash)."""
        for f in fields(cls):
            if "env" in f.metadata and options.get(f.name) is None:
                options[f.name] = os.environ.get(f.metadata["env"]) or None
        return cls.for_profile(profile or "flash", **options)

    @property
    def model_id(self) -> str:
        return self.model or f"prefixreg-sim-{self.engine or self.profile}"

    @property
    def flash(self) -> bool:
        """Flash: exact places, `timings`, `/metrics`, a disk tier; dense: partial resume."""
        return self.profile == "flash"

    @property
    def slab_bytes(self) -> int:
        """Bytes of one entry: the Flash slab (`cap_mb` MiB when set), or the dense entry."""
        return self.cap_mb * MIB if self.flash and self.cap_mb > 0 else self.entry_bytes

    @property
    def capacity(self) -> int:
        """Entries the cache can hold: `max_entries`, cut by the dense budget (`cap_mb`)."""
        budget = self.max_entries if self.flash else self.cap_mb * MIB // self.slab_bytes
        return min(self.max_entries, budget)

    def prefill_s(self, *, prompt: int, cached: int) -> float:
        """Modelled seconds to prefill the `prompt - cached` uncached tokens (0 if none)."""
        uncached = prompt - cached
        if uncached <= 0:
            return 0.0
        step_s = (self.step_ms + prompt / 1000 * self.step_ms_per_kctx) / 1000
        return min(uncached * step_s, self.prefill_setup_s + uncached / self.prefill_tps)
