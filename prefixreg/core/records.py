"""Frozen record types and their strict (de)serialisation. Pure: no I/O.

Every `from_dict` validates types exactly and raises `CorruptRecordError` on anything
unexpected: a record read from disk is well-formed or refused. `to_dict` is the on-disk
form. Records never hold credentials, tail text or output text: only counts, hashes, labels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Final, Literal, Self, cast

from prefixreg.core.digest import build_id as compute_build_id
from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import ArgumentTypeError, ArgumentValueError, CorruptRecordError
from prefixreg.core.fields import decode, encode

from prefixreg.core.fields import strict_count as strict_count  # isort: skip  (re-exported)
from prefixreg.core.jsonio import JSONObject, JSONValue

CacheState = Literal["cold", "reused", "unverified"]


class _Record:
    """A record read by `fields.decode` and written by `fields.encode`."""

    __slots__ = ()
    WHAT: ClassVar[str]
    KEYS: ClassVar[Mapping[str, str] | None] = None  # field name -> JSON key, where they differ
    SHAS: ClassVar[tuple[str, ...]] = ()  # fields that must hold a sha256 (None passes)

    def __post_init__(self) -> None:
        for name in self.SHAS:
            value = getattr(self, name)
            if value is not None and not is_full_sha(value):
                raise CorruptRecordError(f"{self.WHAT}: field {name!r} is not a sha256")

    @classmethod
    def from_dict(cls, data: object) -> Self:
        return decode(cls, data, cls.WHAT, keys=cls.KEYS)

    def to_dict(self) -> JSONObject:
        return encode(self, keys=self.KEYS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Meta(_Record):
    """`meta/<sha256>.json`: what an object is, never what it contains."""

    WHAT: ClassVar[str] = "meta record"
    SHAS: ClassVar[tuple[str, ...]] = ("sha256",)
    sha256: str
    bytes: int
    created: str
    source: str
    note: str | None = None

    def __post_init__(self) -> None:
        _Record.__post_init__(self)
        if strict_count(self.bytes) is None:  # a read record was checked so by `decode`
            kind = ArgumentTypeError if type(self.bytes) is not int else ArgumentValueError
            raise kind(f"Meta: bytes is a whole number >= 0, not {self.bytes!r}")

    @staticmethod
    def plain_size(data: JSONObject | None, sha: str) -> int | None:
        """The `bytes` of the record of object `sha` when `data` (`jsonio.loads_flat`) is in
        exactly the shape `add` writes, else None: `from_dict` then reads it (and says what
        is wrong). What `from_flat` checks, without building the record (verify's hot path)."""
        if data is None or not 4 <= len(data) <= 5 or data.get("sha256") != sha:
            return None
        size, created, source = data.get("bytes"), data.get("created"), data.get("source")
        note = data.get("note")
        plain = type(size) is int and size >= 0 and type(created) is str
        plain = plain and type(source) is str and (note is None or type(note) is str)
        if not plain or len(data) != 4 + ("note" in data) or not is_full_sha(sha):
            return None
        return cast(int, size)

    @classmethod
    def from_flat(cls, data: JSONObject | None, sha: str) -> Meta | None:
        """The record of object `sha` from a flat object (`jsonio.loads_flat`) in exactly the
        shape `add` writes, else None: `from_dict` then reads it (and says what is wrong).
        Equal to what `from_dict` gives for the same object, at a fraction of the cost."""
        if data is None or (size := cls.plain_size(data, sha)) is None:
            return None
        note, created, source = data.get("note"), data.get("created"), data.get("source")
        return cls(
            sha256=sha,
            bytes=size,
            created=cast(str, created),
            source=cast(str, source),
            note=cast("str | None", note),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class NameMove(_Record):
    """One line of `names.log`: a name moved from one sha (or nothing) to another."""

    WHAT: ClassVar[str] = "names.log line"
    KEYS: ClassVar[Mapping[str, str] | None] = {"from_sha": "from", "to_sha": "to"}
    SHAS: ClassVar[tuple[str, ...]] = ("from_sha", "to_sha")
    at: str
    name: str
    from_sha: str | None
    to_sha: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerBuild(_Record):
    """A measurement's server: its profile's `identity` fields (DESIGN §4), and `build_id`,
    derived from both and re-checked on load."""

    WHAT: ClassVar[str] = "server build"
    profile: str
    identity: JSONObject
    build_id: str = field(default="")

    def __post_init__(self) -> None:
        try:
            expected = compute_build_id({"profile": self.profile, "identity": self.identity})
        except (TypeError, ValueError) as exc:  # NaN, ints beyond 64 bits: not canonical JSON
            raise CorruptRecordError(f"server build: identity is not JSON ({exc})") from None
        if not self.build_id:
            object.__setattr__(self, "build_id", expected)
        elif self.build_id != expected:
            raise CorruptRecordError(
                f"server build: build_id {self.build_id} does not match its identity ({expected})"
            )

    @property
    def snapshot_align(self) -> int:
        """Halogen's `prompt_cache.snapshot_align` (cached counts round down to it), else 0."""
        block = self.identity.get("prompt_cache")
        return (strict_count(block.get("snapshot_align")) or 0) if isinstance(block, dict) else 0

    def to_dict(self, *, public: bool = False) -> JSONObject:
        """The record form; `public` gives the receipt form (see `public_identity`)."""
        out = encode(self)
        return out | {"identity": public_identity(self.identity), "public": True} if public else out


# Identity fields a public receipt keeps (with the keys kept inside an object): release
# strings (halogen's `version`, vllm's; llama.cpp's `build_info`: build number and commit),
# hashes, sizes and the cache's settings. Everything else (the model id or alias, a model
# file path, the served model ids, any field a server may add) is dropped: an allowlist, so
# a new field is private by default.
PUBLIC_IDENTITY: Final[Mapping[str, frozenset[str] | None]] = {
    **dict.fromkeys(("chat_template_sha256", "checkpoint_format", "context", "slots")),
    **dict.fromkeys(("slot_ctx", "build_info", "n_ctx", "total_slots")),
    "version": frozenset({"api", "engine", "match"}),
    "prompt_cache": frozenset(
        {"enabled", "cap_mb", "mode", "snapshot_align", "bitwise_identical_to_cold"}
    ),
}
_PUBLIC_SCALARS = (str, int, float, bool, type(None))


def public_identity(identity: Mapping[str, JSONValue]) -> JSONObject:
    """`identity` without the model id and every host-identifying field: `PUBLIC_IDENTITY`
    with scalar values, and only the listed keys inside an object. A public build keeps the
    `build_id` of the full identity (it links receipts of one build, but cannot be
    recomputed), so public receipts are marked `"public": true` and never loaded back."""
    out: JSONObject = {}
    for key in sorted(PUBLIC_IDENTITY.keys() & identity.keys()):
        value, nested = identity[key], PUBLIC_IDENTITY[key]
        if isinstance(value, dict) and nested is not None:
            kept = sorted(value.items())
            out[key] = {k: v for k, v in kept if k in nested and isinstance(v, _PUBLIC_SCALARS)}
        elif isinstance(value, _PUBLIC_SCALARS):
            out[key] = value
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheCounters(_Record):
    """A Halogen `/cache` reply: only strict counts survive; one missing or malformed is None."""

    WHAT: ClassVar[str] = "cache counters"
    entries: int | None = None
    max_entries: int | None = None
    bytes: int | None = None
    last_entry_bytes: int | None = None
    hits: int | None = None
    misses: int | None = None
    stores: int | None = None
    evicted: int | None = None
    refused: int | None = None
    superseded: int | None = None
    prompt_tokens_saved: int | None = None

    @classmethod
    def from_server(cls, data: Mapping[str, object]) -> CacheCounters:
        """Build from a server reply, dropping (to None) anything not a strict count."""
        return cls(**{name: strict_count(data.get(name)) for name in CACHE_COUNTER_FIELDS})


CACHE_COUNTER_FIELDS: Final = tuple(f.name for f in dataclasses.fields(CacheCounters))


@dataclass(frozen=True, slots=True, kw_only=True)
class CallEvidence(_Record):
    """What the server reported about one call, and what it proves (DESIGN §4). `error` is our
    short code, never the server's text; `reason`, why unverified; `disk_restore_*`, what it
    restored from its disk tier (None in older records)."""

    WHAT: ClassVar[str] = "call evidence"
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    cached_source: str | None
    cache_state: CacheState
    complete: bool
    output_sha256: str | None = None
    token_sha: str | None = None
    ttft_s: float | None = None
    wall_s: float | None = None
    prompt_ms: float | None = None
    predicted_ms: float | None = None
    disk_restore_tokens: int | None = None
    disk_restore_ms: float | None = None
    error: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement(_Record):
    """`measurements/<sha256>-<ts>.json`: one leg bound to a server build, `body` its use case's
    fields. Public receipts drop `worker`, `model` and the build's host-identifying fields."""

    WHAT: ClassVar[str] = "measurement"
    SHAS: ClassVar[tuple[str, ...]] = ("sha256",)
    sha256: str
    at: str
    kind: str
    build: ServerBuild
    body: JSONObject
    worker: str | None = None
    model: str | None = None

    @property
    def outcome(self) -> Outcome:
        """The judged part of the body, typed."""
        return Outcome.from_body(self.body)

    def to_dict(self, *, public: bool = False) -> JSONObject:
        out = encode(self) | {"build": self.build.to_dict(public=public)}
        return {k: v for k, v in out.items() if k not in ("worker", "model")} if public else out


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """A measurement body's findings, read leniently: a field of the wrong type (an older
    record, a hand edit) reads as None, never as a value it does not hold."""

    verdict: str | None
    reason: str | None
    span_tokens: int | None
    alignment: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    frame: str | None
    interleaved: bool | None
    phases: tuple[str, ...]

    @classmethod
    def from_body(cls, body: Mapping[str, object]) -> Outcome:
        def text(key: str) -> str | None:
            value = body.get(key)
            return value if isinstance(value, str) else None

        calls = body.get("calls")
        listed = calls if isinstance(calls, list) else []
        phases = [c.get("phase") for c in listed if isinstance(c, dict)]
        interleaved, frame = body.get("interleaved"), text("frame")
        return cls(
            verdict=text("verdict"),
            reason=text("reason"),
            span_tokens=strict_count(body.get("span_tokens")) or None,
            alignment=strict_count(body.get("alignment")),
            prompt_tokens=strict_count(body.get("prompt_tokens")),
            cached_tokens=strict_count(body.get("cached_tokens")),
            frame=frame if frame is not None and is_full_sha(frame) else None,
            interleaved=interleaved if isinstance(interleaved, bool) else None,
            phases=tuple(p for p in phases if isinstance(p, str)),
        )
